"""OpenEnv environments through forge's adapter (rl/environments/openenv.py, rl/tasks/openenv.py): an
environment written against OpenEnv's own classes (openenv_guess.py) plays forge episodes unchanged, token-exact,
named from a config; apps.grpo trains on it."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from actors.engines.hf import HFEngine
from rl.environments.config import EnvironmentConfig
from rl.environments.rollout import run_episodes
from forge.provisioner import free_port
from rl.tasks import TaskConfig, make_task
from rl.tiny_model import build_tiny_checkpoint
from rl.types import SamplingParams, TrainBatch

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

ROOT = Path(__file__).resolve().parents[3]
GUESS = "tests.rl.environments.openenv_guess:GuessEnvironment"
TWO_TEXT = "tests.rl.environments.openenv_guess:TwoTextEnvironment"
CLIENT = "tests.rl.environments.openenv_guess:GuessClient"


def guess_task(tries: int = 3, held_out: int = 16):
    return make_task(TaskConfig(source="openenv", name=GUESS, options={"tries": tries}, held_out=held_out),
                     seed=0, model="unused: an OpenEnv task reads no tokenizer")


async def test_text_becomes_the_action_and_the_observation_text_reward_done_come_back():
    task = guess_task(tries=3)
    problem = task.held_out()[5]
    secret = random.Random(problem.seed).randint(0, 9)  # what GuessEnvironment hides for this seed
    env = task.environment()
    assert await env.reset(problem) == "guess 0-9:"
    wrong = str((secret + 1) % 10)
    miss = await env.step(wrong)
    assert (miss.observation, miss.reward, miss.done) == ("up;" if int(wrong) < secret else "down;", 0.0, False)
    assert miss.info == {"solved": False}  # the Observation's metadata
    hit = await env.step(f"{secret}<|endoftext|>")  # the guess field gets the turn's text as the model wrote it
    assert (hit.reward, hit.done, hit.info) == (1.0, True, {"solved": True})


async def test_action_field_picks_among_several_text_fields():
    task = make_task(TaskConfig(source="openenv", name=TWO_TEXT, action_field="command"), seed=0, model="unused")
    env = task.environment()
    assert await env.reset(task.held_out()[2]) == "seed 2"
    result = await env.step("go")
    assert (result.observation, result.reward, result.done) == ("GO", 0.5, True)


@pytest.fixture
def guess_server():
    """GuessEnvironment served by OpenEnv's own server (a thread on loopback), stopped after the test."""
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    from tests.rl.environments.openenv_guess import GuessAction, GuessEnvironment, GuessObservation

    app = create_fastapi_app(lambda: GuessEnvironment(tries=3), GuessAction, GuessObservation, max_concurrent_envs=4)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


async def test_a_served_environment_plays_through_its_openenv_client_like_the_in_process_one(guess_server):
    served = make_task(TaskConfig(source="openenv", name=CLIENT, options={"base_url": guess_server}), seed=0,
                       model="unused")
    local = guess_task(tries=3)
    problems = served.held_out()[:4]

    async def play(task, problem, guesses):
        env = task.environment()
        seen = [await env.reset(problem)]
        for guess in guesses:
            result = await env.step(guess)
            seen.append((result.observation, result.reward, result.done))
            if result.done:
                break
        await env.close()  # the rollout closes every episode's environment; here the test does
        return seen

    secrets_ = [random.Random(p.seed).randint(0, 9) for p in problems]
    scripts = [[str((s + 1) % 10), str(s)] if i % 2 else [str((s + k) % 10) for k in (1, 2, 3)]
               for i, s in enumerate(secrets_)]
    remote = await asyncio.gather(*(play(served, p, g) for p, g in zip(problems, scripts)))  # 4 sessions at once
    assert remote == [await play(local, p, g) for p, g in zip(problems, scripts)]
    assert [r[-1][1:] for r in remote] == [(0.0, True), (1.0, True), (0.0, True), (1.0, True)]


@pytest.mark.parametrize("overrides, message", [
    ({"name": "no_such_module_x:Env"}, "task.name='no_such_module_x:Env': cannot import module"),
    ({"name": "tests.rl.environments.openenv_guess:GuessAction"}, "must name an OpenEnv environment"),
    ({"name": "tests.rl.environments.openenv_guess"}, "must be 'package.module:function'"),
    ({"name": TWO_TEXT}, "task.action_field=None: TwoTextAction has 2 str fields (['command', 'note'])"),
    ({"name": GUESS, "action_field": "answer"}, "task.action_field='answer': GuessAction has no field 'answer'"),
    ({"name": GUESS, "observation_field": "hint"}, "task.observation_field='hint': GuessObservation has no field"),
    ({"name": GUESS, "reward": "m:f"}, "reward='m:f': a openenv/"),
    ({"source": "forge", "name": "arithmetic", "action_field": "guess"}, "only openenv tasks take them"),
])
def test_config_errors_name_the_field_before_anything_starts(overrides, message):
    with pytest.raises(ValueError) as error:
        TaskConfig(**{"source": "openenv", **overrides})
    assert message in str(error.value)


