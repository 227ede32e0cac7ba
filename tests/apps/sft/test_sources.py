"""Where SFT examples come from (apps/sft/sources.py): a task's reference answers, and a file's rows with held-out ones
drawn out of training."""

from __future__ import annotations

import json
import random

from apps.sft.cli import load_sft_config
from apps.sft.data import Epochs, Example
from apps.sft.sources import TaskStream, load_data, reference_completion
from rl.tasks.arithmetic import ArithmeticTask
from rl.tasks.reasoning_gym import ReasoningGymTask
from rl.tiny_model import build_tokenizer

TINY = "configs/sft_tiny.yaml"


def test_a_task_example_learns_the_reference_answer_and_eos():
    tokenizer, task = build_tokenizer(), ArithmeticTask(seed=0, reverse_answer=True)
    problem = task.sample_prompts(1, random.Random(0))[0]
    example = TaskStream(task, tokenizer, seed=0).example(problem)
    prompt, answer = tokenizer.encode(problem.prompt), tokenizer.encode(problem.answer) + [tokenizer.eos_token_id]
    assert example.ids == tuple(prompt + answer)
    assert example.learned == (False,) * len(prompt) + (True,) * len(answer)


def test_a_reasoning_gym_problem_learns_its_reference_answer_tagged():
    task = ReasoningGymTask("basic_arithmetic", size=20, held_out=5, seed=0)
    problem = task.sample_prompts(1, random.Random(0))[0]
    completion = reference_completion(task, problem)
    assert completion.startswith("<answer>") and task.reward(completion, problem.answer) == 1.0


def test_the_task_stream_resumes_where_it_stopped():
    tokenizer, task = build_tokenizer(), ArithmeticTask(seed=0)
    stream = TaskStream(task, tokenizer, seed=0)
    stream.take(5)
    state = stream.state_dict()
    following = stream.take(5)
    again = TaskStream(task, tokenizer, seed=0)
    again.load_state_dict(state)
    assert again.take(5) == following


def test_a_file_source_holds_rows_out_and_serves_the_rest(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "completion": str(i)}) + "\n" for i in range(10)))
    cfg, _ = load_sft_config(["--config", TINY, "data.source=jsonl", f"data.path={path}", "data.held_out=3",
                              "eval.accuracy=false", "eval.num_prompts=2"])
    data = load_data(cfg, build_tokenizer(), max_length=256)
    assert isinstance(data.train, Epochs) and len(data.train.examples) == 7 and len(data.held_out) == 2
    held = {e.ids for e in data.held_out}
    assert not held & {e.ids for e in data.train.examples}


def test_rows_longer_than_max_length_are_left_out_and_counted(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n"
                    + json.dumps({"prompt": "1+1=" * 20, "completion": "2"}) + "\n")
    cfg, _ = load_sft_config(["--config", TINY, "data.source=jsonl", f"data.path={path}", "eval.accuracy=false"])
    data = load_data(cfg, build_tokenizer(), max_length=16)
    assert data.dropped == 1 and len(data.train.examples) == 1


def test_a_multi_turn_task_learns_its_correct_episodes_model_turns():
    from rl.tasks.lookup import LookupTask

    tokenizer = build_tokenizer()
    task = LookupTask(seed=0, held_out=10, tokenizer=tokenizer)
    problem = task.sample_prompts(1, random.Random(0))[0]
    example = TaskStream(task, tokenizer, seed=0).example(problem)
    (prompt, _), (query, _), (reply, _), (answer, _) = task.transcript(problem)
    expected_ids, expected_learned = [], []
    # By hand: the prompt and the environment's reply not learned, the model's query and answer (with EOS) learned.
    for text, learned, end in ((prompt, False, []), (query, True, []), (reply, False, []),
                               (answer, True, [tokenizer.eos_token_id])):
        piece = tokenizer.encode(text, add_special_tokens=False) + end
        expected_ids += piece
        expected_learned += [learned] * len(piece)
    assert example == Example(tuple(expected_ids), tuple(expected_learned))


def test_the_lookup_task_trains_with_its_held_out_loss(tmp_path):
    cfg, _ = load_sft_config(["--config", TINY, "data.task.name=lookup", "data.task.held_out=20",
                              "eval.accuracy=false", "eval.num_prompts=4"])
    data = load_data(cfg, build_tokenizer(), max_length=256)
    assert len(data.held_out) == 4 and all(any(e.learned) and not e.learned[0] for e in data.held_out)
