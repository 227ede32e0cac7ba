import math

import pytest
import torch

from losses.gspo import gspo


def hand_gspo(case, *, low, high, tis_cap=None):
    """GSPO loss and its gradient, one clipped term per sequence on the geometric-mean ratio."""
    rows = len(case.mask)
    loss, grad = 0.0, [[0.0] * len(m) for m in case.mask]
    for i in range(rows):
        tokens, a = case.tokens(i), case.advantages[i]
        anchors_weights = [case.anchor_and_weight(i, t, tis_cap) for t in tokens]
        s = math.exp(sum(case.logprobs[i][t] - anchor for t, (anchor, _) in zip(tokens, anchors_weights)) / len(tokens))
        mean_w = sum(w for _, w in anchors_weights) / len(tokens)
        unclipped, clipped = s * a, min(max(s, 1 - low), 1 + high) * a
        loss += -mean_w * min(unclipped, clipped) / rows
        for t in tokens:  # d s / d logprob_t = s / |o_i|
            grad[i][t] = 0.0 if clipped < unclipped else -mean_w * a * s / len(tokens) / rows
    return loss, grad


@pytest.mark.parametrize(("low", "high", "tis_cap"), [(0.1, 0.005, None), (0.5, 0.5, None), (3e-4, 4e-4, 1.5)])
def test_gspo_matches_hand_computation(case, low, high, tis_cap):
    logprobs = case.logprobs_leaf()
    out = gspo(logprobs, case.batch(), old_logprobs=case.old_tensor(), clip_low=low, clip_high=high, tis_cap=tis_cap)
    out.loss.backward()
    loss, grad = hand_gspo(case, low=low, high=high, tis_cap=tis_cap)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_gspo_clips_whole_sequences(case):
    # Geometric-mean ratios: row 0 0.938 (A>0), row 1 0.877 (A<0), row 2 1.007 (A>0).
    logprobs = case.logprobs_leaf()
    out = gspo(logprobs, case.batch(), clip_low=0.1, clip_high=0.005)
    out.loss.backward()
    assert torch.all(logprobs.grad[1:] == 0)  # row 1 below 0.9 with A < 0, row 2 above 1.005 with A > 0
    row0 = logprobs.grad[0, 2:]
    assert torch.all(row0 < 0) and torch.allclose(row0, row0[0].expand(3))  # one ratio: equal token gradients
    assert out.metrics["clip_fraction"] == pytest.approx(8 / 11)  # rows 1 and 2: 3 + 5 of 11 tokens
    assert out.metrics["ratio_max"] == pytest.approx((1.3 * 0.75 * 1.25 * 0.85) ** (1 / 5))
