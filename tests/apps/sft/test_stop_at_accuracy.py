"""`eval.stop_at_accuracy`: SFT stops at the first evaluation whose held-out accuracy reaches it (a start for GRPO that
leaves it the rest; docs/sft.md); refused, naming the key, where no accuracy is measured during training."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.sft.cli import load_sft_config
from apps.sft.main import reached
from forge.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/sft_tiny.yaml")


def test_training_stops_once_the_accuracy_reaches_the_target_and_only_then():
    assert reached({"eval/loss": 0.1, "eval/accuracy": 0.15}, 0.15)
    assert not reached({"eval/loss": 0.1, "eval/accuracy": 0.149}, 0.15)
    assert not reached({"eval/loss": 0.1, "eval/accuracy": 1.0}, None)  # no target: all the steps
    assert not reached({"eval/loss": 0.1}, 0.15)  # a loss alone never stops it


def test_the_target_loads():
    cfg, _ = load_sft_config(["--config", TINY, "eval.stop_at_accuracy=0.2"])
    assert cfg.eval.stop_at_accuracy == 0.2


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.stop_at_accuracy=0"], r"^eval.stop_at_accuracy=0.0: must be in \(0, 1\], or null"),
    (["eval.stop_at_accuracy=1.5"], r"^eval.stop_at_accuracy=1.5: must be in \(0, 1\], or null"),
    (["eval.stop_at_accuracy=0.2", "eval.every=0"],
     r"^eval.stop_at_accuracy=0.2: needs the held-out accuracy measured during training: .* \(eval.every=0\)"),
    (["eval.stop_at_accuracy=0.2", "eval.accuracy=false"],
     r"^eval.stop_at_accuracy=0.2: needs the held-out accuracy measured during training"),
])
def test_a_target_that_cannot_be_checked_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_sft_config(["--config", TINY, *overrides])
