"""GSM8K: math-verify scores answers, and a single data file is split into disjoint training and held-out rows."""

import json
import random

import pytest

from rl.tasks.gsm8k import GSM8KTask, math_reward


@pytest.mark.parametrize("completion, answer, reward", [
    ("So she has #### 1,234", "...\n#### 1234", 1.0),
    ("#### 72 apples", "48+24=72\n#### 72", 1.0),
    ("The answer is \\boxed{0.5}", "#### 1/2", 1.0),  # LaTeX and a fraction: equal as numbers
    ("First 3, then #### 5", "#### 5", 1.0),  # only what follows the last marker counts
    ("#### 71", "#### 72", 0.0),
    ("no answer at all", "#### 3", 0.0),
    ("#### 0.3333", "#### 1/3", 0.0),  # not equal to the 6th decimal
])
def test_math_verify_scores_the_final_answer(completion, answer, reward):
    assert math_reward(completion, answer) == reward


def test_the_reward_works_off_the_main_thread():
    """The app scores rewards on threads; math-verify's own timeouts would need the main thread's signals."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(math_reward, ["#### 4", "#### 5"], ["#### 4", "#### 4"])) == [1.0, 0.0]


def test_a_single_file_is_split_into_disjoint_training_and_held_out_rows(tmp_path):
    rows = [{"question": f"What is {n} plus 1?", "answer": f"#### {n + 1}"} for n in range(40)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    task = GSM8KTask(str(path), held_out=10, seed=1)
    held = {p.prompt for p in task.held_out()}
    train = {p.prompt for p in task.sample_prompts(500, random.Random(0))}
    assert len(held) == 10 and len(train) == 30 and not held & train
    assert {p.prompt for p in GSM8KTask(str(path), held_out=10, seed=1).held_out()} == held  # seeded
    assert len({p.prompt for p in GSM8KTask(str(path), held_out=30, seed=1).held_out()}) == 20  # at most half
