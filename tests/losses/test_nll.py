"""The SFT loss (losses/nll.py) against a hand computation in float64."""

import math

import torch

from losses import get_loss
from losses.nll import nll
from rl.types import TrainBatch


def batch(mask: list[list[int]]) -> TrainBatch:
    m = torch.tensor(mask, dtype=torch.float64)
    zeros = torch.zeros_like(m)
    rows = m.shape[0]
    return TrainBatch(input_ids=torch.zeros(rows, m.shape[1] + 1, dtype=torch.long), response_mask=m,
                      behaviour_logprobs=zeros, policy_versions=zeros.long() - 1, advantages=torch.zeros(rows),
                      rewards=torch.zeros(rows))


MASK = [[0, 0, 1, 1], [1, 1, 1, 0]]  # row 0: two prompt positions; row 1: one padding position
LOGPROBS = [[-9.0, -9.0, math.log(0.5), math.log(0.25)], [math.log(0.8), math.log(0.1), math.log(0.5), -9.0]]


def test_the_loss_is_the_token_mean_nll_over_the_mask():
    logprobs = torch.tensor(LOGPROBS, dtype=torch.float64, requires_grad=True)
    out = nll(logprobs, batch(MASK))
    # 5 learned tokens of the whole batch, each weighing the same (not a mean of the two rows' means).
    expected = -(math.log(0.5) + math.log(0.25) + math.log(0.8) + math.log(0.1) + math.log(0.5)) / 5
    assert out.loss.dtype == torch.float64
    assert math.isclose(out.loss.item(), expected, rel_tol=1e-15)
    assert out.metrics == {"tokens": 5.0}
    out.loss.backward()
    expected_grad = -torch.tensor(MASK, dtype=torch.float64) / 5  # d/d logprob: -1/N on the mask, 0 elsewhere
    assert torch.equal(logprobs.grad, expected_grad)


def test_what_sits_off_the_mask_changes_neither_loss_nor_gradient():
    clean = torch.tensor(LOGPROBS, dtype=torch.float64, requires_grad=True)
    dirty_values = torch.tensor(LOGPROBS, dtype=torch.float64)
    off = torch.tensor(MASK) == 0
    dirty_values[off] = torch.tensor([math.nan, -math.inf, math.inf], dtype=torch.float64)
    dirty = dirty_values.requires_grad_()
    a, b = nll(clean, batch(MASK)), nll(dirty, batch(MASK))
    a.loss.backward()
    b.loss.backward()
    assert torch.equal(a.loss, b.loss) and torch.equal(clean.grad, dirty.grad)


def test_an_empty_mask_gives_zero_not_nan():
    out = nll(torch.zeros(1, 3, dtype=torch.float64, requires_grad=True), batch([[0, 0, 0]]))
    assert out.loss.item() == 0.0


def test_the_trainer_resolves_it_by_module_path():
    assert get_loss("losses.nll:nll") is nll
