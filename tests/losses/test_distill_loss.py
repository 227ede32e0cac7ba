import math

import pytest
import torch

from actors.logprobs import bucket_logprobs, topk_logprobs
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


# --- kl="reverse" / "forward": the KL at each position over the teacher's top-k tokens and the rest ---------------

V = 5
L = math.log


def vocabulary_inputs(case, k: int, seed: int = 0):
    """Student logits (a leaf) and teacher log-probs over a V-token vocabulary at every position of `case`, the
    teacher's top-k ids and bucket log-probs (actors.logprobs), and the batch carrying them."""
    generator = torch.Generator().manual_seed(seed)
    shape = (len(case.mask), len(case.mask[0]), V)
    logits = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(shape, generator=generator, dtype=torch.float64) * 2, dim=-1)
    ids, teacher_buckets = topk_logprobs(teacher, k)
    batch = case.batch()
    batch.ref_topk_ids, batch.ref_topk_logprobs = ids, teacher_buckets
    return logits, teacher, ids, batch


def students_buckets(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return bucket_logprobs(torch.log_softmax(logits, dim=-1), ids)


def hand_vocabulary_kl(case, logits, teacher, ids, kl: str):
    """By hand in Python floats, over the buckets b = {v} for v in the teacher's top-k and the rest, with P_b and Q_b
    the student's and the teacher's mass and p_v the student's probability of token v:
        reverse  D_t = sum_b P_b (log P_b - log Q_b),  dD_t/dz_v = p_v (log P_b(v) - log Q_b(v) - D_t)
        forward  D_t = sum_b Q_b (log Q_b - log P_b),  dD_t/dz_v = p_v - Q_b(v) p_v / P_b(v)
    Returns the loss (D_t's mean over the n response tokens), its gradient w.r.t. the logits, and every response
    token's (reverse, forward) KL."""
    n = case.num_tokens()
    loss, grad, kls = 0.0, torch.zeros(logits.shape, dtype=torch.float64), []
    for i in range(len(case.mask)):
        for t in case.tokens(i):
            z = logits[i, t].tolist()
            p = [math.exp(x) / sum(math.exp(y) for y in z) for x in z]
            q = [math.exp(x) for x in teacher[i, t].tolist()]
            top = ids[i, t].tolist()
            buckets = [[v] for v in top] + [[v for v in range(V) if v not in top]]
            masses = [(sum(p[v] for v in b), sum(q[v] for v in b)) for b in buckets]
            reverse = sum(pb * (L(pb) - L(qb)) for pb, qb in masses if pb > 0)
            forward = sum(qb * (L(qb) - L(pb)) for pb, qb in masses if qb > 0)
            kls.append((reverse, forward))
            loss += (reverse if kl == "reverse" else forward) / n
            for b, (pb, qb) in zip(buckets, masses):
                for v in b:
                    d = p[v] * (L(pb) - L(qb) - reverse) if kl == "reverse" else p[v] - qb * p[v] / pb
                    grad[i, t, v] = d / n
    return loss, grad, kls


@pytest.mark.parametrize("kl", ["reverse", "forward"])
@pytest.mark.parametrize("k", [2, V, 8])  # a rest bucket; the whole vocabulary (the exact KL); k past it
def test_vocabulary_kl_matches_hand_computation(case, kl, k):
    logits, teacher, ids, batch = vocabulary_inputs(case, k)
    out = distill(case.logprobs_leaf(), batch, topk_logprobs=students_buckets(logits, ids), kl=kl)
    (grad,) = torch.autograd.grad(out.loss, logits)
    loss, hand_grad, kls = hand_vocabulary_kl(case, logits.detach(), teacher, ids, kl)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    torch.testing.assert_close(grad, hand_grad, rtol=1e-10, atol=1e-15)
    assert out.metrics["reverse_kl"] == pytest.approx(sum(r for r, _ in kls) / len(kls), rel=1e-12)
    assert out.metrics["forward_kl"] == pytest.approx(sum(f for _, f in kls) / len(kls), rel=1e-12)
    if k >= V:  # the exact KL at every position
        p = torch.log_softmax(logits.detach(), dim=-1)
        per_position = (p.exp() * (p - teacher)).sum(-1) if kl == "reverse" else (teacher.exp() * (teacher - p)).sum(-1)
        assert out.loss.item() == pytest.approx(((per_position * batch.response_mask).sum() / case.num_tokens()).item(),
                                                rel=1e-12)


def test_vocabulary_kl_counts_the_rest_of_the_vocabulary_as_one_bucket(case):
    # Dropping the rest bucket gives another value, and so does splitting it into its tokens (the exact KL, of which
    # the lumped one is a lower bound): the hand computation above lumps it.
    logits, teacher, ids, batch = vocabulary_inputs(case, 2)
    student = students_buckets(logits, ids).detach()
    lumped = distill(case.logprobs_leaf(), batch, topk_logprobs=student, kl="reverse").loss.item()
    top_only = (student[..., :-1].exp() * (student[..., :-1] - batch.ref_topk_logprobs[..., :-1])).sum(-1)
    top_only = ((top_only * batch.response_mask).sum() / case.num_tokens()).item()
    p = torch.log_softmax(logits.detach(), dim=-1)
    exact = (((p.exp() * (p - teacher)).sum(-1) * batch.response_mask).sum() / case.num_tokens()).item()
    assert abs(lumped - top_only) > 0.05 and exact - lumped > 0.05


@pytest.mark.parametrize("kl", ["reverse", "forward"])
def test_vocabulary_kl_is_zero_at_the_teacher_and_positive_elsewhere_and_a_gradient_step_lowers_it(case, kl):
    logits, teacher, ids, batch = vocabulary_inputs(case, 3)
    at_teacher = teacher.clone().requires_grad_()  # the student's logits at the teacher's
    out = distill(case.logprobs_leaf(), batch, kl=kl, topk_logprobs=students_buckets(at_teacher, ids))
    (grad,) = torch.autograd.grad(out.loss, at_teacher)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-12) and grad.abs().max() < 1e-12
    # A KL with its sign flipped would be negative here, and the step below would raise it.
    before = distill(case.logprobs_leaf(), batch, kl=kl, topk_logprobs=students_buckets(logits, ids)).loss
    (step,) = torch.autograd.grad(before, logits)
    after = distill(case.logprobs_leaf(), batch, kl=kl,
                    topk_logprobs=students_buckets(logits.detach() - 1.0 * step, ids)).loss
    assert before.item() > 0.1 and after.item() < before.item()


