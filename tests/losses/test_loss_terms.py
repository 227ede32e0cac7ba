import math
import re

import pytest
import torch

from rl.types import TrainBatch
from losses.terms import check_hyperparams, correction_weight, importance_ratio, kl_estimate, masked_mean

# Two categorical distributions over 4 tokens: pi_theta = p, pi_ref = q.
P = [0.1, 0.2, 0.3, 0.4]
Q = [0.25, 0.25, 0.4, 0.1]


def estimates(estimator):
    logp = torch.tensor([math.log(x) for x in P], dtype=torch.float64)
    logq = torch.tensor([math.log(x) for x in Q], dtype=torch.float64)
    return kl_estimate(logp, logq, torch.ones(4), estimator).tolist()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_kl_estimators_average_to_exact_kl(estimator):
    # E_{x ~ p}[k(x)] = sum_x p(x) k(x) must equal KL(p || q) = sum_x p log(p / q).
    exact = sum(p * math.log(p / q) for p, q in zip(P, Q))
    expectation = sum(p * k for p, k in zip(P, estimates(estimator)))
    assert expectation == pytest.approx(exact, rel=1e-12)


def test_kl_estimators_per_token_formulas():
    for p, q, k1, k2, k3 in zip(P, Q, estimates("k1"), estimates("k2"), estimates("k3")):
        assert k1 == pytest.approx(math.log(p) - math.log(q), rel=1e-12)
        assert k2 == pytest.approx((math.log(q) - math.log(p)) ** 2 / 2, rel=1e-12)
        assert k3 == pytest.approx(q / p - 1 - math.log(q / p), rel=1e-12)
        assert k3 >= 0


def test_kl_estimate_is_zero_off_the_mask_even_for_extreme_values():
    kl = kl_estimate(torch.tensor([-1e4, -0.5]), torch.tensor([0.0, -0.7]), torch.tensor([0.0, 1.0]), "k3")
    assert kl[0] == 0 and kl[1].item() == pytest.approx(math.exp(-0.2) - 1 + 0.2, rel=1e-6)


def test_kl_estimate_rejects_unknown_estimator():
    with pytest.raises(ValueError, match=r"kl_estimator='k4': must be one of k1, k2, k3"):
        kl_estimate(torch.zeros(2), torch.zeros(2), torch.ones(2), "k4")


def test_truncated_is_weight_caps_and_detaches():
    old = torch.tensor([[math.log(0.3), math.log(0.9), math.log(0.2), 5.0]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.2), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    batch = TrainBatch(input_ids=torch.zeros(1, 5, dtype=torch.long), response_mask=mask, behaviour_logprobs=behaviour,
                       policy_versions=torch.zeros(1, 4, dtype=torch.long), advantages=torch.ones(1),
                       rewards=torch.ones(1))
    weight = correction_weight(old, batch, tis_cap=2.0, token_mask_band=None, seq_mask_band=None)
    torch.testing.assert_close(weight, torch.tensor([[0.5, 2.0, 1.0, 1.0]]))  # 0.3/0.6, min(3, 2), 1, off-mask
    assert not weight.requires_grad


def test_importance_ratio_anchor_follows_tis_cap(case):
    batch, logprobs, old = case.batch(), case.logprobs_leaf(), case.old_tensor()
    log_ratio, weight = importance_ratio(logprobs, batch, old_logprobs=old, tis_cap=None)
    assert log_ratio[0, 2].item() == pytest.approx(math.log(1.5))  # against pi_behaviour
    assert torch.all(weight == 1)
    log_ratio, weight = importance_ratio(logprobs, batch, old_logprobs=old, tis_cap=2.5)
    assert log_ratio[0, 2].item() == pytest.approx(math.log(1.5) - math.log(2.0))  # against pi_old
    assert weight[0, 2].item() == pytest.approx(2.0) and weight[1, 2].item() == pytest.approx(2.5)
    assert log_ratio[0, 0] == 0 and log_ratio[1, 4] == 0  # prompt, padding


@pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "behaviour_logprobs", "ref_logprobs"])
def test_importance_ratio_rejects_misaligned_tensors(case, field):
    batch, logprobs, old = case.batch(), case.logprobs_leaf(), case.old_tensor()
    if field == "logprobs":
        logprobs = logprobs[:, :-1]
    elif field == "old_logprobs":
        old = old[:, :-1]
    else:
        setattr(batch, field, getattr(batch, field)[:, :-1])
    with pytest.raises(ValueError, match=rf"{field} has shape \(3, 4\); must match batch.response_mask \(3, 5\)"):
        importance_ratio(logprobs, batch, old_logprobs=old, tis_cap=None)


def test_importance_ratio_rejects_per_token_advantages(case):
    batch = case.batch()
    batch.advantages = batch.advantages[:, None].expand(3, 5)
    with pytest.raises(ValueError, match=r"batch.advantages has shape \(3, 5\); must be \(3,\)"):
        importance_ratio(case.logprobs_leaf(), batch, old_logprobs=None, tis_cap=None)


@pytest.mark.parametrize("correction", [{"tis_cap": 2.0}, {"token_mask_band": [0.5, 5.0]}, {"seq_mask_band": (0.9, 1.1)}])
def test_a_correction_without_pi_old_is_an_error_not_ratio_one(case, correction):
    # pi_old defaulting to pi_theta would make r_t = 1 on every minibatch and switch the PPO clip off.
    (name, value), = correction.items()
    with pytest.raises(ValueError, match=rf"old_logprobs=None with \{{'{name}': .*\}}: the correction needs pi_old"):
        importance_ratio(case.logprobs_leaf(), case.batch(), old_logprobs=None, **{"tis_cap": None, **correction})


def test_masked_mean_ignores_masked_values_and_empty_rows():
    values = torch.tensor([[1.0, 2.0, 1e30], [5.0, 7.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 0.0]))
    assert masked_mean(values, mask).item() == 1.5


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [("clip_eps", 0.0, "a number > 0"), ("clip_high", "0.2", "a number > 0"), ("kl_coef", -0.1, "a number >= 0"),
     ("kl_estimator", "k5", "one of k1, k2, k3"), ("tis_cap", 0, "None \\(off\\) or a number > 0"),
     ("max_tokens", 2.5, "None \\(use T-1\\) or an int >= 1"),
     ("token_mask_band", [2.0, 0.5], "None \\(off\\) or \\[low, high\\] with 0 <= low < high"),
     ("token_mask_band", 2.0, "None \\(off\\) or \\[low, high\\] with 0 <= low < high"),
     ("seq_mask_band", [-0.1, 1.0], "None \\(off\\) or \\[low, high\\] with 0 <= low < high"),
     ("seq_mask_band", [0.5, 1.0, 2.0], "None \\(off\\) or \\[low, high\\] with 0 <= low < high")],
)
def test_check_hyperparams_names_loss_field_value_and_allowed(name, value, allowed):
    with pytest.raises(ValueError, match=rf"^myloss: {name}={re.escape(repr(value))}: must be {allowed}$"):
        check_hyperparams("myloss", **{name: value})
