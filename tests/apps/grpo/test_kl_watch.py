"""A distillation run whose reverse KL to its teacher does not fall says so in its output (issue 55), and one that
learns, or has nothing left to learn, does not."""

import io
from pathlib import Path

import pytest

from apps.grpo.cli import load_job_config
from apps.grpo.kl_watch import ReverseKLWatch
from forge.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def feed(values: list[float], check_steps: int = 20) -> tuple[ReverseKLWatch, str]:
    out = io.StringIO()
    watch = ReverseKLWatch(check_steps, out=out)
    for step, value in enumerate(values, start=1):
        watch.step(step, value)
    return watch, out.getvalue()


def test_a_flat_reverse_kl_is_reported_after_the_check_steps_naming_it():
    # The seed 3: ~4 nats per token from step 1 to step 60.
    flat = [3.98, 4.1, 3.86, 4.2, 3.9] * 12
    watch, printed = feed(flat[:19])
    assert printed == "" and watch.warnings == []  # not before the check
    watch, printed = feed(flat)
    assert len(watch.warnings) == 3  # steps 20, 40 and 60
    assert printed.count("warning: reverse_kl has not fallen after") == 3
    assert "after 20 steps" in watch.warnings[0] and "after 60 steps" in watch.warnings[2]
    assert "4.01" in watch.warnings[0]  # the first steps' mean, so the reader sees the level


def test_a_rising_reverse_kl_is_reported():
    _, printed = feed([2.0 + 0.1 * step for step in range(20)])
    assert "warning: reverse_kl has not fallen after 20 steps" in printed


@pytest.mark.parametrize("values", [
    [2.7 - 0.09 * step for step in range(40)],  # seed 0 as in the issue: 2.73 -> ~1
    [0.02, 0.01, 0.03, 0.02, 0.01] * 8,  # already at the teacher: nothing left to fall
])
def test_a_falling_or_already_small_reverse_kl_is_not_reported(values):
    watch, printed = feed(values)
    assert printed == "" and watch.warnings == []


def test_no_check_without_steps_or_without_a_metric():
    watch, printed = feed([4.0] * 40, check_steps=0)
    assert printed == "" and watch.warnings == []
    watch = ReverseKLWatch(20, out=io.StringIO())
    assert all(watch.step(step, None) is None for step in range(1, 41))  # a GRPO job logs no reverse_kl


def test_kl_check_steps_is_checked_with_the_config():
    config = str(ROOT / "configs/distill_tiny.yaml")
    assert load_job_config(["--config", config])[0].teacher.kl_check_steps == 20
    with pytest.raises((ConfigError, ValueError), match=r"kl_check_steps=-1: must be an int >= 0"):
        load_job_config(["--config", config, "teacher.kl_check_steps=-1"])
