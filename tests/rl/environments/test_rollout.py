"""The multi-turn rollout (rl.environments.rollout): token-exact turns, the loss mask, stop conditions, and
environment failures counted, not fatal."""

from __future__ import annotations

import asyncio

import pytest

from rl.environments.config import EnvironmentConfig
from rl.environments.protocol import StepResult
from rl.environments.rollout import run_episodes
from forge.metrics import drain_local
from rl.types import Completion, SamplingParams

pytestmark = pytest.mark.timed  # wall-clock bounds: `make test` runs it at full priority (tests/suite.py)

EOS = 1


def encode(text: str) -> list[int]:
    return [100 + ord(c) for c in text]  # distinct from every id the fake model writes


class ScriptedModel:
    """Writes `turns[k]` on its k-th turn of an episode (the episode told apart by its prompt's first token); records
    every prompt and budget it was given."""

    def __init__(self, turns: list[list[int]], version: int = 7) -> None:
        self.turns, self.version, self.calls = turns, version, []

    async def __call__(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.calls.append(([list(p) for p in prompts], params.max_tokens))
        out = []
        for prompt in prompts:
            turn = sum(1 for p, _ in self.calls for q in p if q[0] == prompt[0]) - 1
            tokens = self.turns[min(turn, len(self.turns) - 1)][: params.max_tokens]
            out.append(Completion(prompt_ids=list(prompt), token_ids=tokens, text="".join(chr(48 + t) for t in tokens),
                                  logprobs=[-0.5 - i for i in range(len(tokens))], finish_reason="stop",
                                  policy_versions=[self.version] * len(tokens)))
        return out


class Replier:
    """Replies `reply` to every turn; done (reward 1) after `done_after` turns; may raise or hang on a turn."""

    def __init__(self, reply: str = "ok", done_after: int = 99, fail_on: int | None = None,
                 hang_on: int | None = None) -> None:
        self.reply, self.done_after, self.fail_on, self.hang_on = reply, done_after, fail_on, hang_on
        self.actions: list[str] = []

    async def reset(self, task) -> list[int]:
        return list(task)

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        if len(self.actions) == self.fail_on:
            raise RuntimeError("tool crashed")
        if len(self.actions) == self.hang_on:
            await asyncio.sleep(60)
        done = len(self.actions) >= self.done_after
        return StepResult(observation=self.reply, reward=1.0 if done else 0.25, done=done)


def limits(**overrides) -> EnvironmentConfig:
    return EnvironmentConfig(**{"max_turns": 4, "max_total_tokens": 64, "step_timeout_s": 5.0, **overrides})


async def play(model, envs, **overrides):
    params = SamplingParams(n=1, max_tokens=3, temperature=1.0)
    return await run_episodes(model, envs, [[10 + i, 11] for i in range(len(envs))], params, limits(**overrides), encode,
                              end_token_ids=[EOS])


async def test_each_turn_continues_the_exact_ids_and_only_model_tokens_are_trained():
    model, env = ScriptedModel([[20, 21], [22, 23, 24], [25]]), Replier(reply="ab", done_after=2)
    drain_local()
    (t,) = await play(model, [env])
    ab = encode("ab")
    assert t.prompt_ids == [10, 11]
    assert t.completion_ids == [20, 21, *ab, 22, 23, 24]
    assert t.mask == [1, 1, 0, 0, 1, 1, 1]
    assert t.logprobs == [-0.5, -1.5, 0.0, 0.0, -0.5, -1.5, -2.5]
    assert t.versions == [7, 7, -1, -1, 7, 7, 7]
    assert t.turns == [(0, 2), (4, 7)]
    # The second turn's prompt is the first turn's ids plus the observation's ids: nothing re-encoded.
    assert [p for p, _ in model.calls] == [[[10, 11]], [[10, 11, 20, 21, *ab]]]
    assert (t.end, t.truncated, t.reward) == ("done", False, 1.25)
    assert env.actions == ["DE", "FGH"]
    episode = t.to_episode(episode_id=1, group_id=2, reward=t.reward, advantage=0.5)
    assert episode.completion_mask == t.mask and episode.oldest_policy_version == 7
    assert drain_local()["env/model_turns"].value() == 2


async def test_max_turns_truncates_and_the_config_sets_the_reward():
    (t,) = await play(ScriptedModel([[20]]), [Replier()], max_turns=3, truncated_reward=-1.0)
    assert (t.end, t.truncated, len(t.turns), t.reward) == ("max_turns", True, 3, -1.0)
    (kept,) = await play(ScriptedModel([[20]]), [Replier()], max_turns=3, truncated_reward=None)
    assert kept.reward == 0.75  # what the environment gave: 3 x 0.25
    drain_local()


async def test_max_total_tokens_bounds_each_turn_and_the_episode():
    model = ScriptedModel([[20, 21, 22]])
    (t,) = await play(model, [Replier(reply="x")], max_total_tokens=10)
    # 2 prompt + 3 model + 1 env + 3 model + 1 env = 10: no room left for a model token.
    assert (t.end, len(t.ids)) == ("max_total_tokens", 9) and t.truncated
    (t,) = await play(model, [Replier(reply="")], max_total_tokens=7)
    assert model.calls[-1][1] == 2  # the last turn's budget: the window left, not max_tokens
    assert (t.end, len(t.ids)) == ("max_total_tokens", 7)
    drain_local()


async def test_an_end_token_ends_the_episode_after_the_environment_scores_the_turn():
    env = Replier(done_after=99)
    (t,) = await play(ScriptedModel([[20], [21, EOS]]), [env])
    assert (t.end, len(t.turns), len(env.actions), t.reward) == ("done", 2, 2, 0.5)


async def test_a_failing_or_hanging_environment_costs_its_episode_only_and_is_counted():
    drain_local()
    healthy, crashing, hanging = Replier(done_after=2), Replier(fail_on=1), Replier(hang_on=2)
    ok, crashed, hung = await play(ScriptedModel([[20]]), [healthy, crashing, hanging], step_timeout_s=0.5)
    assert (ok.end, ok.reward) == ("done", 1.25)
    assert (crashed.end, crashed.reward) == ("environment_error", 0.0) and "tool crashed" in crashed.error
    assert (hung.end, hung.reward) == ("environment_error", 0.0) and "step_timeout_s=0.5" in hung.error
    assert drain_local()["env/failures"].value() == 2


async def test_a_failed_reset_fails_its_episode_only_and_failed_episodes_are_marked_so():
    class BrokenReset(Replier):
        async def reset(self, task):
            raise ValueError("no such problem")

    drain_local()
    ok, broken = await play(ScriptedModel([[20]]), [Replier(done_after=1), BrokenReset()])
    assert (ok.end, ok.failed, ok.reward) == ("done", False, 1.0)
    assert (broken.end, broken.failed, broken.turns) == ("environment_error", True, [])
    assert "ValueError: no such problem" in broken.error
    assert drain_local()["env/failures"].value() == 1


def test_limits_are_checked():
    with pytest.raises(ValueError, match=r"max_turns=0: must be >= 1"):
        EnvironmentConfig(max_turns=0)
    with pytest.raises(ValueError, match=r"step_timeout_s=0: must be > 0"):
        EnvironmentConfig(step_timeout_s=0)


class ClosingReplier(Replier):
    """A Replier that counts its `close` calls."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


async def test_every_environment_is_closed_once_however_its_episode_ended():
    # done at turn 1; cut at max_turns; its step raising; the model's EOS on its second turn
    envs = [ClosingReplier(done_after=1), ClosingReplier(), ClosingReplier(fail_on=1)]
    trajectories = await play(ScriptedModel([[5, 6]]), envs, max_turns=2)
    eos = ClosingReplier()
    [ended_at_eos] = await play(ScriptedModel([[5, 6], [5, EOS]]), [eos])
    assert [t.end for t in trajectories] + [ended_at_eos.end] == ["done", "max_turns", "environment_error", "done"]
    assert [env.closed for env in [*envs, eos]] == [1, 1, 1, 1]
    drain_local()


async def test_environments_are_closed_when_a_reset_fails():
    class FailingReset(ClosingReplier):
        async def reset(self, task):
            raise RuntimeError("no sandbox")

    envs = [ClosingReplier(done_after=1), FailingReset()]
    played = await play(ScriptedModel([[5]]), envs)
    assert [t.end for t in played] == ["done", "environment_error"]
    assert [env.closed for env in envs] == [1, 1]
    drain_local()


async def test_a_failure_counts_once_per_episode_even_when_its_close_fails_too():
    class FailingClose(ClosingReplier):
        async def close(self) -> None:
            await super().close()
            raise RuntimeError("sandbox already gone")

    # a step that raised, then a close that raised: one failure; a played episode whose close raised: one more
    envs = [FailingClose(fail_on=1), FailingClose(done_after=1), ClosingReplier(done_after=1)]
    drain_local()
    trajectories = await play(ScriptedModel([[5]]), envs)
    assert [t.end for t in trajectories] == ["environment_error", "done", "done"]
    assert [env.closed for env in envs] == [1, 1, 1]
    assert drain_local()["env/failures"].value() == 2
