"""The TRL comparison's pieces that need no TRL: its restatement of TRL's GRPO equations agrees with forge's loss and
advantages, and the side-by-side bench reads the app's evaluations and reports times to a target correctly."""

from __future__ import annotations

import math

import torch

from apps.grpo.summary import RunSummary
from apps.held_out.scores import ProblemResult, score_task
from bench.grpo_step_vs_trl import trl_advantages, trl_grpo_loss
from bench.trl_side_by_side import EVAL_LINE, accuracy_at_time, time_to
from losses.advantages import group_advantages
from losses.grpo import grpo
from rl.types import TrainBatch


def test_trl_restatement_matches_forges_grpo_loss_and_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, length = 8, 7
    mask = torch.zeros(rows, length)
    for row in range(rows):
        mask[row, 2 : 3 + row % 4] = 1  # responses of 1 to 4 tokens: a token mean per sequence differs from a batch one
    behaviour = -torch.rand(rows, length, generator=gen)
    logprobs = (behaviour + 0.3 * torch.randn(rows, length, generator=gen)).requires_grad_()  # some ratios clip
    advantages = torch.randn(rows, generator=gen)
    batch = TrainBatch(input_ids=torch.zeros(rows, length + 1, dtype=torch.long), response_mask=mask,
                       behaviour_logprobs=behaviour, policy_versions=torch.zeros(rows, length, dtype=torch.long),
                       advantages=advantages, rewards=torch.zeros(rows))
    forge = grpo(logprobs, batch, clip_eps=0.2).loss
    (forge_grad,) = torch.autograd.grad(forge, logprobs)
    trl = trl_grpo_loss(logprobs, behaviour, advantages, mask, 0.2)
    (trl_grad,) = torch.autograd.grad(trl, logprobs)
    torch.testing.assert_close(forge, trl)
    torch.testing.assert_close(forge_grad, trl_grad)


def test_trl_advantages_differ_from_forges_only_by_the_std_epsilon() -> None:
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.float32)  # 3 groups of 4
    groups = torch.arange(3).repeat_interleave(4)
    forge, zero = group_advantages(rewards, groups)
    trl = trl_advantages(rewards, group_size=4)
    assert zero.tolist() == [False] * 8 + [True] * 4 and trl[8:].abs().max() == 0
    torch.testing.assert_close(forge, trl, rtol=1e-3, atol=0)  # (std + 1e-6) against (std + 1e-4)
    assert not torch.equal(forge, trl)


def test_the_bench_reads_the_apps_evaluation_lines(capsys) -> None:
    summary = RunSummary(held_out_score="accuracy")
    for label, version, rewards in (("start", 0, [1.0, 0.0, 0.0, 0.0]), ("step 25", 25, [1.0, 1.0, 1.0, 0.0])):
        summary.evaluated(label, version, score_task([ProblemResult([r]) for r in rewards], 1, [1], 1.0))
    found = [m.groups() for m in EVAL_LINE.finditer(capsys.readouterr().out)]
    assert [(label, step, float(percent)) for label, step, percent in found] == [("start", None, 25.0),
                                                                                  ("step 25", "25", 75.0)]


def test_times_to_a_target_and_accuracy_at_a_time() -> None:
    evals = [{"step": 0, "train_s": 0.0, "accuracy": 0.2}, {"step": 25, "train_s": 10.0, "accuracy": 0.72},
             {"step": 50, "train_s": 21.0, "accuracy": 0.69}, {"step": 75, "train_s": 30.0, "accuracy": 0.81}]
    assert time_to(evals, 0.70) == 10.0 and time_to(evals, 0.75) == 30.0 and math.isnan(time_to(evals, 0.9))
    assert accuracy_at_time(evals, 25.0) == 0.69 and accuracy_at_time(evals, 9.9) == 0.2
