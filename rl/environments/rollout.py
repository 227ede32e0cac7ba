"""Play a group of episodes against a generator, token in / token out.

Each turn's prompt is the previous turn's exact token ids with the environment's observation appended by id
(text observations are encoded on their own, once): nothing the model produced is ever decoded and re-encoded,
so the trainer scores exactly the tokens the generator sampled. The group's active episodes go to the generator
together, one call per turn, so a group of G episodes costs what one G-sample request did.

An episode ends when its environment says done, when the model ends a turn with an end token (EOS: after the
environment has scored that turn; in chat mode the template's end-of-turn token ends the turn only), at `max_turns`
model turns or `max_total_tokens` tokens (truncated: reward `truncated_reward`), or when its environment fails: its
reset or a step raises or exceeds `step_timeout_s` (end "environment_error", counted in `env/failures` once per
episode, each kind of failure printed once). A failed episode says nothing about what the model wrote, so it is
never scored: callers drop it (`Trajectory.failed`), the other episodes of its group play on.

Chat mode (`chat`, rl.environments.chat): the first prompt and every observation are wrapped by the model's chat
template, by token ids; each turn also stops at the template's end-of-turn token.
"""

from __future__ import annotations

import asyncio
import sys
import traceback
from dataclasses import replace
from typing import Any, Awaitable, Callable, Sequence

from rl.environments.chat import ChatTemplate
from rl.environments.config import EnvironmentConfig
from rl.environments.protocol import Environment, Observation, StepResult
from rl.environments.threads import EnvironmentsBlocked
from rl.environments.trajectory import Trajectory
from forge.metrics import record_metric
from rl.types import Completion, SamplingParams

# (prompts as token ids, params with n=1) -> one completion per prompt
Generate = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]


async def run_episodes(generate: Generate, environments: Sequence[Environment], problems: Sequence[Any],
                       params: SamplingParams, limits: EnvironmentConfig, encode: Callable[[str], list[int]],
                       end_token_ids: Sequence[int] = (), chat: ChatTemplate | None = None) -> list[Trajectory]:
    """One trajectory per environment, the i-th playing `problems[i]` (a GRPO group: the same problem G times), all
    played at once; `params.max_tokens` bounds each model turn. With `chat`, turns are wrapped by its template (text
    observations; `encode` is then unused) and its end-of-turn token ends a turn, never the episode."""
    if len(problems) != len(environments):
        raise ValueError(f"run_episodes: {len(environments)} environments but {len(problems)} problems; one problem "
                         "each")
    if chat is not None and chat.end_of_turn_id is not None:
        end_token_ids = [t for t in end_token_ids if t != chat.end_of_turn_id]
        if chat.end_of_turn_id not in params.stop_token_ids:
            params = replace(params, stop_token_ids=[*params.stop_token_ids, chat.end_of_turn_id])
    trajectories: list[Trajectory] = []
    try:
        trajectories = await _play(generate, environments, problems, params, limits, encode, end_token_ids, chat)
    finally:  # an episode ends in many ways; each environment is closed once whichever it was
        # A failure counts once per episode: closing an environment whose step already failed (a host still blocked
        # in the step that timed out, or one that crashed) fails too, and is not a second failure.
        closing = [i for i, env in enumerate(environments) if hasattr(env, "close")]
        await _call_all([environments[i].close() for i in closing], limits, "close",
                        counted=[i < len(trajectories) and trajectories[i].end != "environment_error" for i in closing])
    _count(trajectories, limits)
    return trajectories


async def _play(generate: Generate, environments: Sequence[Environment], problems: Sequence[Any],
                params: SamplingParams, limits: EnvironmentConfig, encode: Callable[[str], list[int]],
                end_token_ids: Sequence[int], chat: ChatTemplate | None) -> list[Trajectory]:
    prompts = await _call_all([env.reset(problem) for env, problem in zip(environments, problems)], limits, "reset")
    trajectories = [_failed(Trajectory(prompt_ids=[]), prompt) if isinstance(prompt, BaseException)
                    else Trajectory(prompt_ids=chat.first_prompt(prompt) if chat else _ids(prompt, encode))
                    for prompt in prompts]
    while active := [i for i, t in enumerate(trajectories) if t.end == "running"]:
        completions = await _model_turns(generate, [trajectories[i] for i in active], params, limits)
        stepping = []
        for i, completion in zip(active, completions):
            t = trajectories[i]
            if completion is None:
                t.end = "max_total_tokens"
                continue
            t.add_model_turn(completion)
            if completion.finish_reason == "length" and len(t.ids) >= limits.max_total_tokens:
                t.end = "max_total_tokens"
            else:
                stepping.append(i)
        results = await _call_all([environments[i].step(trajectories[i].actions[-1]) for i in stepping], limits,
                                  "step")
        for i, result in zip(stepping, results):
            _advance(trajectories[i], result, limits, encode, end_token_ids, chat)
    return trajectories


