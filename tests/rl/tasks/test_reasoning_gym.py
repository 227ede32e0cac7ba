"""reasoning-gym tasks by name: disjoint training and held-out problems, the dataset's own scorer as reward."""

import random

import pytest

from rl.tasks import TaskConfig, make_task
from rl.tasks.reasoning_gym import ReasoningGymTask, tagged_answer


@pytest.fixture(scope="module")
def task():
    return ReasoningGymTask("basic_arithmetic", options={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                           "max_digits": 1}, seed=3, size=400, held_out=100)


def test_training_and_held_out_problems_never_overlap(task):
    held = task.held_out()
    train = {p.prompt for p in task.sample_prompts(2000, random.Random(0))}
    assert len(held) == 100 and train
    assert not train & {p.prompt for p in held}
    # The space of 1-digit sums is small: the two seeds do produce common questions, which were dropped.
    assert len(task._datasets["eval"]) > len(held)


def test_the_reward_is_the_datasets_own_score(task):
    problem = task.held_out()[0]
    entry = task._entries[problem.answer]
    assert task.reference_answer(problem.answer) == entry["answer"]
    right, wrong = f"<answer>{entry['answer']}</answer>", f"<answer>{int(entry['answer']) + 1}</answer>"
    assert task.reward(right, problem.answer) == 1.0
    assert task.reward(wrong, problem.answer) < 1.0
    assert task.reward(f"I think {entry['answer']}", problem.answer) < 1.0  # untagged: the whole text is scored
    assert entry["question"] in problem.prompt and problem.prompt.endswith("inside <answer></answer>.")


def test_without_partial_credit_only_a_full_score_is_rewarded():
    options = {"min_word_len": 5, "max_word_len": 5}
    partial, exact = (ReasoningGymTask("spell_backward", options=options, seed=0, size=20, held_out=5,
                                       partial_credit=credit) for credit in (True, False))
    problem = exact.held_out()[0]
    word = exact.reference_answer(problem.answer)
    one_letter_off = f"<answer>{word[:-1]}{'a' if word[-1] != 'a' else 'b'}</answer>"
    assert 0 < partial.reward(one_letter_off, problem.answer) < 1  # the dataset's scorer gives partial credit
    assert exact.reward(one_letter_off, problem.answer) == 0.0
    assert exact.reward(f"<answer>{word}</answer>", problem.answer) == 1.0


def test_tagged_answer_takes_the_last_tag_or_the_whole_text():
    assert tagged_answer("<answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert tagged_answer(" 7\n") == "7"


def test_a_task_is_chosen_by_name_from_the_config(tmp_path):
    from rl.tiny_model import ensure_tiny_checkpoint

    model = str(ensure_tiny_checkpoint(tmp_path / "tiny"))
    config = TaskConfig(source="reasoning_gym", name="basic_arithmetic", size=50, held_out=10,
                        options={"min_terms": 2, "max_terms": 3}, partial_credit=False)
    task = make_task(config, seed=0, model=model)
    assert isinstance(task, ReasoningGymTask) and len(task.held_out()) == 10 and not task.partial_credit


@pytest.mark.parametrize("name, options, message", [
    ("no_such_task", {}, r"task.name='no_such_task': not a reasoning-gym dataset"),
    ("basic_arithmetic", {"min_terms": 5, "max_terms": 2}, r"task.options=\{'min_terms': 5, 'max_terms': 2\}: "
                                                           r"reasoning-gym's 'basic_arithmetic' refuses them"),
    ("basic_arithmetic", {"no_such_option": 1}, r"task.options: BasicArithmeticDatasetConfig takes no option "
                                                r"'no_such_option'; its constructor accepts: min_terms, max_terms, "
                                                r"min_digits, max_digits, operators, allow_parentheses, "
                                                r"allow_negation, format_style, whitespace$"),
])
def test_bad_names_and_options_are_refused_naming_the_field(name, options, message):
    with pytest.raises(ValueError, match=message):
        ReasoningGymTask(name, options=options, size=10, held_out=5)


@pytest.mark.parametrize("fields, message", [
    ({"name": "basic_arithmetic"}, "name='basic_arithmetic': must be one of 'arithmetic', 'gsm8k'"),
    ({"options": {"a": 1}}, "only reasoning_gym tasks take options"),
    ({"source": "reasoning_gym", "name": "basic_arithmetic", "size": 0}, "size=0: must be >= 1"),
    ({"name": "gsm8k", "partial_credit": False}, "partial_credit=false: only a reasoning_gym task's own scorer"),
    ({"source": "reasoning_gym", "name": "basic_arithmetic", "partial_credit": False, "reward": "math:isclose"},
     r"partial_credit=false: .*reward='math:isclose'"),
])
def test_task_config_checks(fields, message):
    with pytest.raises(ValueError, match=message):
        TaskConfig(**fields)
