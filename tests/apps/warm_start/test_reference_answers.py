"""The single-turn warm start trains apps.sft's examples (apps/warm_start/supervised.py): any task's reference answers,
masked by token ids, and a task without answers refused by name. The training loop is replaced by one that records
what it was given (the loop itself: test_supervised.py)."""

from __future__ import annotations

import random

import pytest

from apps.warm_start import supervised
from apps.warm_start.config import WarmStartConfig
from rl.tasks.arithmetic import ArithmeticTask
from rl.tasks.reasoning_gym import ReasoningGymTask
from rl.tiny_model import build_tokenizer


@pytest.fixture
def trained(monkeypatch):
    """What train_until_accurate was given: the first batch of 4 examples, and the cache key."""
    seen = {}

    def record(model_dir, out_dir, *, cache_key, batch, accuracy, config, seed, log, what):
        seen.update(batch=batch(build_tokenizer(), 4), cache_key=cache_key)
        return out_dir, 0.0

    monkeypatch.setattr(supervised, "train_until_accurate", record)
    return seen


def learned_text(tokenizer, input_ids, labels) -> list[str]:
    return [tokenizer.decode([t for t in row.tolist() if t != -100]) for row in labels]


def test_an_arithmetic_row_learns_its_answer_and_eos_only(trained, tmp_path):
    task, tokenizer = ArithmeticTask(seed=0, reverse_answer=True), build_tokenizer()
    supervised.warm_start_on_task("tiny", tmp_path, task, WarmStartConfig(batch_size=4), seed=0, max_tokens=4)
    input_ids, labels = trained["batch"]
    problems = task.sample_prompts(4, random.Random("0-warm-start"))  # the warm start's own draw
    for row, label, problem in zip(input_ids.tolist(), labels.tolist(), problems):
        prompt, answer = tokenizer.encode(problem.prompt), tokenizer.encode(problem.answer) + [tokenizer.eos_token_id]
        assert row[: len(prompt + answer)] == prompt + answer
        assert label[: len(prompt + answer)] == [-100] * len(prompt) + answer
        assert set(label[len(prompt + answer):]) <= {-100}  # padding


def test_a_reasoning_gym_task_learns_its_tagged_reference_answers(trained, tmp_path):
    task = ReasoningGymTask("basic_arithmetic", size=20, held_out=5, seed=0)
    supervised.warm_start_on_task("tiny", tmp_path, task, WarmStartConfig(batch_size=4, eval_prompts=4), seed=0,
                                  max_tokens=16)
    texts = learned_text(build_tokenizer(), *trained["batch"])
    assert all(t.startswith("<answer>") and t.endswith("</answer><|endoftext|>") for t in texts), texts


def test_a_task_without_reference_answers_is_refused_by_name(tmp_path):
    class ScoredByItsEnvironment:  # a MultiTurnTask (rl.tasks.protocol): nothing of it is used
        stop_token_ids = ()

        def environment(self):
            raise AssertionError("not played")

        sample_prompts = held_out = reward = transcript = environment

    with pytest.raises(ValueError, match=r"^warm start: task ScoredByItsEnvironment has no reference answers"):
        supervised.warm_start_on_task("tiny", tmp_path, ScoredByItsEnvironment(), WarmStartConfig(), seed=0,
                                      max_tokens=4)
