"""Verifiable tasks: prompts with answers that a reward function checks exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.tasks.arithmetic import ArithmeticTask, Problem
from rl.tasks.config import TaskConfig
from rl.tasks.protocol import MultiTurnTask, Task, TaskProblem

if TYPE_CHECKING:
    from rl.tasks.environment import EnvironmentTask

__all__ = ["ArithmeticTask", "MultiTurnTask", "Problem", "Task", "TaskConfig", "TaskProblem", "make_task"]


def make_task(config: TaskConfig, *, seed: int, model: str) -> Task:
    """The task a config names: a `Task` (rl.tasks.protocol: `sample_prompts(n, rng)`, `held_out()`,
    `reward(text, answer)`, `stop_token_ids`), and a `MultiTurnTask` (also `environment()`, a new environment per
    episode, and `transcript(problem)`) when `config.multi_turn`. Those that ask in a chat template read `model`'s
    tokenizer."""
    if config.source == "forge" and config.name == "arithmetic":
        return ArithmeticTask(seed=seed, num_digits=config.num_digits, held_out=config.held_out,
                              reverse_answer=config.reverse_answer)
    if config.source == "openenv":
        from rl.tasks.openenv import OpenEnvTask

        return OpenEnvTask(config.openenv_spec(), held_out=config.held_out)
    if config.source == "environment":
        return _environment_task(config, model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if config.source == "forge" and config.name == "lookup":
        from rl.tasks.lookup import LookupTask

        return LookupTask(seed=seed, held_out=config.held_out, tokenizer=tokenizer, num_digits=config.num_digits,
                          reverse_answer=config.reverse_answer)
    if config.source == "reasoning_gym":
        from rl.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(config.name, options=config.options, seed=seed, size=config.size,
                                held_out=config.held_out, partial_credit=config.partial_credit, tokenizer=tokenizer,
                                chat_template_kwargs=config.chat_template_kwargs)
    from rl.tasks.gsm8k import GSM8KTask  # needs `datasets`

    return GSM8KTask(config.dataset, config=config.dataset_config, train_split=config.train_split,
                     eval_split=config.eval_split, held_out=config.held_out, seed=seed, tokenizer=tokenizer,
                     chat_template_kwargs=config.chat_template_kwargs)


def _environment_task(config: TaskConfig, model: str) -> EnvironmentTask:
    """A user's environment class as a task; the model's tokenizer is read only for the class's stop texts."""
    from rl.tasks.environment import EnvironmentTask, resolve_environment, stop_texts, stop_token_ids

    factory = resolve_environment(config.name, config.options)
    ids: tuple[int, ...] = ()
    if stop_texts(factory, f"task.name={config.name!r}"):
        from transformers import AutoTokenizer

        ids = stop_token_ids(factory, AutoTokenizer.from_pretrained(model), f"task.name={config.name!r}")
    return EnvironmentTask(factory, options=config.options, held_out=config.held_out, stop_token_ids=ids)
