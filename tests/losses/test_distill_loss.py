import math

import pytest
import torch

from losses.distill import distill
from rl.types import TrainBatch


def hand_distill(case, *, eps, reward_coef, tis_cap=None):
    """The loss and its gradient token by token: A_t = -(log pi - log pi_T) + lambda A_i is a constant."""
    n = case.num_tokens()
    loss, grad = 0.0, [[0.0] * len(m) for m in case.mask]
    for i in range(len(case.mask)):
        for t in case.tokens(i):
            anchor, w = case.anchor_and_weight(i, t, tis_cap)
            a = -(case.logprobs[i][t] - case.ref[i][t]) + reward_coef * case.advantages[i]
            r = math.exp(case.logprobs[i][t] - anchor)
            clipped = (a > 0 and r > 1 + eps) or (a < 0 and r < 1 - eps)
            loss += -w * min(r * a, min(max(r, 1 - eps), 1 + eps) * a) / n
            grad[i][t] = 0.0 if clipped else -w * r * a / n
    return loss, grad


@pytest.mark.parametrize(("eps", "reward_coef", "tis_cap"), [(0.2, 0.0, None), (0.2, 0.5, None), (0.1, 2.0, 1.5),
                                                             (10.0, 0.0, None)])
def test_distill_matches_hand_computation(case, eps, reward_coef, tis_cap):
    logprobs = case.logprobs_leaf()
    out = distill(logprobs, case.batch(), old_logprobs=case.old_tensor(), clip_eps=eps, reward_coef=reward_coef,
                  tis_cap=tis_cap)
    out.loss.backward()
    loss, grad = hand_distill(case, eps=eps, reward_coef=reward_coef, tis_cap=tis_cap)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    tokens = [(i, t) for i in range(len(case.mask)) for t in case.tokens(i)]
    k1 = [case.logprobs[i][t] - case.ref[i][t] for i, t in tokens]
    assert out.metrics["reverse_kl"] == pytest.approx(sum(k1) / len(k1), rel=1e-12)


def one_token_batch(student: torch.Tensor, teacher: torch.Tensor, token: int, advantage: float) -> TrainBatch:
    """One sequence, one generated token `token`, sampled by the student itself (behaviour = student)."""
    return TrainBatch(input_ids=torch.zeros(1, 2, dtype=torch.long),
                      response_mask=torch.ones(1, 1, dtype=torch.float64),
                      behaviour_logprobs=student[token].detach().reshape(1, 1),
                      policy_versions=torch.zeros(1, 1, dtype=torch.long),
                      advantages=torch.tensor([advantage], dtype=torch.float64),
                      rewards=torch.tensor([advantage], dtype=torch.float64), ref_logprobs=teacher[token].reshape(1, 1))


@pytest.mark.parametrize("reward_coef", [0.0, 0.7])
def test_the_expectation_over_the_students_samples_is_the_exact_reverse_kl_and_its_gradient(reward_coef):
    # Every token of a 6-token vocabulary enumerated, weighted by the student's probability: the loss's expected
    # value is KL(pi || pi_T) exactly and its expected gradient (w.r.t. the student's logits) that of
    # KL(pi || pi_T) - lambda E_pi[A]: the reward mixed in as a policy gradient.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(6, generator=generator, dtype=torch.float64) * 2, dim=-1)
    rewards = torch.randn(6, generator=generator, dtype=torch.float64)
    student = torch.log_softmax(logits, dim=-1)
    probs = student.exp().detach()
    expected_loss = sum(probs[y] * distill(student[y].reshape(1, 1), one_token_batch(student, teacher, y, rewards[y]),
                                           reward_coef=reward_coef).loss for y in range(6))
    (estimator_grad,) = torch.autograd.grad(expected_loss, logits, retain_graph=True)

    exact = torch.sum(student.exp() * (student - teacher)) - reward_coef * torch.sum(student.exp() * rewards)
    (exact_grad,) = torch.autograd.grad(exact, logits)
    kl = torch.sum(probs * (student.detach() - teacher))
    assert kl > 0.1  # teacher and student differ: the check is not 0 == 0
    assert expected_loss.item() == pytest.approx((kl - reward_coef * torch.sum(probs * rewards)).item(), rel=1e-12)
    torch.testing.assert_close(estimator_grad, exact_grad, rtol=1e-12, atol=1e-15)


def test_reward_coef_zero_ignores_the_reward_and_a_positive_one_adds_its_policy_gradient(case):
    plain, flipped, mixed = case.logprobs_leaf(), case.logprobs_leaf(), case.logprobs_leaf()
    batch = case.batch()
    distill(plain, batch, clip_eps=100.0).loss.backward()
    other = case.batch()
    other.advantages = -other.advantages * 3
    distill(flipped, other, clip_eps=100.0).loss.backward()
    torch.testing.assert_close(flipped.grad, plain.grad, rtol=0, atol=0)
    distill(mixed, batch, clip_eps=100.0, reward_coef=0.5).loss.backward()
    # Unclipped, the reward's share of the gradient is -lambda A_i r_t / n on each response token.
    ratio = torch.exp(mixed.detach() - batch.behaviour_logprobs) * batch.response_mask
    reward_share = -0.5 * batch.advantages.unsqueeze(-1) * ratio / case.num_tokens()
    torch.testing.assert_close(mixed.grad - plain.grad, reward_share, rtol=1e-12, atol=1e-15)


def test_environment_tokens_inside_an_episode_get_no_gradient_and_do_not_count(case):
    # Multi-turn: the environment's tokens sit between the model's turns with mask 0.
    batch = case.batch()
    batch.response_mask[2, 2] = 0
    batch.ref_logprobs[2, 2] = math.nan  # whatever the teacher gave there is never read
    logprobs = case.logprobs_leaf()
    out = distill(logprobs, batch)
    out.loss.backward()
    assert logprobs.grad[2, 2] == 0 and torch.isfinite(out.loss)
    case.mask[2][2] = 0
    loss, grad = hand_distill(case, eps=0.2, reward_coef=0.0)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(logprobs.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_without_the_teachers_logprobs_it_says_what_is_missing(case):
    with pytest.raises(ValueError, match=r"^distill: batch.ref_logprobs is None; the loss needs the teacher's"):
        distill(case.logprobs_leaf(), case.batch(with_ref=False))


def test_bad_reward_coef_is_named(case):
    with pytest.raises(ValueError, match=r"^distill: reward_coef=-1: must be a number >= 0"):
        distill(case.logprobs_leaf(), case.batch(), reward_coef=-1)
