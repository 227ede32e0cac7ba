import statistics

import pytest
import torch

from losses.advantages import group_advantages

# Groups interleaved and not numbered 0..G-1, as a replay buffer may hand them over.
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.9, 0.0, 0.3, 0.1, 0.1, 0.1, 2.0, 0.7]
GROUPS = [7, 3, 7, 3, 7, 3, 12, 5, 5, 5, 12, 40]


def hand_advantages(normalize_std, eps):
    out = []
    for reward, group in zip(REWARDS, GROUPS):
        members = [r for r, g in zip(REWARDS, GROUPS) if g == group]
        if len(set(members)) == 1:
            out.append(0.0)
            continue
        centred = reward - statistics.fmean(members)
        out.append(centred / (statistics.stdev(members) + eps) if normalize_std else centred)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_match_hand_computation(normalize_std):
    advantages, zero_variance = group_advantages(
        torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS), normalize_std=normalize_std, eps=1e-6
    )
    torch.testing.assert_close(advantages, torch.tensor(hand_advantages(normalize_std, 1e-6), dtype=torch.float64))
    # Group 5 (all 0.1) and the singleton group 40 carry no signal.
    assert zero_variance.tolist() == [g in (5, 40) for g in GROUPS]


def test_all_equal_group_gets_exactly_zero_advantage_despite_rounding():
    # In float32 the mean of seven 0.1s is off by ~7e-9; 1/(std + eps) would blow that up to ~0.007.
    advantages, zero_variance = group_advantages(torch.full((7,), 0.1), torch.zeros(7, dtype=torch.long))
    assert advantages.tolist() == [0.0] * 7 and zero_variance.all()


@pytest.mark.parametrize(
    ("rewards", "group_ids", "message"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), r"rewards: shape \(2, 3\).*must be a 1-D float"),
        (torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), r"rewards: .*dtype torch.int64"),
        (torch.zeros(3), torch.zeros(4, dtype=torch.long), r"group_ids: shape \(4,\).*rewards' shape \(3,\)"),
        (torch.zeros(3), torch.zeros(3), r"group_ids: shape \(3,\), dtype torch.float32; must be an integer"),
        (torch.tensor([0.0, float("nan"), float("inf")]), torch.zeros(3, dtype=torch.long), r"positions \[1, 2\]"),
    ],
)
def test_group_advantages_rejects_bad_input(rewards, group_ids, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_ids)


def test_group_advantages_rejects_negative_eps():
    with pytest.raises(ValueError, match=r"eps=-1e-06: must be a number >= 0"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), eps=-1e-6)
