"""losses/tinker.py: Tinker's losses are sums over tokens with per-token weights and advantages."""

from __future__ import annotations

import pytest
import torch

from losses.tinker import cispo, cross_entropy, importance_sampling, ppo
from rl.types import TrainBatch


def _batch(weights, sampled, advantages) -> TrainBatch:
    weights, sampled, advantages = (torch.tensor(x, dtype=torch.float32) for x in (weights, sampled, advantages))
    rows, width = weights.shape
    return TrainBatch(input_ids=torch.zeros(rows, width + 1, dtype=torch.long), response_mask=weights,
                      behaviour_logprobs=sampled, policy_versions=torch.zeros(rows, width, dtype=torch.long),
                      advantages=torch.zeros(rows), rewards=torch.zeros(rows), token_advantages=advantages)


def test_cross_entropy_is_the_weighted_sum_of_negative_log_probs():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    batch = _batch([[0, 1, 1], [1, 0.5, 0]], [[0] * 3] * 2, [[0] * 3] * 2)
    out = cross_entropy(logprobs, batch)
    assert out.loss.item() == pytest.approx(2 + 3 + 0.5 + 0.25)  # a sum, not a mean: longer answers weigh more
    out.loss.backward()
    assert logprobs.grad.tolist() == [[0, -1, -1], [-1, -0.5, 0]]
    assert out.metrics["loss:sum"] == pytest.approx(out.loss.item())


def test_importance_sampling_weighs_each_token_by_its_ratio_and_its_own_advantage():
    sampled = [[-1.0, -1.0], [-2.0, -2.0]]
    logprobs = torch.tensor([[-1.0, -0.5], [-2.0, -3.0]], requires_grad=True)
    batch = _batch([[1, 1], [1, 1]], sampled, [[0.0, 2.0], [1.0, -1.0]])
    out = importance_sampling(logprobs, batch)
    expected = -(2.0 * torch.exp(torch.tensor(0.5)) + 1.0 - torch.exp(torch.tensor(-1.0)))
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    out.loss.backward()  # d/dlogp of -r*A is -r*A: the prompt token (A = 0) gets no gradient
    assert logprobs.grad[0, 0].item() == 0.0


def test_ppo_clips_the_ratio_to_tinkers_default_thresholds_and_cispo_keeps_the_gradient_of_clipped_tokens():
    sampled = [[-1.0, -1.0]]
    logprobs = torch.tensor([[-0.5, -1.0]], requires_grad=True)  # ratio e^0.5 = 1.65 on token 0, 1 on token 1
    batch = _batch([[1, 1]], sampled, [[1.0, 1.0]])
    out = ppo(logprobs, batch)
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0))
    assert out.metrics["clipped_tokens:sum"] == 1
    out.loss.backward()
    assert logprobs.grad[0, 0].item() == 0.0  # clipped with a positive advantage: no gradient
    custom = ppo(logprobs.detach(), batch, clip_low_threshold=0.5, clip_high_threshold=2.0)
    assert custom.loss.item() == pytest.approx(-(torch.exp(torch.tensor(0.5)).item() + 1.0))
    logprobs.grad = None
    cispo(logprobs, batch).loss.backward()
    assert logprobs.grad[0, 0].item() == pytest.approx(-1.2)  # the clipped ratio, as a weight on d log p
    with pytest.raises(ValueError, match="clip_low_threshold=1.5"):
        ppo(logprobs, batch, clip_low_threshold=1.5)


def test_rl_losses_name_the_missing_advantages():
    batch = _batch([[1.0]], [[0.0]], [[0.0]])
    batch.token_advantages = None
    with pytest.raises(ValueError, match="advantages"):
        importance_sampling(torch.zeros(1, 1), batch)
