"""GSM8K-style math word problems, scored by math-verify.

Loaded with `datasets` from a hub id ("openai/gsm8k") or local files (a folder or .jsonl/.parquet files
with `question` and `answer` columns, the answer ending in "#### <number>", as GSM8K ships it). A single
file is split: `held_out` rows (a seeded draw) for evaluation, the rest for training, never both.
Given the model's tokenizer, questions are asked in its chat template and answers stop at its end of turn
(rl/tasks/chat.py); `stop_token_ids` is what the app passes to the generators.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from math_verify import parse, verify

from rl.tasks.arithmetic import Problem
from rl.tasks.chat import PromptFormat

INSTRUCTION = "{question}\nThink step by step, then give the final answer after '####'."
PROMPT_TEMPLATE = "Question: " + INSTRUCTION + "\nAnswer:"  # for a model without a chat template


def final_answer(text: str) -> str:
    """What follows the last '####' (GSM8K's answer marker), else the whole text."""
    return text.rsplit("####", 1)[-1]


def math_reward(completion_text: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer equal to the reference's: as numbers
    ("1,234" = "1234.0"), fractions, LaTeX (\\frac{1}{2} = 0.5, \\boxed{...}) or expressions.

    Timeouts off: math-verify's use SIGALRM, which works only on the main thread, and rewards run on
    the app's reward threads (which have their own timeout)."""
    expected = parse(final_answer(answer), parsing_timeout=None)
    predicted = parse(final_answer(completion_text), parsing_timeout=None)
    if not expected or not predicted:
        return 0.0
    return float(verify(expected, predicted, timeout_seconds=None))


class GSM8KTask:
    def __init__(self, dataset: str, *, config: str | None = "main", train_split: str = "train",
                 eval_split: str = "test", held_out: int = 500, seed: int = 0, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        from datasets import load_dataset

        prompts = PromptFormat(tokenizer, chat_template_kwargs)
        template = INSTRUCTION if prompts.uses_chat_template else PROMPT_TEMPLATE
        self.stop_token_ids = prompts.stop_token_ids  # EOS and the chat template's end of turn
        if Path(dataset).is_file():
            rows = load_dataset(Path(dataset).suffix.lstrip(".").replace("jsonl", "json"), data_files=str(dataset),
                                split="train")
            if len(rows) < 2:
                raise ValueError(f"task.dataset={dataset!r}: {len(rows)} row(s); a single file is split into "
                                 "training and held-out rows, so it needs at least 2")
            order = list(range(len(rows)))
            random.Random(f"{seed}-held-out").shuffle(order)
            cut = min(held_out, len(rows) // 2)  # at most half is held out: training keeps the rest
            evaluation, train = rows.select(order[:cut]), rows.select(order[cut:])
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
