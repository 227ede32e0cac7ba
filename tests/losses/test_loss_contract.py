"""What the trainer relies on from every registered loss."""

import math

import pytest
import torch

from losses import LOSSES

NAMES = sorted(LOSSES)


def garbage_off_the_response(case):
    """The case with NaN, inf and values that overflow exp() off the response."""
    logprobs = case.logprobs_leaf().detach().clone()
    batch, old = case.batch(), case.old_tensor()
    off = case.batch().response_mask == 0
    nan, inf = math.nan, math.inf
    logprobs[off] = torch.tensor([nan, -inf, 1e4, -50.0], dtype=torch.float64)
    batch.behaviour_logprobs[off] = torch.tensor([-1e4, inf, -60.0, nan], dtype=torch.float64)
    batch.ref_logprobs[off] = torch.tensor([nan, -1e4, inf, -inf], dtype=torch.float64)
    old[off] = torch.tensor([1e4, nan, 70.0, -inf], dtype=torch.float64)
    return logprobs.requires_grad_(), batch, old


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_prompt_and_padding_tokens_affect_neither_loss_nor_gradient(case, name, tis_cap):
    kwargs = {"tis_cap": tis_cap, **({"kl_coef": 0.1} if name == "grpo" else {})}
    clean = case.logprobs_leaf()
    expected = LOSSES[name](clean, case.batch(), old_logprobs=case.old_tensor(), **kwargs)
    expected.loss.backward()
    logprobs, batch, old = garbage_off_the_response(case)
    out = LOSSES[name](logprobs, batch, old_logprobs=old, **kwargs)
    out.loss.backward()
    assert torch.equal(out.loss, expected.loss)
    assert torch.equal(logprobs.grad, clean.grad)
    assert torch.all(logprobs.grad[batch.response_mask == 0] == 0)
    assert out.metrics == expected.metrics


@pytest.mark.parametrize("name", NAMES)
def test_tis_with_pi_old_equal_to_behaviour_is_plain_loss(case, name):
    # pi_old = pi_behaviour: same anchor, weight 1 under any cap >= 1.
    batch = case.batch()
    plain, corrected = case.logprobs_leaf(), case.logprobs_leaf()
    LOSSES[name](plain, batch).loss.backward()
    out = LOSSES[name](corrected, batch, old_logprobs=batch.behaviour_logprobs.clone(), tis_cap=1.0)
    out.loss.backward()
    torch.testing.assert_close(corrected.grad, plain.grad, rtol=1e-12, atol=0)
    assert out.metrics["is_weight_mean"] == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_float32_batch_gives_scalar_loss_and_float_metrics(case, name):
    logprobs = case.logprobs_leaf(torch.float32)
    out = LOSSES[name](logprobs, case.batch(dtype=torch.float32), old_logprobs=case.old_tensor(torch.float32),
                       tis_cap=2.0)
    out.loss.backward()
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    assert torch.isfinite(logprobs.grad).all()
    expected = {"clip_fraction", "ratio_mean", "ratio_min", "ratio_max", "is_weight_mean", "is_weight_max"}
    assert expected <= set(out.metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_bad_hyperparameters_are_named(case, name):
    with pytest.raises(ValueError, match=rf"^{name}: tis_cap=-1: must be None \(off\) or a number > 0$"):
        LOSSES[name](case.logprobs_leaf(), case.batch(), tis_cap=-1)
    with pytest.raises(TypeError, match="clip_epsilon"):
        LOSSES[name](case.logprobs_leaf(), case.batch(), clip_epsilon=0.2)


@pytest.mark.parametrize("name", NAMES)
def test_a_correction_without_pi_old_raises(case, name):
    with pytest.raises(ValueError, match=r"old_logprobs=None with \{'tis_cap': 2.0\}: the correction needs pi_old"):
        LOSSES[name](case.logprobs_leaf(), case.batch(), tis_cap=2.0)
