import random
import re

import pytest

from rl.tasks import ArithmeticTask


def test_held_out_set_is_deterministic_and_distinct():
    held = ArithmeticTask(seed=0).held_out()
    assert len(held) == 500 and len(set(held)) == 500
    assert ArithmeticTask(seed=0).held_out() == held
    assert ArithmeticTask(seed=1).held_out() != held


def test_training_prompts_never_come_from_the_held_out_set():
    task = ArithmeticTask(seed=0, num_digits=1, held_out=50)  # half of all 100 problems held out
    held = set(task.held_out())
    train = task.sample_prompts(2000, random.Random(0))
    assert len(train) == 2000 and not held & set(train)
    assert len(set(train)) == 50  # every other problem still shows up in training
    assert train == task.sample_prompts(2000, random.Random(0))


def test_problem_format_and_answers():
    task = ArithmeticTask(seed=0, operators=("+", "-"))
    problems = task.held_out() + task.sample_prompts(200, random.Random(1))
    assert {p.prompt[-1] for p in problems} == {"="}
    for prompt, answer in problems:
        a, op, b = re.fullmatch(r"(\d{1,2})([+-])(\d{1,2})=", prompt).groups()
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert any(answer.startswith("-") for _, answer in problems)


def test_reversed_answers_are_the_same_numbers_least_significant_digit_first():
    plain = ArithmeticTask(seed=0, operators=("+", "-"))
    reversed_ = ArithmeticTask(seed=0, operators=("+", "-"), reverse_answer=True)
    pairs = list(zip(plain.held_out(), reversed_.held_out()))
    assert all(p.prompt == r.prompt for p, r in pairs)  # same problems, only the answer's digit order differs
    for p, r in pairs:
        sign = "-" if p.answer.startswith("-") else ""
        assert r.answer == sign + p.answer.lstrip("-")[::-1]
    assert any(p.answer != r.answer for p, r in pairs)


@pytest.mark.parametrize(
    "completion, reward",
    [("46", 1.0), (" 46\n", 1.0), ("46<|endoftext|>", 1.0), ("46<|endoftext|>7", 1.0), ("47", 0.0),
     ("460", 0.0), ("4 6", 0.0), ("", 0.0), ("<|endoftext|>46", 0.0), ("46=46", 0.0)],
)
def test_reward_is_exact_match_up_to_eos(completion, reward):
    assert ArithmeticTask(seed=0).reward(completion, "46") == reward


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(num_digits=0), "num_digits"), (dict(num_digits=1, held_out=51), "held_out"),
     (dict(held_out=0), "held_out"), (dict(operators=("*",)), "operators"), (dict(operators=()), "operators")],
)
def test_bad_arguments_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(seed=0, **kwargs)
