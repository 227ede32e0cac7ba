import math

import pytest
import torch

from losses.cispo import cispo


def hand_cispo(case, *, low, high, tis_cap=None):
    """CISPO loss and gradient: the clipped IS weight is a constant multiplying A * logprob."""
    n = case.num_tokens()
    loss, grad = 0.0, [[0.0] * len(m) for m in case.mask]
    for i in range(len(case.mask)):
        a = case.advantages[i]
        for t in case.tokens(i):
            anchor, w = case.anchor_and_weight(i, t, tis_cap)
            r = math.exp(case.logprobs[i][t] - anchor)
            weight = min(max(r, 1 - low), 1 + high)
            loss += -w * weight * a * case.logprobs[i][t] / n
            grad[i][t] = -w * weight * a / n
    return loss, grad


@pytest.mark.parametrize(("low", "high", "tis_cap"), [(1.0, 0.28, None), (0.2, 0.2, None), (1.0, 0.28, 1.5)])
def test_cispo_matches_hand_computation(case, low, high, tis_cap):
    logprobs = case.logprobs_leaf()
    out = cispo(logprobs, case.batch(), old_logprobs=case.old_tensor(), clip_low=low, clip_high=high, tis_cap=tis_cap)
    out.loss.backward()
    loss, grad = hand_cispo(case, low=low, high=high, tis_cap=tis_cap)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_cispo_keeps_gradient_of_clipped_tokens(case):
    logprobs = case.logprobs_leaf()
    out = cispo(logprobs, case.batch(), clip_low=0.2, clip_high=0.2)
    out.loss.backward()
    n = case.num_tokens()
    # r = 1.5 with A > 0 and r = 0.5 with A < 0 would get no gradient from PPO's clip; here the weight is capped.
    assert logprobs.grad[0, 2].item() == pytest.approx(-1.2 * 1.5 / n, rel=1e-12)
    assert logprobs.grad[1, 1].item() == pytest.approx(-0.8 * -0.8 / n, rel=1e-12)
    assert out.metrics["clip_fraction"] == pytest.approx(7 / 11)  # 1.5, 0.5, 0.5, 1.5, 1.3, 0.75, 1.25
