"""GSM8K-style math word problems: the answer is the last number of the completion.

Loaded with `datasets` from a hub id ("openai/gsm8k") or local files (a folder or .jsonl/.parquet files
with `question` and `answer` columns, the answer ending in "#### <number>", as GSM8K ships it).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from forge.tasks.arithmetic import Problem

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
PROMPT_TEMPLATE = "Question: {question}\nThink step by step, then give the final answer after '####'.\nAnswer:"


def final_number(text: str) -> str | None:
    """The number after the last '####', else the last number in the text (commas dropped)."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def math_reward(completion_text: str, answer: str) -> float:
    """1.0 when the completion's final number equals the reference answer's."""
    predicted, expected = final_number(completion_text), final_number(answer)
    if predicted is None or expected is None:
        return 0.0
    try:
        return float(abs(float(predicted) - float(expected)) < 1e-6)
    except ValueError:
        return 0.0


class GSM8KTask:
    def __init__(self, dataset: str, *, config: str | None = "main", train_split: str = "train",
                 eval_split: str = "test", held_out: int = 500, seed: int = 0) -> None:
        from datasets import load_dataset

        if Path(dataset).exists() and Path(dataset).is_file():
            data = {"train": load_dataset(Path(dataset).suffix.lstrip(".").replace("jsonl", "json"),
                                          data_files=str(dataset), split="train")}
            train, evaluation = data["train"], data["train"]
        else:
            train = load_dataset(dataset, config, split=train_split)
            evaluation = load_dataset(dataset, config, split=eval_split)
        for name, split in (("train", train), ("eval", evaluation)):
            missing = {"question", "answer"} - set(split.column_names)
            if missing:
                raise ValueError(f"task.dataset={dataset!r} ({name} split) lacks columns {sorted(missing)}")
        self._train = [Problem(PROMPT_TEMPLATE.format(question=q), a) for q, a in zip(train["question"], train["answer"])]
        self._held_out = [Problem(PROMPT_TEMPLATE.format(question=q), a)
                          for q, a in zip(evaluation["question"], evaluation["answer"])][:held_out]
        self.seed = seed

    def sample_prompts(self, n: int, rng: random.Random) -> list[Problem]:
        return [rng.choice(self._train) for _ in range(n)]

    def held_out(self) -> list[Problem]:
        return list(self._held_out)

    def reward(self, completion_text: str, answer: str) -> float:
        return math_reward(completion_text, answer)