async def _model_turns(generate: Generate, trajectories: list[Trajectory], params: SamplingParams,
                       limits: EnvironmentConfig) -> list[Completion | None]:
    """The next model turn of each trajectory (None: no token budget left), one generate call per distinct budget."""
    budgets = [min(params.max_tokens, limits.max_total_tokens - len(t.ids)) for t in trajectories]
    out: list[Completion | None] = [None] * len(trajectories)
    calls = {}
    for budget in sorted({b for b in budgets if b > 0}):
        rows = [i for i, b in enumerate(budgets) if b == budget]
        calls[budget] = (rows, generate([trajectories[i].ids for i in rows], replace(params, n=1, max_tokens=budget)))
    for rows, completions in zip([r for r, _ in calls.values()], await asyncio.gather(*(c for _, c in calls.values()))):
        for i, completion in zip(rows, completions):
            out[i] = completion
    return out


def _advance(t: Trajectory, result: StepResult | BaseException, limits: EnvironmentConfig,
             encode: Callable[[str], list[int]], end_token_ids: Sequence[int], chat: ChatTemplate | None) -> None:
    if isinstance(result, BaseException):
        _failed(t, result)
        return
    t.reward += float(result.reward)
    start, end = t.turns[-1]
    last_token = t.completion_ids[end - 1] if end > start else None  # the turn's own; an empty turn has none
    if result.done or last_token in end_token_ids:
        t.end = "done"
    elif len(t.turns) >= limits.max_turns:
        t.end = "max_turns"
    else:
        observation = chat.after_turn(result.observation, last_token) if chat else _ids(result.observation, encode)
        if len(t.ids) + len(observation) >= limits.max_total_tokens:
            t.end = "max_total_tokens"  # no room left for a model token after it
        else:
            t.add_observation(observation)


def _failed(t: Trajectory, error: BaseException) -> Trajectory:
    t.end, t.error, t.reward = "environment_error", f"{type(error).__name__}: {error}", 0.0
    return t


_reported: set[str] = set()


async def _call_all(calls: list[Awaitable[Any]], limits: EnvironmentConfig, what: str,
                    counted: Sequence[bool] | None = None) -> list[Any]:
    """Each environment call's result, or the exception it raised or timed out with (printed once per kind; counted in
    env/failures where `counted` says so, default all). The calls run at once under one deadline: one timer per
    turn rather than one per call, and a call that ignores its cancellation is left behind, never waited for."""
    if not calls:
        return []
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        _, late = await asyncio.wait(tasks, timeout=limits.step_timeout_s)
    except asyncio.CancelledError:  # the episode is cancelled (the job stops): so are its environment calls
        for task in tasks:
            task.cancel()
        raise
    for task in late:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" warning
    results = []
    for i, task in enumerate(tasks):
        if task in late:
            error = TimeoutError(f"environment {what} took longer than step_timeout_s={limits.step_timeout_s}")
        elif isinstance(task.exception(), EnvironmentsBlocked):
            raise task.exception()  # the process cannot start environments any more: not one episode's failure
        elif task.exception() is not None:
            error = task.exception()
        else:
            results.append(task.result())
            continue
        kind = f"{what}: {type(error).__name__}"
        if kind not in _reported:
            _reported.add(kind)
            print(f"environment {what} failed (shown once per kind; counted in env/failures):\n"
                  + "".join(traceback.format_exception(error)), file=sys.stderr, flush=True)
        if counted is None or counted[i]:
            record_metric("env/failures", 1, "sum")
        results.append(error)
    return results


def _ids(observation: Observation, encode: Callable[[str], list[int]]) -> list[int]:
    return encode(observation) if isinstance(observation, str) else list(observation)


def _count(trajectories: list[Trajectory], limits: EnvironmentConfig) -> None:
    for t in trajectories:
        if t.truncated and limits.truncated_reward is not None:
            t.reward = limits.truncated_reward
    record_metric("env/truncated", sum(t.truncated for t in trajectories), "sum")
    record_metric("env/model_turns", sum(len(t.turns) for t in trajectories) / len(trajectories))
