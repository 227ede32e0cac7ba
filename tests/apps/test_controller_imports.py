"""An app's controller imports before it starts a process, on every run and in every test that runs an app: apps.grpo's
and apps.sft's import no torchtitan or peft (the trainer's and the reference model's processes do)."""

from __future__ import annotations

import pytest

from tests.blocked_imports import import_with_blocked

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process


def test_the_grpo_and_sft_controllers_import_no_torchtitan_or_peft():
    result = import_with_blocked(["apps.grpo.main", "apps.sft.main"], ["torchtitan", "peft"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
