"""The lookup task (rl/tasks/lookup.py): the answer needs the environment's reply, held-out problems never train,
and its warm-start transcripts are the token sequences a rollout produces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl.environments.config import EnvironmentConfig
from rl.environments.rollout import run_episodes
from rl.tasks import TaskConfig, make_task
from rl.tasks.lookup import NAMES, LookupTask
from rl.tiny_model import build_tiny_checkpoint
from rl.types import Completion, SamplingParams
from apps.warm_start.multiturn import transcript_ids


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="module")
def task(tokenizer) -> LookupTask:
    return LookupTask(seed=0, held_out=200, tokenizer=tokenizer)


async def test_the_answer_needs_the_value_the_environment_replies(task):
    problem = task.held_out()[0]
    name = problem.prompt[-2]
    env = task.environment()
    assert await env.reset(problem) == problem.prompt
    reply = await env.step(f"{name}?")
    value = problem.values[NAMES.index(name)]
    assert (reply.observation, reply.done, reply.reward) == (f"{value};", False, 0.0)
    a = int(problem.prompt.split("+")[0])
    assert problem.answer == str(a + value)[::-1]
    final = await env.step(problem.answer)
    assert (final.done, final.reward) == (True, 1.0)
    env = task.environment()
    await env.reset(problem)
    wrong = await env.step(str(a + value + 1)[::-1])  # answering without asking: a guess, scored 0 if wrong
    assert (wrong.done, wrong.reward) == (True, 0.0)


def test_hidden_values_are_fresh_per_problem_and_held_out_problems_never_train(task):
    def pair(p):  # what decides the answer: the visible number and the hidden value asked for, under any name
        return p.prompt.split("+")[0], p.values[NAMES.index(p.prompt[-2])]

    held = {pair(p) for p in task.held_out()}
    train = task.sample_prompts(5000, random.Random(1))
    assert len(held) == 200 and not held & {pair(p) for p in train}
    by_prompt: dict[str, set[str]] = {}
    for p in train:
        by_prompt.setdefault(p.prompt, set()).add(p.answer)
    assert max(len(answers) for answers in by_prompt.values()) > 5  # one prompt, many answers: it must ask


async def test_a_transcript_is_the_token_sequence_a_rollout_of_the_same_turns_produces(task, tokenizer):
    problem = task.held_out()[3]
    ids, learned = transcript_ids(tokenizer, task.transcript(problem))
    model_turns = [tokenizer.encode(t, add_special_tokens=False) for t, by_model in task.transcript(problem) if by_model]
    model_turns[-1].append(tokenizer.eos_token_id)

    async def generate(prompts, params):
        turn = generate.turn
        generate.turn += 1
        tokens = model_turns[turn]
        return [Completion(prompt_ids=prompts[0], token_ids=tokens, text=tokenizer.decode(tokens, skip_special_tokens=True),
                           logprobs=[0.0] * len(tokens), finish_reason="stop", policy_versions=[0] * len(tokens))]

    generate.turn = 0
    (t,) = await run_episodes(generate, [task.environment()], [problem], SamplingParams(n=1, max_tokens=4),
                              EnvironmentConfig(max_turns=3, max_total_tokens=32),
                              lambda text: tokenizer.encode(text, add_special_tokens=False),
                              end_token_ids=[tokenizer.eos_token_id])
    assert (t.end, t.reward, len(t.turns)) == ("done", 1.0, 2)
    assert t.ids == ids
    assert [bool(m) for m in t.mask] == learned[len(t.prompt_ids):] and not any(learned[: len(t.prompt_ids)])


def test_the_task_is_made_by_name_and_needs_a_one_token_query(tmp_path: Path, tokenizer):
    task = make_task(TaskConfig(name="lookup", held_out=10), seed=1, model=tokenizer.name_or_path)
    assert isinstance(task, LookupTask) and task.stop_token_ids == tuple(tokenizer.encode("?", add_special_tokens=False))

    class TwoTokenQuery:
        def encode(self, text, add_special_tokens=False):
            return [5, 6]

    with pytest.raises(ValueError, match=r"tokenizer encodes '\?' as \[5, 6\]; the task needs it to be one token"):
        LookupTask(seed=0, held_out=10, tokenizer=TwoTokenQuery())
    with pytest.raises(ValueError, match=r"task.held_out=501: must be in \[1, 500\] .* num_digits=2"):
        LookupTask(seed=0, held_out=501, tokenizer=tokenizer)
