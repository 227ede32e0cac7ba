"""apps.warm_start.supervised's stopping rule: checks every `eval_every` steps, then after every step once a check reaches
`check_every_step_from`, so an accuracy that jumps between two checks is caught at its first step past the target."""

import pytest
import torch

from rl.tiny_model import build_tiny_checkpoint
from apps.warm_start.config import WarmStartConfig
from apps.warm_start.supervised import train_until_accurate


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
