"""Which warm start apps.grpo runs for a task (pure: the warm start itself is replaced)."""

import pytest
from types import SimpleNamespace

from apps.grpo import rollouts
from apps.warm_start.config import WarmStartConfig
from rl.tasks.config import TaskConfig

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process


def _cfg(task: TaskConfig, enabled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(model="base", model_cache="cache", seed=0, task=task,
                           warm_start=WarmStartConfig(enabled=enabled), rollout=SimpleNamespace(max_tokens=8))


def test_every_single_turn_task_is_warm_started_on_its_answers(monkeypatch):
    calls = []

    def warm_start_on_task(model, model_cache, task, config, *, seed, max_tokens):
        calls.append((model, task, max_tokens))
        return "warmed", 0.25

    monkeypatch.setattr(rollouts, "warm_start_on_task", warm_start_on_task)
    tasks = (TaskConfig(), TaskConfig(name="gsm8k"), TaskConfig(source="reasoning_gym", name="basic_arithmetic"))
    for task_config in tasks:
        task = SimpleNamespace(name=task_config.name)  # single-turn: no environment
        assert rollouts.warm_started_model(_cfg(task_config), task) == ("warmed", 0.25)
        assert calls[-1] == ("base", task, 8)
    assert rollouts.warm_started_model(_cfg(TaskConfig(), enabled=False), SimpleNamespace()) == ("base", None)
