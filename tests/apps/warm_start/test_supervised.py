"""apps.warm_start.supervised's stopping rule: checks every `eval_every` steps, then after every step once a check
reaches `check_every_step_from`, so an accuracy that jumps between two checks is caught at its first step past the
target; the check itself is the shared held-out evaluator's (apps/held_out/) over one batch of the model."""

import pytest
import torch

from rl.tiny_model import build_tiny_checkpoint
from apps.warm_start.config import WarmStartConfig
from apps.warm_start.supervised import greedy_accuracy, train_until_accurate
from rl.tasks.arithmetic import Problem


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def _run(tiny, out_dir, accuracies: dict[int, float], **settings) -> tuple[list[int], float]:
    """Trains with a scripted accuracy per step (the step count is the number of supervised steps so far)."""
    checked, steps = [], [0]

    def batch(tokenizer, n):
        steps[0] += 1
        ids = torch.tensor([[2, 3, 4, 1]] * n)
        return ids, ids.clone()

    def accuracy(model, tokenizer):
        checked.append(steps[0])
        return accuracies.get(steps[0], 0.0)

    config = WarmStartConfig(target_accuracy=0.3, lr=1e-3, batch_size=2, max_steps=40, eval_every=5, **settings)
    _, reached = train_until_accurate(tiny, out_dir, cache_key={}, batch=batch, accuracy=accuracy, config=config,
                                      seed=0, log=lambda line: None)
    return checked, reached


def test_checks_after_every_step_once_near_the_target(tiny, tmp_path):
    accuracies = {10: 0.27, 11: 0.28, 12: 0.31, 15: 0.45}  # at step 15 a check every 5 steps would overshoot
    checked, reached = _run(tiny, tmp_path / "fine", accuracies, check_every_step_from=0.26)
    assert checked == [5, 10, 11, 12] and reached == 0.31
    checked, reached = _run(tiny, tmp_path / "coarse", accuracies)  # unset: every 5 steps, as before
    assert checked == [5, 10, 15] and reached == 0.45


def test_check_every_step_from_is_validated():
    with pytest.raises(ValueError, match=r"check_every_step_from=0.5: must be in \(0, target_accuracy=0.3\]"):
        WarmStartConfig(target_accuracy=0.3, check_every_step_from=0.5)


def test_the_accuracy_check_is_the_shared_evaluators_over_one_batch_of_the_model(tiny, monkeypatch):
    """greedy_accuracy: apps/held_out/'s evaluator over one left-padded batch; a sample whose reward fails is left out
    and reported (scored 0, this would be 1/3), and an evaluation whose every sample fails is an error."""
    from actors.engines.hf import HFEngine
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []
    generate = HFEngine.generate
    monkeypatch.setattr(HFEngine, "generate", lambda self, prompts, params: calls.append(prompts) or
                        generate(self, prompts, params))

    def reward(text: str, answer: str) -> float:  # judged by the answer alone: the tiny model writes noise
        if answer == "boom":
            raise ValueError("stand-in reward failure")
        return float(answer == "right")

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    problems = [Problem("1+1=", "right"), Problem("2+2=", "wrong"), Problem("3+3=", "boom")]
    log: list[str] = []
    with torch.no_grad():
        assert greedy_accuracy(model, tokenizer, problems, reward, max_tokens=2, log=log.append) == 0.5
        assert calls == [["1+1=", "2+2=", "3+3="]]  # one batch
        assert log == ["warm start: 1 of 3 evaluation samples left out of the accuracy: they failed (first: reward: "
                       "ValueError: stand-in reward failure)"]
        with pytest.raises(RuntimeError, match=r"all 1 evaluation samples failed \(first: reward: ValueError"):
            greedy_accuracy(model, tokenizer, problems[2:], reward, max_tokens=2)