def test_the_forward_kl_pulls_toward_the_teachers_token_where_the_reverse_kl_barely_does():
    # A student that gives the teacher's answer (token 0, probability ~0.98 under the teacher) almost no mass: the
    # reverse KL's gradient on that logit is proportional to the student's probability of it, the forward KL's to the
    # teacher's.
    student_logits = torch.tensor([[[-6.0, 4.0, 0.0, 0.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([[[6.0, -6.0, 2.0, 0.0, 0.0]]], dtype=torch.float64), dim=-1)
    ids, buckets = topk_logprobs(teacher, V)
    zero = torch.zeros(1, 1, dtype=torch.float64)
    batch = TrainBatch(input_ids=torch.zeros(1, 2, dtype=torch.long), response_mask=torch.ones_like(zero),
                       behaviour_logprobs=zero, policy_versions=torch.zeros(1, 1, dtype=torch.long),
                       advantages=zero[0], rewards=zero[0], ref_topk_ids=ids, ref_topk_logprobs=buckets)
    pulls = {}
    for kl in ("reverse", "forward"):
        out = distill(torch.zeros(1, 1, dtype=torch.float64, requires_grad=True), batch, kl=kl,
                      topk_logprobs=students_buckets(student_logits, ids))
        (grad,) = torch.autograd.grad(out.loss, student_logits)
        pulls[kl] = -grad[0, 0, 0].item()  # how fast descent raises the teacher's token
    assert 0 < pulls["reverse"] < 0.01 and pulls["forward"] > 0.9


def test_vocabulary_kl_adds_the_rewards_policy_gradient_and_ignores_the_sampled_tokens_teacher_logprob(case):
    logits, teacher, ids, batch = vocabulary_inputs(case, 3)
    student = students_buckets(logits, ids)
    plain, mixed = case.logprobs_leaf(), case.logprobs_leaf()
    batch.ref_logprobs = None  # kl="reverse" / "forward" do not read the sampled tokens' teacher log-probs
    assert distill(plain, batch, topk_logprobs=student, kl="reverse").loss.requires_grad
    out = distill(mixed, batch, topk_logprobs=student, kl="forward", reward_coef=0.5, clip_eps=100.0)
    out.loss.backward()
    ratio = torch.exp(mixed.detach() - batch.behaviour_logprobs) * batch.response_mask
    torch.testing.assert_close(mixed.grad, -0.5 * batch.advantages.unsqueeze(-1) * ratio / case.num_tokens(),
                               rtol=1e-12, atol=1e-15)


def test_vocabulary_kl_without_the_teachers_topk_or_the_students_says_what_is_missing(case):
    logits, _, ids, batch = vocabulary_inputs(case, 2)
    student = students_buckets(logits, ids)
    with pytest.raises(ValueError, match=r"^distill: kl='reverse' and topk_logprobs=None; the trainer passes"):
        distill(case.logprobs_leaf(), batch, kl="reverse")
    with pytest.raises(ValueError, match=r"^distill: topk_logprobs has shape \(3, 5, 2\); must match "):
        distill(case.logprobs_leaf(), batch, kl="forward", topk_logprobs=student[..., 1:])
    batch.ref_topk_logprobs = None
    with pytest.raises(ValueError, match=r"^distill: kl='forward' and batch.ref_topk_logprobs is None; .*top_k"):
        distill(case.logprobs_leaf(), batch, kl="forward", topk_logprobs=student)


def test_bad_kl_is_named(case):
    with pytest.raises(ValueError, match=r"^distill: kl='full': must be one of sampled, reverse, forward"):
        distill(case.logprobs_leaf(), case.batch(), kl="full")
