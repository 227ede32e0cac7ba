import math

import pytest
import torch

from losses.grpo import grpo


def hand_grpo(case, *, eps, kl_coef=0.0, estimator="k3", tis_cap=None):
    """GRPO loss and d loss / d logprobs, written out token by token in float64."""
    rows = len(case.mask)
    loss, grad, kls = 0.0, [[0.0] * len(m) for m in case.mask], []
    for i in range(rows):
        tokens, a = case.tokens(i), case.advantages[i]
        for t in tokens:
            anchor, w = case.anchor_and_weight(i, t, tis_cap)
            logprob = case.logprobs[i][t]
            r = math.exp(logprob - anchor)
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            term = -w * min(unclipped, clipped)
            # The clipped term is constant in theta: it has no gradient when it wins the min.
            d_term = 0.0 if clipped < unclipped else -w * r * a
            if kl_coef > 0:
                log_r = case.ref[i][t] - logprob  # log pi_ref / pi_theta
                kl, d_kl = {
                    "k1": (-log_r, 1.0),
                    "k2": (log_r**2 / 2, -log_r),
                    "k3": (math.exp(log_r) - 1 - log_r, 1 - math.exp(log_r)),
                }[estimator]
                term, d_term = term + kl_coef * kl, d_term + kl_coef * d_kl
                kls.append(kl)
            loss += term / len(tokens) / rows
            grad[i][t] = d_term / len(tokens) / rows
    return loss, grad, kls


def run(case, **hyperparams):
    logprobs = case.logprobs_leaf()
    with_ref = hyperparams.pop("with_ref", True)
    out = grpo(logprobs, case.batch(with_ref=with_ref), **hyperparams)
    out.loss.backward()
    return out, logprobs.grad


def test_grpo_loss_and_gradient_match_hand_computation(case):
    out, grad = run(case, clip_eps=0.2)
    loss, expected_grad, _ = hand_grpo(case, eps=0.2)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # Clipped with A > 0 (r = 1.5, 1.3, 1.25 > 1.2) and with A < 0 (r = 0.5 < 0.8): no gradient.
    for i, t in [(0, 2), (2, 0), (2, 2), (1, 1)]:
        assert grad[i, t] == 0
    # Outside the range on the side the min does not clip: the gradient flows (A > 0, r = 0.5; A < 0, r = 1.5).
    assert grad[0, 3] < 0 and grad[1, 2] > 0
    # Prompt and padding positions get nothing.
    assert grad[0, 0] == grad[0, 1] == grad[1, 0] == grad[1, 4] == 0


def test_grpo_metrics_describe_the_clip(case):
    out, _ = run(case, clip_eps=0.2)
    ratios = [1.5, 0.5, 1.1, 0.5, 1.5, 0.9, 1.3, 0.75, 1.25, 0.85, 1.0]
    assert out.metrics["clip_fraction"] == pytest.approx(4 / 11)
    assert out.metrics["ratio_mean"] == pytest.approx(sum(ratios) / 11)
    assert out.metrics["ratio_min"] == pytest.approx(0.5)
    assert out.metrics["ratio_max"] == pytest.approx(1.5)
    assert out.metrics["is_weight_mean"] == out.metrics["is_weight_max"] == 1.0
    assert "kl" not in out.metrics


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_grpo_kl_penalty_matches_hand_computation(case, estimator):
    out, grad = run(case, clip_eps=0.2, kl_coef=0.1, kl_estimator=estimator)
    loss, expected_grad, kls = hand_grpo(case, eps=0.2, kl_coef=0.1, estimator=estimator)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert out.metrics["kl"] == pytest.approx(sum(kls) / len(kls))


@pytest.mark.parametrize("hyperparams", [{"kl_coef": 0.1, "with_ref": False}, {"kl_coef": 0.0, "with_ref": True}])
def test_grpo_kl_only_with_reference_and_positive_coef(case, hyperparams):
    out, grad = run(case, clip_eps=0.2, **hyperparams)
    loss, expected_grad, _ = hand_grpo(case, eps=0.2)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert "kl" not in out.metrics


def test_grpo_truncated_importance_sampling_is_decoupled_ppo(case):
    logprobs = case.logprobs_leaf()
    out = grpo(logprobs, case.batch(), old_logprobs=case.old_tensor(), clip_eps=0.2, tis_cap=1.5)
    out.loss.backward()
    loss, expected_grad, _ = hand_grpo(case, eps=0.2, tis_cap=1.5)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    weights = [min(math.exp(case.old[i][t] - case.behaviour[i][t]), 1.5) for i in range(3) for t in case.tokens(i)]
    assert out.metrics["is_weight_mean"] == pytest.approx(sum(weights) / len(weights))
    assert out.metrics["is_weight_max"] == pytest.approx(1.5)  # pi_old / pi_behaviour reaches 3, capped
