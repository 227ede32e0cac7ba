"""bench.plain_grpo_check runs its loop end to end on forge's tiny model: samples, scores, steps, evaluates."""

from __future__ import annotations

import re
import sys

from bench import plain_grpo_check
from rl.tiny_model import build_tiny_checkpoint


def test_one_step_on_unseen_words_samples_scores_and_evaluates_the_other_unseen_words(tmp_path, monkeypatch, capsys):
    model = build_tiny_checkpoint(tmp_path / "tiny", seed=0)
    monkeypatch.setattr(sys, "argv", ["plain_grpo_check", "--model", str(model), "--steps", "1", "--prompts", "2",
                                      "--group-size", "2", "--eval-every", "1", "--train-on", "unseen",
                                      "--size", "300", "--held-out", "8"])
    plain_grpo_check.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["eval 0", "step 1", "eval 1"]
    step = re.fullmatch(r"step 1: sampled reward ([\d.]+), exact ([\d.]+), [\d.]+ s", lines[1])
    assert step and 0 <= float(step[1]) <= 1 and 0 <= float(step[2]) <= 1
    assert re.fullmatch(r"eval 1: held-out greedy mean reward [\d.]+, exact [\d.]+%; sampled at 1.0 [\d.]+, "
                        r"exact [\d.]+% \(8 prompts\)", lines[2])
