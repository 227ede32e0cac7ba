"""GSM8K-style math word problems: the answer is the last number of the completion.

Loaded with `datasets` from a hub id ("openai/gsm8k") or local files (a folder or .jsonl/.parquet files
with `question` and `answer` columns, the answer ending in "#### <number>", as GSM8K ships it).
Given the model's tokenizer, questions are asked in its chat template and answers stop at its end of turn
(forge/tasks/chat.py); `stop_token_ids` is what the app passes to the generators.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from forge.tasks.arithmetic import Problem
from forge.tasks.chat import PromptFormat

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
INSTRUCTION = "{question}\nThink step by step, then give the final answer after '####'."
PROMPT_TEMPLATE = "Question: " + INSTRUCTION + "\nAnswer:"  # for a model without a chat template


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
                 eval_split: str = "test", held_out: int = 500, seed: int = 0, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        from datasets import load_dataset

        prompts = PromptFormat(tokenizer, chat_template_kwargs)
        template = INSTRUCTION if prompts.uses_chat_template else PROMPT_TEMPLATE
        self.stop_token_ids = prompts.stop_token_ids  # EOS and the chat template's end of turn
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

        def problem(question: str, answer: str) -> Problem:
            return Problem(prompts.format(template.format(question=question)), answer)

        self._train = [problem(q, a) for q, a in zip(train["question"], train["answer"])]
        evaluation = evaluation.select(range(min(held_out, len(evaluation))))
        self._held_out = [problem(q, a) for q, a in zip(evaluation["question"], evaluation["answer"])]
        self.seed = seed

    def sample_prompts(self, n: int, rng: random.Random) -> list[Problem]:
        return [rng.choice(self._train) for _ in range(n)]

    def held_out(self) -> list[Problem]:
        return list(self._held_out)

    def reward(self, completion_text: str, answer: str) -> float:
        return math_reward(completion_text, answer)
