"""A user's environment class written to forge's own protocol, named in the config (`task.source: environment`,
rl/tasks/environment.py), and the config-time checks of every environment class's name and options."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl.environments.config import EnvironmentConfig
from rl.environments.rollout import run_episodes
from rl.tasks import TaskConfig, make_task
from rl.tasks.environment import EnvironmentTask, SeededProblem
from rl.tiny_model import build_tiny_checkpoint
from rl.types import Completion, SamplingParams

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"  # docs/environments.md's module
CLASSES = "tests.rl.tasks.environment_classes"
GUESS = "tests.rl.environments.openenv_guess:GuessEnvironment"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
def lookup_env_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/examples on the path, as the page's PYTHONPATH puts it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def lookup_task(tokenizer, held_out: int = 8, **options) -> EnvironmentTask:
    config = TaskConfig(source="environment", name="lookup_env:LookupEnv", options=options, held_out=held_out)
    return make_task(config, seed=0, model=tokenizer.name_or_path)


async def test_an_environment_class_named_in_the_config_plays_episodes_drawn_from_their_seeds(lookup_env_on_path,
                                                                                             tokenizer):
    task = lookup_task(tokenizer, digits=1)
    assert isinstance(task, EnvironmentTask)
    assert task.stop_token_ids == tuple(tokenizer.encode("?", add_special_tokens=False))  # its stop_texts, as ids
    problem = task.held_out()[3]
    assert problem.seed == 3
    env = task.environment()
    assert env.digits == 1  # task.options reached the constructor
    prompt = await env.reset(problem)
    number, name = int(prompt[:-3]), prompt[-2]
    assert prompt == f"{number}+{name}=" and number < 10
    reply = await env.step(f"{name}?")
    assert (reply.done, reply.reward) == (False, 0.0)
    answer = str(number + int(reply.observation.rstrip(";")))
    final = await env.step(answer)
    assert (final.done, final.reward) == (True, 1.0)
    again = task.environment()
    assert await again.reset(problem) == prompt  # the same seed, the same episode


def test_training_episodes_never_use_a_held_out_seed(lookup_env_on_path, tokenizer):
    task = lookup_task(tokenizer, held_out=50)
    held = {p.seed for p in task.held_out()}
    train = {p.seed for p in task.sample_prompts(5000, random.Random(1))}
    assert held == set(range(50)) and len(train) > 4000 and not held & train


async def test_episodes_through_the_rollout_are_scored_by_the_environment(lookup_env_on_path, tokenizer):
    """In-process: the rollout plays the class's environments; a correct two-turn episode scores 1."""
    task = lookup_task(tokenizer)
    problem = task.held_out()[0]
    scout = task.environment()
    prompt = await scout.reset(problem)
    name = prompt[-2]
    value = int((await scout.step(f"{name}?")).observation.rstrip(";"))
    turns = [tokenizer.encode(text, add_special_tokens=False)
             for text in (f"{name}?", str(int(prompt[:-3]) + value))]
    turns[-1].append(tokenizer.eos_token_id)

    async def generate(prompts, params):
        assert params.stop_token_ids == list(task.stop_token_ids)
        tokens = turns[generate.turn]
        generate.turn += 1
        return [Completion(prompt_ids=prompts[0], token_ids=tokens, text=tokenizer.decode(tokens, skip_special_tokens=True),
                           logprobs=[0.0] * len(tokens), finish_reason="stop", policy_versions=[0] * len(tokens))]

    generate.turn = 0
    (t,) = await run_episodes(generate, [task.environment()], [problem],
                              SamplingParams(n=1, max_tokens=4, stop_token_ids=list(task.stop_token_ids)),
                              EnvironmentConfig(max_turns=3, max_total_tokens=32),
                              lambda text: tokenizer.encode(text, add_special_tokens=False),
                              end_token_ids=[tokenizer.eos_token_id])
    assert (t.end, t.reward, t.actions[0]) == ("done", 1.0, f"{name}?")


def test_the_environment_factory_pickles_for_an_isolated_host(lookup_env_on_path, tokenizer):
    """environment.isolated ships `task.environment` to the environment host's process: the class goes by reference
    (its module must import there too: docs/environments.md), the options by value."""
    task = lookup_task(tokenizer, digits=3)
    factory = pickle.loads(pickle.dumps(task.environment))
    env = factory()
    assert type(env).__name__ == "LookupEnv" and env.digits == 3


