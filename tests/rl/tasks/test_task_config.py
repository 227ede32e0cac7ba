"""The `task` section's checks that need the task's own rules (rl/tasks/config.py): made when the config is read,
before anything starts, each naming the field and what is allowed."""

from __future__ import annotations

import pytest

from rl.tasks import TaskConfig


def score_two(completion_text: str, answer: str) -> float:
    return float(completion_text == answer)


def score_one(completion_text: str) -> float:
    return 0.0


@pytest.mark.parametrize("fields, message", [
    ({"name": "lookup", "held_out": 501}, r"held_out=501: must be at most 500 for the lookup task with num_digits=2"),
    ({"name": "arithmetic", "num_digits": 1, "held_out": 51},
     r"held_out=51: must be at most 50 for the arithmetic task with num_digits=1"),
    ({"source": "reasoning_gym", "name": "basic_arithmetic", "options": {"min_termz": 2}},
     r"options: BasicArithmeticDatasetConfig takes no option 'min_termz'; its constructor accepts: min_terms, "),
    ({"source": "reasoning_gym", "name": "basic_arithmetic", "options": {"min_terms": 0}},
     r"options=\{'min_terms': 0\}: reasoning-gym's 'basic_arithmetic' refuses them \(AssertionError: min_terms must "
     r"be positive\)"),
    ({"source": "reasoning_gym", "name": "basic_arithmetic", "options": {"seed": 3}},
     r"options: 'seed' is set by forge"),
    ({"source": "reasoning_gym", "name": "basic_arithmetc"}, r"name='basic_arithmetc': not a reasoning-gym dataset"),
    ({"reward": f"{__name__}:score_one"}, r"reward='.*:score_one': must take \(completion_text, answer\)"),
    ({"reward": "no_such_reward_module:score"}, r"reward='no_such_reward_module:score': cannot import module "
                                                r"'no_such_reward_module' .*PYTHONPATH"),
])
def test_a_task_the_job_would_refuse_later_is_refused_when_the_config_is_read(fields, message):
    with pytest.raises(ValueError, match=message):
        TaskConfig(**fields)


def test_tasks_within_the_limits_are_accepted():
    TaskConfig(name="lookup", held_out=500)
    TaskConfig(name="arithmetic", num_digits=1, held_out=50)
    TaskConfig(source="reasoning_gym", name="basic_arithmetic", options={"min_terms": 2, "max_terms": 3})
    TaskConfig(reward=f"{__name__}:score_two")


def test_a_multi_turn_task_takes_no_reward_function():
    """The lookup task's environment scores its episodes: a reward function named for it would never run."""
    with pytest.raises(ValueError, match=r"reward='m:f': a forge/lookup task is multi-turn; its environment scores"):
        TaskConfig(source="forge", name="lookup", reward="m:f")
