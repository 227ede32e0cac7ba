import math

import pytest
import torch

from losses.dr_grpo import dr_grpo


def hand_dr_grpo(case, *, eps, max_tokens, tis_cap=None):
    """Dr. GRPO loss and gradient: the token sum over a constant, G * max_tokens."""
    denominator = len(case.mask) * max_tokens
    loss, grad = 0.0, [[0.0] * len(m) for m in case.mask]
    for i in range(len(case.mask)):
        a = case.advantages[i]
        for t in case.tokens(i):
            anchor, w = case.anchor_and_weight(i, t, tis_cap)
            r = math.exp(case.logprobs[i][t] - anchor)
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            loss += -w * min(unclipped, clipped) / denominator
            grad[i][t] = 0.0 if clipped < unclipped else -w * r * a / denominator
    return loss, grad


@pytest.mark.parametrize(
    ("max_tokens", "expected_constant", "tis_cap"), [(None, 5, None), (16, 16, None), (16, 16, 1.5)]
)
def test_dr_grpo_matches_hand_computation(case, max_tokens, expected_constant, tis_cap):
    logprobs = case.logprobs_leaf()
    out = dr_grpo(logprobs, case.batch(), old_logprobs=case.old_tensor(), clip_eps=0.2, max_tokens=max_tokens,
                  tis_cap=tis_cap)
    out.loss.backward()
    loss, grad = hand_dr_grpo(case, eps=0.2, max_tokens=expected_constant, tis_cap=tis_cap)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_dr_grpo_clipped_tokens_get_no_gradient(case):
    logprobs = case.logprobs_leaf()
    dr_grpo(logprobs, case.batch(), clip_eps=0.2).loss.backward()
    assert logprobs.grad[0, 2] == 0 and logprobs.grad[1, 1] == 0  # r = 1.5 with A > 0, r = 0.5 with A < 0
    assert logprobs.grad[0, 3].item() == pytest.approx(-0.5 * 1.5 / (3 * 5), rel=1e-12)  # r = 0.5, A > 0: flows


def test_dr_grpo_has_no_length_normalisation(case):
    # Adding response tokens to a sequence leaves the other tokens' gradients unchanged.
    batch = case.batch()
    logprobs = case.logprobs_leaf()
    dr_grpo(logprobs, batch, max_tokens=8).loss.backward()
    before = logprobs.grad[0, 3].item()
    batch.response_mask[0, 1] = 1.0  # row 0 now has one more response token
    logprobs.grad = None
    dr_grpo(logprobs, batch, max_tokens=8).loss.backward()
    assert logprobs.grad[0, 3].item() == pytest.approx(before, rel=1e-12) and before != 0