def test_a_class_without_stop_texts_reads_no_tokenizer():
    task = make_task(TaskConfig(source="environment", name=f"{CLASSES}:Good", held_out=4), seed=0,
                     model="unused: no stop texts, no tokenizer")
    assert task.stop_token_ids == () and task.held_out()[1] == SeededProblem(1, "Good reset(seed=1)", " 1")


def test_a_stop_text_of_several_tokens_is_refused_naming_it(tokenizer):
    with pytest.raises(ValueError, match=r"TwoTokenStopText.stop_texts has 'c\?', which the model's tokenizer encodes "
                                         r"as 2 tokens"):
        make_task(TaskConfig(source="environment", name=f"{CLASSES}:TwoTokenStopText"), seed=0,
                  model=tokenizer.name_or_path)


@pytest.mark.parametrize("name, options, message", [
    ("no_such_env_module:Env", {}, r"name='no_such_env_module:Env': cannot import module 'no_such_env_module' .*the "
                                   r"module must be importable from the job's working directory or PYTHONPATH"),
    ("tests.rl.tasks.broken_environment_module:Env", {},
     r"importing module 'tests.rl.tasks.broken_environment_module' failed: No module named "
     r"'no_such_dependency_of_the_environment'"),
    (f"{CLASSES}:Missing", {}, r"has no callable 'Missing'"),
    (f"{CLASSES}:not_a_class", {}, r"must name a class implementing forge's Environment protocol"),
    (f"{CLASSES}:SyncStep", {}, r"SyncStep.step must be `async def step\(self, action\)` \(a coroutine\)"),
    (f"{CLASSES}:NoStep", {}, r"NoStep has no step; forge's Environment protocol needs `async def step"),
    (f"{CLASSES}:StepWithoutAction", {}, r"StepWithoutAction.step must take one argument after self"),
    (f"{CLASSES}:SyncClose", {}, r"SyncClose.close must be `async def close\(self\)`"),
    (f"{CLASSES}:StopTextsNotATuple", {}, r"StopTextsNotATuple.stop_texts='\?': must be a tuple of non-empty strings"),
    (f"{CLASSES}:Good", {"tries": 3}, r"options: Good takes no option 'tries'; its constructor accepts: none"),
    (f"{CLASSES}:RequiredOption", {"triez": 3, "size": 1},
     r"options: RequiredOption takes no option 'triez'; its constructor accepts: size, tries"),
    (f"{CLASSES}:RequiredOption", {"tries": 3}, r"options: RequiredOption's constructor requires 'size'; add it to "
                                                r"options"),
    (GUESS, {}, r"GuessEnvironment.reset must be `async def reset\(self, problem\)` \(a coroutine\); an OpenEnv "
                r"environment .* task.source: openenv"),
])
def test_a_bad_environment_class_or_option_is_a_config_error_naming_it(name, options, message):
    with pytest.raises(ValueError, match=message):
        TaskConfig(source="environment", name=name, options=options)


def test_options_go_through_a_constructor_that_takes_any():
    TaskConfig(source="environment", name=f"{CLASSES}:AnyOption", options={"anything": 1})
    TaskConfig(source="environment", name=f"{CLASSES}:RequiredOption", options={"size": 2})


def test_a_misspelled_openenv_option_is_a_config_error_naming_it_and_the_accepted_ones():
    with pytest.raises(ValueError, match=r"options: GuessEnvironment takes no option 'triess'; its constructor "
                                         r"accepts: tries"):
        TaskConfig(source="openenv", name=GUESS, options={"triess": 3})
    TaskConfig(source="openenv", name=GUESS, options={"tries": 3})
    with pytest.raises(ValueError, match=r"options: GuessClient's constructor requires 'base_url'; add it to options"):
        TaskConfig(source="openenv", name="tests.rl.environments.openenv_guess:GuessClient")  # a served one's client


def test_a_warm_start_is_refused_naming_the_field():
    task = make_task(TaskConfig(source="environment", name=f"{CLASSES}:Good", held_out=4), seed=0, model="unused")
    with pytest.raises(ValueError, match="warm_start.enabled=true: task.source='environment' .*set warm_start.enabled"):
        task.transcript(task.held_out()[0])
