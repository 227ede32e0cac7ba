"""The weight-sync canary: the trainer and every generator replica score the same fixed prompt and completion.

Checksums (forge/weights/checksums.py) prove a generator loaded the bytes that were published; the canary proves those
bytes are the trainer's policy: a publish that converted, renamed or transposed a tensor wrongly, an engine
that loads a name into the wrong place, a quantized or wrong-dtype load all show up as log-probs that differ.
Both sides score at temperature 1 over the full vocabulary (vLLM's teacher-forced log-probs are raw-logit ones).
Every healthy replica is scored (at once): one replica serving stale or corrupt weights must not hide behind
another that answers right. The largest difference is logged (`canary/logprob_diff`); one above
`max_logprob_diff` ends the job naming each replica at fault, with both values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class CanaryConfig:
    """Every `every` steps the trainer and every healthy generator replica score a fixed completion; a larger
    difference than `max_logprob_diff` ends the job, naming each replica at fault."""

    every: int = 0
    """Training steps between checks (0: off; the tiny configs: 10)."""
    max_logprob_diff: float = 1e-3
    """The largest |log p_trainer - log p_generator| allowed on a canary token. fp32 on both sides agrees to ~1e-5;
    a bf16 generator against an fp32 trainer differs by up to ~1e-1 on real models."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every={self.every}: must be >= 0 (0 = off)")
        if not self.max_logprob_diff > 0:
            raise ValueError(f"max_logprob_diff={self.max_logprob_diff}: must be > 0")


class WeightSyncError(RuntimeError):
    """A generator's weights do not reproduce the trainer's log-probs."""


def logprob_difference(trainer: list[float], generator: list[float], *, version: int, bound: float,
                       who: str = "generator") -> float:
    """max_t |trainer_t - generator_t|; above `bound` it raises with the token, both values and `who` scored."""
    if len(trainer) != len(generator):
        raise WeightSyncError(f"policy version {version}: the trainer scored {len(trainer)} canary tokens and the "
                              f"{who} {len(generator)}")
    gaps = [abs(t - g) for t, g in zip(trainer, generator)]
    worst = max(range(len(gaps)), key=lambda t: math.inf if math.isnan(gaps[t]) else gaps[t])  # NaN is worst
    if not gaps[worst] <= bound:
        raise WeightSyncError(
            f"policy version {version}: on canary token {worst} the trainer's log-prob is {trainer[worst]:.6g} and "
            f"the {who}'s {generator[worst]:.6g} (|difference| {gaps[worst]:.3g} > canary.max_logprob_diff="
            f"{bound}): the {who} is not serving the trainer's weights")
    return gaps[worst]


async def check_weight_sync(trainer: Any, generators: Any, prompt_ids: list[int], token_ids: list[int],
                            bound: float) -> float:
    """Score the canary on the trainer (all ranks) and on every healthy generator replica at the trainer's version;
    returns the largest difference. Raises `WeightSyncError` naming every replica at fault."""
    from forge.actor import rank0  # Monarch: not for the config's import

    trainer_logprobs, version = rank0(await trainer.score_tokens.call(prompt_ids, token_ids))
    answers = await generators.score.by_replica(prompt_ids, token_ids, version)
    if not answers:
        from forge.service import NoHealthyReplicaError

        raise NoHealthyReplicaError(f"no generator replica answered the canary of policy version {version} (each "
                                    "died during the call)")
    differences, failures = [], []
    for index, (generator_logprobs, scored) in sorted(answers.items()):
        who = f"generator replica {index}"
        try:
            if scored != version:
                raise WeightSyncError(f"the canary asked {who} for policy version {version} and it scored {scored}")
            differences.append(logprob_difference(trainer_logprobs, generator_logprobs, version=version, bound=bound,
                                                  who=who))
        except WeightSyncError as e:
            failures.append(str(e))
    if failures:
        raise WeightSyncError(f"{len(failures)} of {len(answers)} generator replicas failed the canary: "
                              + "; ".join(failures))
    return max(differences)
