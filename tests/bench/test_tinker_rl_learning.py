"""bench/tinker_rl_learning.py's arguments (its run starts a server: measured by hand, figures in docs/serving.md)."""

from __future__ import annotations

import pytest

from bench.tinker_rl_learning import SERVER_DEFAULTS, loop_overrides, main


def test_loop_overrides_are_parsed_as_the_examples_fields():
    assert loop_overrides(["steps=20", "learning_rate=5e-4", "reverse_answer=false"]) == {
        "steps": 20, "learning_rate": 5e-4, "reverse_answer": False}
    assert loop_overrides([]) == {}


def test_a_bad_override_names_itself_and_the_allowed_fields(capsys):
    with pytest.raises(ValueError, match=r"--loop 'stpes=20': give name=value with name one of \[.*'steps'"):
        loop_overrides(["stpes=20"])
    with pytest.raises(ValueError, match="give name=value"):
        loop_overrides(["steps"])
    assert main(["--loop", "stpes=20"]) == 2
    assert "config error: --loop 'stpes=20'" in capsys.readouterr().err


def test_the_server_serves_the_examples_default_task():
    from apps.examples.tinker_rl_loop import LoopConfig

    assert f"reverse_answer={str(LoopConfig().reverse_answer).lower()}" in SERVER_DEFAULTS
