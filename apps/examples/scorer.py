"""A user-defined reward actor: scores arithmetic answers by how close they are to the true result.

It lives in its own module, not in the app's `__main__`: spawned processes import actor classes by
module name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from forge.actor import ForgeActor, endpoint
from forge.metrics import record_metric

_LEADING_INT = re.compile(r"\s*(-?\d+)")


@dataclass
class ScorerConfig:
    distance_scale: float = 10.0  # an answer this far off the truth gets half credit

    def __post_init__(self) -> None:
        if self.distance_scale <= 0:
            raise ValueError(f"distance_scale={self.distance_scale}: must be > 0")


def closeness_reward(text: str, answer: str, distance_scale: float) -> float:
    """1.0 for the exact answer, `s / (s + |guess - answer|)` for a leading integer `guess`, else 0.0."""
    match = _LEADING_INT.match(text)
    if match is None:
        return 0.0
    distance = abs(int(match.group(1)) - int(answer))
    return distance_scale / (distance_scale + distance)


class Scorer(ForgeActor):
    def __init__(self, config: ScorerConfig) -> None:
        self.config = config

    @endpoint
    async def score(self, answer: str, texts: list[str]) -> list[float]:
        """One reward per completion text of a prompt whose true result is `answer`."""
        rewards = [closeness_reward(t, answer, self.config.distance_scale) for t in texts]
        # Recorded in this actor's process; the controller collects and reduces them per step.
        for reward in rewards:
            record_metric("scorer/reward", reward)
        record_metric("scorer/samples", len(rewards), "sum")
        record_metric("scorer/exact", sum(r == 1.0 for r in rewards), "sum")
        return rewards