def test_a_multi_turn_warm_start_is_refused_naming_the_field():
    task = guess_task()
    with pytest.raises(ValueError, match="warm_start.enabled=true: task.source='openenv'.*set warm_start.enabled: false"):
        task.transcript(task.held_out()[0])  # apps.warm_start.multiturn's first call, before any process starts


def test_training_episodes_never_reset_with_a_held_out_seed():
    task = guess_task(held_out=50)
    held = {p.seed for p in task.held_out()}
    train = {p.seed for p in task.sample_prompts(5000, random.Random(1))}
    assert held == set(range(50)) and len(train) > 4000 and not held & train


async def test_episodes_through_a_real_engine_are_token_exact_and_scored_by_the_environment(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    engine = HFEngine(checkpoint, seed=3)

    async def generate(prompts, params):
        return [out[0] for out in engine.generate(prompts, params)]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    task = guess_task(tries=3)
    problems = task.sample_prompts(8, random.Random(0))
    trajectories = await run_episodes(generate, [task.environment() for _ in problems], problems,
                                      SamplingParams(n=1, max_tokens=1, temperature=1.0),
                                      EnvironmentConfig(max_turns=5, max_total_tokens=64), encode,
                                      end_token_ids=[tokenizer.eos_token_id])
    assert any(len(t.turns) > 1 for t in trajectories)  # several turns, the environment's hints between them
    for t, problem in zip(trajectories, problems):
        secret = random.Random(problem.seed).randint(0, 9)
        assert t.prompt_ids == encode("guess 0-9:")
        # Rebuild the sequence from the model's turns and the environment's rules: the hints went in by id,
        # the model's tokens as sampled, nothing re-tokenized.
        expected, mask = [], []
        for k, (start, end) in enumerate(t.turns):
            expected += t.completion_ids[start:end]
            mask += [1] * (end - start)
            guess = t.actions[k].strip()[:1]
            if k + 1 < len(t.turns):
                hint = encode("up;" if guess.isdigit() and int(guess) < secret else "down;")
                expected += hint
                mask += [0] * len(hint)
        assert t.completion_ids == expected and t.mask == mask
        solved = any(a.strip()[:1] == str(secret) for a in t.actions)
        assert t.reward == (1.0 if solved else 0.0)
        assert t.end in ("done", "max_turns")
    episodes = [t.to_episode(episode_id=i, group_id=0, reward=t.reward) for i, t in enumerate(trajectories)]
    batch = TrainBatch.from_episodes(episodes, pad_id=tokenizer.pad_token_id)
    for row, t in enumerate(trajectories):
        assert batch.input_ids[row, : len(t.ids)].tolist() == t.ids
        assert batch.response_mask[row].sum() == sum(t.mask)
    assert (batch.policy_versions[batch.response_mask.bool()] >= 0).all()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_trains_on_an_openenv_environment_named_in_the_config(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "apps.grpo", "--config", "configs/multiturn_tiny.yaml", f"run_dir={run_dir}",
               f"model_cache={tmp_path / 'cache'}", "steps=2", "task.source=openenv", f"task.name={GUESS}",
               "task.options={tries: 3}", "task.held_out=16", "warm_start.enabled=false",
               "eval.num_prompts=16", "rollout.group_size=8", "rollout.max_tokens=1", "rollout.concurrency=4",
               "replay_buffer.batch_size=32", "trainer.micro_batch_size=32", "trainer.minibatches=1",
               "checkpoint.interval=0", "checkpoint.final=false", "canary.every=1",
               "environment.isolated=true"]  # the OpenEnv environments in their own process
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    turns = [r["env/model_turns"] for r in rows if "env/model_turns" in r]  # steps that drained a rollout's metrics
    assert turns and min(turns) > 1 and not any(r.get("env/failures") for r in rows)
    assert all(r["canary/logprob_diff"] < 1e-3 for r in rows)  # the canary scores the OpenEnv problem's label
    assert "held-out greedy mean reward" in result.stdout  # an OpenEnv environment's rewards may be partial
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes"]["trained"] == 2 * 32
