"""Any reasoning-gym task by name (`task.source: reasoning_gym`, `task.name: basic_arithmetic`, ...).

reasoning-gym generates its problems procedurally from a seed and scores answers with each dataset's own
`score_answer`, which is the reward here. The held-out problems come from a different seed, and any of
them whose question also occurs in the training problems is dropped, so training and evaluation never
overlap. A problem's `answer` is the key of its reasoning-gym entry (`"train/17"`), since a dataset's
scorer needs the whole entry (metadata included), not only the reference answer.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rl.tasks.arithmetic import Problem
from rl.tasks.chat import PromptFormat

INSTRUCTION = "{question}\nGive only the final answer, inside <answer></answer>."
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def held_out_seed(seed: int) -> int:
    """The seed the held-out problems are generated from: never the training seed."""
    return seed + 1_000_003


def tagged_answer(completion_text: str) -> str:
    """The last <answer>...</answer> of a completion, else the whole completion (stripped)."""
    tagged = _TAGGED.findall(completion_text)
    return (tagged[-1] if tagged else completion_text).strip()


def check_dataset(name: str, options: dict[str, Any], *, size: int, prefix: str = "task.") -> None:
    """The dataset exists and takes `options` (their names and values, by its config's own checks): a config error,
    before anything starts. Errors name the field (`prefix`name, `prefix`options) and the value."""
    from reasoning_gym.factory import DATASETS

    from rl.tasks.environment import check_options

    if name not in DATASETS:
        raise ValueError(f"{prefix}name={name!r}: not a reasoning-gym dataset; it has {len(DATASETS)}, e.g. "
                         f"{', '.join(sorted(DATASETS)[:8])}, ... (reasoning_gym.factory.DATASETS)")
    config_type = DATASETS[name][1]
    set_by_forge = ("seed", "size")  # the job's seed and task.size
    for key in set_by_forge:
        if key in options:
            raise ValueError(f"{prefix}options: {key!r} is set by forge (the job's seed and {prefix}size); remove it "
                             f"from {prefix}options")
    check_options(config_type, options, field=f"{prefix}options", set_by_forge=set_by_forge)
    try:
        config = config_type(seed=0, size=size, **options)  # as reasoning_gym.create_dataset builds it
        if hasattr(config, "validate"):
            config.validate()
    except (TypeError, ValueError, AssertionError) as e:  # reasoning-gym checks its configs with asserts
        raise ValueError(f"{prefix}options={options!r}: reasoning-gym's {name!r} refuses them "
                         f"({type(e).__name__}: {e})") from None


class ReasoningGymTask:
    def __init__(self, name: str, *, options: dict[str, Any] | None = None, seed: int = 0, size: int = 10_000,
                 held_out: int = 500, partial_credit: bool = True, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        import reasoning_gym

        options = dict(options or {})
        check_dataset(name, options, size=size)
        try:
            train = reasoning_gym.create_dataset(name, seed=seed, size=size, **options)
            # Twice the held-out size, so the problems dropped as also in training rarely leave it short.
            evaluation = reasoning_gym.create_dataset(name, seed=held_out_seed(seed), size=2 * held_out, **options)
        except (TypeError, ValueError, AssertionError) as e:  # reasoning-gym checks its configs with asserts
            raise ValueError(f"task.options={options!r}: reasoning-gym's {name!r} refuses them "
                             f"({type(e).__name__}: {e})") from None
        prompts = PromptFormat(tokenizer, chat_template_kwargs)
        self.stop_token_ids = prompts.stop_token_ids
        self._datasets = {"train": train, "eval": evaluation}
        self._entries: dict[str, dict[str, Any]] = {}
        self._train = [self._problem("train", i, entry, prompts) for i, entry in enumerate(train)]
        seen = {entry["question"] for entry in train}
        fresh = [(i, entry) for i, entry in enumerate(evaluation) if entry["question"] not in seen]
        self._held_out = [self._problem("eval", i, entry, prompts) for i, entry in fresh[:held_out]]
        if not self._held_out:
            raise ValueError(f"task.name={name!r}: every held-out problem also occurs in training; the task "
                             f"has too few distinct problems with task.options={options!r}")
        self.seed = seed
        self.partial_credit = partial_credit

    def _problem(self, split: str, index: int, entry: dict[str, Any], prompts: PromptFormat) -> Problem:
        key = f"{split}/{index}"
        self._entries[key] = entry
        return Problem(prompts.format(INSTRUCTION.format(question=entry["question"])), key)

    def sample_prompts(self, n: int, rng: random.Random) -> list[Problem]:
        return [rng.choice(self._train) for _ in range(n)]

    def held_out(self) -> list[Problem]:
        return list(self._held_out)

    def reference_answer(self, answer: str) -> str:
        """The dataset's reference answer of the problem whose `answer` (its entry's key) this is."""
        return str(self._entries[answer]["answer"])

    def reward(self, completion_text: str, answer: str) -> float:
        """The dataset's own score (0..1) of the completion's tagged answer, or 1/0 for a score of 1 or less without
        `partial_credit`; `answer` is the entry's key."""
        split = answer.partition("/")[0]
        score = float(self._datasets[split].score_answer(tagged_answer(completion_text), self._entries[answer]))
        return score if self.partial_credit else float(score == 1.0)
