"""bench.plain_grpo_check runs its loop end to end on forge's tiny model: samples, scores, steps, evaluates."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from bench import plain_grpo_check
from bench.plain_grpo_check import process_advantages
from rl.tiny_model import build_tiny_checkpoint


@pytest.mark.parametrize("credit", ["sequence", "letters"])
def test_one_step_on_unseen_words_samples_scores_and_evaluates_the_other_unseen_words(credit, tmp_path, monkeypatch,
                                                                                      capsys):
    model = build_tiny_checkpoint(tmp_path / "tiny", seed=0)
    monkeypatch.setattr(sys, "argv", ["plain_grpo_check", "--model", str(model), "--steps", "1", "--prompts", "2",
                                      "--group-size", "2", "--eval-every", "1", "--train-on", "unseen",
                                      "--size", "300", "--held-out", "8", "--credit", credit])
    plain_grpo_check.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["eval 0", "step 1", "eval 1"]
    step = re.fullmatch(r"step 1: sampled reward ([\d.]+), exact ([\d.]+), [\d.]+ s", lines[1])
    assert step and 0 <= float(step[1]) <= 1 and 0 <= float(step[2]) <= 1
    assert re.fullmatch(r"eval 1: held-out greedy mean reward [\d.]+, exact [\d.]+%; sampled at 1.0 [\d.]+, "
                        r"exact [\d.]+% \(8 prompts\)", lines[2])


# One group of two: the exact word, and the same word with its last letter wrong. The 22-character completions end
# at their EOS, token 22; token 23 is padding. Letters 0-4 of the word are tokens 8-12.
TEXTS, WORDS = ["<answer>cimho</answer>", "<answer>cimha</answer>"], ["cimho", "cimho"]


def test_letter_credit_sums_the_normalized_step_rewards_from_each_token_on():
    # Step rewards (5 letters, then the exact word): 1 1 1 1 1 1 and 1 1 1 1 0 0; mean 10/12, std over the 12.
    mean = 10 / 12
    std = math.sqrt((10 * (1 - mean) ** 2 + 2 * mean**2) / 11)
    up, down = (1 - mean) / std, -mean / std
    first = [6 * up] * 9 + [5 * up, 4 * up, 3 * up, 2 * up] + [up] * 10 + [0]
    second = [4 * up + 2 * down] * 9 + [3 * up + 2 * down, 2 * up + 2 * down, up + 2 * down, 2 * down] + [down] * 10 + [0]
    got = process_advantages(TEXTS, WORDS, 2, 24, "letters")
    torch.testing.assert_close(got, torch.tensor([first, second]))


def test_position_credit_puts_each_letters_advantage_on_its_own_token():
    # Letters 0-3 agree (no signal); letter 4 and the exact word split 1 / 0: +-1/sqrt(2) each.
    half = 1 / math.sqrt(2)
    first = [half] * 12 + [2 * half] + [half] * 10 + [0]
    got = process_advantages(TEXTS, WORDS, 2, 24, "positions")
    torch.testing.assert_close(got, torch.tensor([first, [-a for a in first]]))


def test_a_missing_letter_ends_at_the_eos_and_an_untagged_completion_gets_no_letter():
    assert plain_grpo_check.letter_steps("<answer>ab</answer>", "abc") == [(8, 1.0), (9, 1.0), (19, 0.0), (19, 0.0)]
    assert plain_grpo_check.letter_steps("abc", "abc") == [(3, 0.0)] * 4
