"""The task protocol (rl/tasks/protocol.py): every task a config can name is a `Task`, a multi-turn one (and only those)
a `MultiTurnTask`, its problems `TaskProblem`s; and mypy agrees, signatures included (`_conforms` below)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from rl.environments.protocol import Environment
from rl.tasks import TaskConfig, make_task
from rl.tasks.arithmetic import ArithmeticTask, Problem
from rl.tasks.config import FORGE_TASKS
from rl.tasks.environment import EnvironmentTask, SeededProblem
from rl.tasks.gsm8k import GSM8KTask
from rl.tasks.lookup import LookupProblem, LookupTask
from rl.tasks.openenv import OpenEnvTask
from rl.tasks.protocol import MultiTurnTask, Task, TaskProblem
from rl.tasks.reasoning_gym import ReasoningGymTask
from rl.tiny_model import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[3]

# (config, the class make_task builds): every source, and every forge task by name.
CASES = {
    "forge/arithmetic": ({"name": "arithmetic", "held_out": 10}, ArithmeticTask),
    "forge/gsm8k": ({"name": "gsm8k", "held_out": 4}, GSM8KTask),  # `dataset`: a local file (the fixture)
    "forge/lookup": ({"name": "lookup", "held_out": 10}, LookupTask),
    "reasoning_gym": ({"source": "reasoning_gym", "name": "basic_arithmetic", "size": 20, "held_out": 5},
                      ReasoningGymTask),
    "openenv": ({"source": "openenv", "name": "tests.rl.environments.openenv_guess:GuessEnvironment", "held_out": 4},
                OpenEnvTask),
    "environment": ({"source": "environment", "name": "tests.rl.tasks.environment_classes:Good", "held_out": 4},
                    EnvironmentTask),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("gsm8k") / "data.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"What is {n} plus 1?", "answer": f"#### {n + 1}"})
                              for n in range(12)))
    return str(path)


def test_the_cases_cover_every_source_and_every_forge_task():
    sources = typing.get_args(typing.get_type_hints(TaskConfig)["source"])
    assert {case.partition("/")[0] for case in CASES} == set(sources)
    assert {case.partition("/")[2] for case in CASES if case.startswith("forge/")} == set(FORGE_TASKS)


@pytest.mark.parametrize("case", CASES)
def test_every_task_the_config_can_name_satisfies_the_protocol(case, model, gsm8k_file):
    fields, cls = CASES[case]
    config = TaskConfig(**fields, **({"dataset": gsm8k_file} if cls is GSM8KTask else {}))
    task = make_task(config, seed=0, model=model)
    assert type(task) is cls
    assert isinstance(task, Task)
    assert isinstance(task, MultiTurnTask) is config.multi_turn  # the check the apps make, agreeing with the config
    problems = [*task.held_out(), *task.sample_prompts(3, random.Random(0))]
    assert problems and all(isinstance(p, TaskProblem) for p in problems)
    assert all(isinstance(t, int) for t in task.stop_token_ids)
    if config.multi_turn:
        assert isinstance(task.environment(), Environment)


def test_a_task_missing_a_member_is_neither():
    class NoReward:
        stop_token_ids = ()

        def sample_prompts(self, n, rng):
            return []

        def held_out(self):
            return []

    class EnvironmentOnly(NoReward):  # has environment() (what `hasattr` checked) but is not a task
        def environment(self):
            return None

    assert not isinstance(NoReward(), Task)
    assert not isinstance(EnvironmentOnly(), MultiTurnTask)


def _conforms(arithmetic: ArithmeticTask, gsm8k: GSM8KTask, reasoning_gym: ReasoningGymTask, lookup: LookupTask,
              environment: EnvironmentTask, openenv: OpenEnvTask) -> None:
    """Never called: mypy checks these assignments (test_mypy_checks_the_protocol_and_every_task_against_it), each
    task with its own problem type, so a member's signature that drifts from the protocol fails the test."""
    single: list[Task[Problem]] = [arithmetic, gsm8k, reasoning_gym]
    multi_lookup: MultiTurnTask[LookupProblem] = lookup
    multi_seeded: list[MultiTurnTask[SeededProblem]] = [environment, openenv]
    del single, multi_lookup, multi_seeded


def test_mypy_checks_the_protocol_and_every_task_against_it(tmp_path):
    """mypy (the dev extra; its settings: pyproject.toml's [tool.mypy]) on the protocol module and this file."""
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "rl/tasks/protocol.py",
                          str(Path(__file__).relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found in 2 source files" in run.stdout
