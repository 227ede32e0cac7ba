"""apps/examples/tinker_rl_loop.py's substeps and settings (its learning is measured by bench/tinker_rl_learning.py;
one step through the server's parts is tests/apps/server/test_tinker_rl_step.py)."""

from __future__ import annotations

import random

import pytest

from apps.examples.tinker_rl_loop import LoopConfig, parse, substep_batches


def _groups(prompts: int, size: int) -> list[list[tuple[int, int]]]:
    return [[(g, i) for i in range(size)] for g in range(prompts)]


def test_shuffled_substeps_each_hold_samples_of_nearly_every_prompt():
    # Contiguous quarters of whole groups (the loop before) gave each optimizer step 16 of the 64 prompts: with
    # 4 substeps of an off-policy loss that learned far less per step (docs/serving.md, "With the Tinker SDK").
    groups = _groups(64, 16)
    slices = substep_batches(groups, 4, random.Random(0))
    assert [len(s) for s in slices] == [256] * 4
    assert sorted(d for s in slices for d in s) == sorted(d for g in groups for d in g)  # each datum once
    assert all(len({g for g, _ in s}) >= 56 for s in slices)


def test_unshuffled_substeps_are_runs_of_whole_groups_and_empty_ones_are_left_out():
    groups = _groups(8, 2)
    groups[6] = groups[7] = []  # groups whose rewards all agreed give no datums
    slices = substep_batches(groups, 4, None)
    assert [sorted({g for g, _ in s}) for s in slices] == [[0, 1], [2, 3], [4, 5]]
    assert substep_batches([[], []], 2, random.Random(0)) == []


def test_the_defaults_are_the_measured_recipe_and_a_bad_loss_names_itself():
    cfg = LoopConfig()
    assert (cfg.loss, cfg.shuffle, cfg.normalize_std, cfg.substeps) == ("ppo", True, True, 4)
    assert parse(["--loss", "importance_sampling", "--shuffle", "false"]).loss == "importance_sampling"
    with pytest.raises(ValueError, match="--loss='cispo': must be one of ppo, importance_sampling"):
        LoopConfig(loss="cispo")
