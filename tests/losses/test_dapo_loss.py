import math

import pytest
import torch

from losses.dapo import dapo


def hand_dapo(case, *, low, high, tis_cap=None):
    """DAPO loss and its gradient: one token-level mean over every response token in the batch."""
    n = case.num_tokens()
    loss, grad = 0.0, [[0.0] * len(m) for m in case.mask]
    for i in range(len(case.mask)):
        a = case.advantages[i]
        for t in case.tokens(i):
            anchor, w = case.anchor_and_weight(i, t, tis_cap)
            r = math.exp(case.logprobs[i][t] - anchor)
            unclipped, clipped = r * a, min(max(r, 1 - low), 1 + high) * a
            loss += -w * min(unclipped, clipped) / n
            grad[i][t] = 0.0 if clipped < unclipped else -w * r * a / n
    return loss, grad


@pytest.mark.parametrize(("low", "high", "tis_cap"), [(0.2, 0.28, None), (0.6, 0.1, None), (0.2, 0.28, 1.5)])
def test_dapo_matches_hand_computation(case, low, high, tis_cap):
    logprobs = case.logprobs_leaf()
    out = dapo(logprobs, case.batch(), old_logprobs=case.old_tensor(), clip_low=low, clip_high=high, tis_cap=tis_cap)
    out.loss.backward()
    loss, grad = hand_dapo(case, low=low, high=high, tis_cap=tis_cap)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_dapo_clip_higher_keeps_gradient_that_symmetric_clip_drops(case):
    logprobs = case.logprobs_leaf()
    dapo(logprobs, case.batch(), clip_low=0.2, clip_high=0.28).loss.backward()
    n = case.num_tokens()
    # r = 1.25, A = +0.4: inside [0.8, 1.28], so it still learns (a 0.2 symmetric clip would drop it).
    assert logprobs.grad[2, 2].item() == pytest.approx(-1.25 * 0.4 / n, rel=1e-12)
    # r = 1.3 > 1.28 with A > 0, and r = 0.5 < 0.8 with A < 0: clipped, no gradient.
    assert logprobs.grad[2, 0] == 0 and logprobs.grad[1, 1] == 0 and logprobs.grad[0, 2] == 0


def test_dapo_weighs_tokens_not_sequences(case):
    # Token-level mean: a token's gradient does not depend on its sequence's length.
    logprobs = case.logprobs_leaf()
    dapo(logprobs, case.batch(), clip_low=0.9, clip_high=0.9).loss.backward()  # nothing clipped
    n = case.num_tokens()
    ratio_over_behaviour = {(0, 4): 1.1, (2, 4): 1.0}  # rows of 3 and 5 tokens
    for (i, t), r in ratio_over_behaviour.items():
        assert logprobs.grad[i, t].item() == pytest.approx(-r * case.advantages[i] / n, rel=1e-12)


@pytest.mark.parametrize(("low", "high", "clipped_tokens"), [(0.2, 0.28, 3), (0.6, 0.28, 2)])
def test_dapo_clip_fraction_uses_each_bound_on_its_side(case, low, high, clipped_tokens):
    # A > 0 above 1 + high: 1.5 and 1.3 (not 1.25); A < 0 below 1 - low: 0.5 only when low = 0.2.
    out = dapo(case.logprobs_leaf(), case.batch(), clip_low=low, clip_high=high)
    assert out.metrics["clip_fraction"] == pytest.approx(clipped_tokens / case.num_tokens())
