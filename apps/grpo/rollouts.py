"""How the GRPO job plays a group and evaluates, for a single-turn task and for a multi-turn one.

Both have `group(problem, params, version) -> (samples, rewards, environment_failures)`,
`evaluate(problems, params) -> rewards` and `to_episodes(samples, ...)` (the group packed for the buffer).
Single-turn: one completion per episode, scored by the task's reward (or the user's). Multi-turn (a task with
`environment()`): G episodes of one problem, played against the task's environments (rl.environments), token in /
token out, scored by the environments. An episode whose environment failed is not the model's doing: its group is
dropped by the job (`environment_failures` says how many failed) and an evaluation leaves it out of its mean (None);
it is never scored 0. A multi-turn
group's turns all go to one generator replica (a service session), so each turn continues a sequence that replica has
just generated. Groups generating at once share actor calls (`route_batch`): one message per replica and turn, not
one per group. Environments run on threads of their own (rl.environments.threads), or in their own process with
`environment.isolated`: the job's event loop never runs their code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
from pathlib import Path
from typing import Any

from apps.grpo.config import GRPOConfig
from apps.grpo.launch import warm_started_model as single_turn_warm_start
from apps.grpo.rewards import RewardScorer
from rl.environments.actor import EnvironmentHost, RemoteEnvironment
from rl.environments.chat import ChatTemplate
from rl.environments.rollout import run_episodes
from rl.environments.threads import ThreadedEnvironment
from rl.environments.trajectory import Trajectory
from rl.types import Completion, CompletionBatch, EpisodeBatch, SamplingParams
from apps.warm_start.multiturn import warm_start_multiturn


EPISODE_BITS = 16  # an episode id is its group id, then its index in the group in this many bits


def episode_ids(group_id: int, n: int) -> list[int]:
    """Unique across groups (rollout.group_size is at most 2**EPISODE_BITS)."""
    return [(group_id << EPISODE_BITS) + i for i in range(n)]


def is_multi_turn(task: Any) -> bool:
    return hasattr(task, "environment")


def held_out_score(cfg: GRPOConfig, task: Any) -> str:
    """What the mean of held-out rewards is: "accuracy" when every reward is 0 or 1 (the task's `binary_rewards`;
    without one, forge's own tasks with their exact-match rewards), else "mean reward" (an environment's or a
    dataset's partial scores, or a user's reward function)."""
    binary = getattr(task, "binary_rewards", cfg.task.source == "forge" and cfg.task.reward is None)
    return "accuracy" if binary else "mean reward"


async def _split_across_replicas(generators: Any, problems: list, play) -> list:
    """`play(part)` for even parts of `problems`, one per healthy replica, concatenated in order."""
    chunk = max(1, math.ceil(len(problems) / max(1, len(generators.healthy_replicas()))))
    parts = await asyncio.gather(*(play(problems[i : i + chunk]) for i in range(0, len(problems), chunk)))
    return [x for part in parts for x in part]


class SingleTurn:
    def __init__(self, generators: Any, rewards: RewardScorer) -> None:
        self.generators, self.rewards = generators, rewards

    async def group(self, problem: Any, params: SamplingParams,
                    version: int) -> tuple[CompletionBatch, list[float], int]:
        completions = await self.generators.generate_batch.route_batch([problem.prompt], params,
                                                                       min_policy_version=version)
        return completions, await self.rewards.score(completions.texts, problem.answer), 0

    @staticmethod
    def to_episodes(completions: CompletionBatch, *, group_id: int, rewards: list[float],
                    advantages: list[float]) -> EpisodeBatch:
        """The group's episodes, straight from the generator's tensors."""
        n = len(rewards)
        return EpisodeBatch.from_completions(completions, episode_ids=episode_ids(group_id, n),
                                             group_ids=[group_id] * n, rewards=rewards, advantages=advantages)

    async def evaluate(self, problems: list, params: SamplingParams) -> list[float]:
        async def play(part: list) -> list[Completion]:
            return [out[0] for out in await self.generators.generate_batch.route([p.prompt for p in part], params)]

        completions = await _split_across_replicas(self.generators, problems, play)
        scored = await asyncio.gather(*(self.rewards.score([c.text], p.answer) for c, p in zip(completions, problems)))
        return [score for (score,) in scored]


class MultiTurn:
    @staticmethod
    def to_episodes(trajectories: list[Trajectory], *, group_id: int, rewards: list[float],
                    advantages: list[float]) -> EpisodeBatch:
        """The group's episodes, packed once the trajectories (built turn by turn) are complete."""
        return EpisodeBatch.pack([t.to_episode(episode_id=i, group_id=group_id, reward=r, advantage=a)
                                  for t, i, r, a in zip(trajectories, episode_ids(group_id, len(trajectories)),
                                                        rewards, advantages)])

    def __init__(self, cfg: GRPOConfig, task: Any, tokenizer: Any, generators: Any, hosts: Any | None) -> None:
        self.cfg, self.task, self.generators, self.hosts = cfg, task, generators, hosts
        # Prompts and observations repeat (a task's few hundred prompts, a tool's short replies): each distinct text
        # is tokenized once. Encoding is deterministic, so the ids are the same as encoding it again.
        encoded = functools.lru_cache(maxsize=1 << 16)(
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)))
        self.encode = lambda text: list(encoded(text))
        self.end_token_ids = [tokenizer.eos_token_id]
        # environment.chat_template: turns wrapped by the model's chat template, by token ids (rl.environments.chat)
        self.chat = (ChatTemplate(tokenizer, system_prompt=cfg.environment.system_prompt,
                                  chat_template_kwargs=cfg.task.chat_template_kwargs)
                     if cfg.environment.chat_template else None)

    def environments(self, n: int) -> list:
        """The group's environments: on threads of this process, or on the environment host (environment.isolated)."""
        return [RemoteEnvironment(self.hosts) if self.hosts else ThreadedEnvironment(self.task.environment)
                for _ in range(n)]

    async def play(self, problems: list, params: SamplingParams, version: int = 0) -> list[Trajectory]:
        """One episode per problem, all at once, every turn on one replica."""

        async def generate(prompts: list[list[int]], turn_params: SamplingParams) -> list[Completion]:
            outputs = await self.generators.generate_batch.route_batch(prompts, turn_params,
                                                                      min_policy_version=version)
            return [out[0] for out in outputs]

        async with self.generators.session(), (self.hosts.session() if self.hosts else contextlib.nullcontext()):
            return await run_episodes(generate, self.environments(len(problems)), problems, params,
                                      self.cfg.environment, self.encode, self.end_token_ids, chat=self.chat)

    async def group(self, problem: Any, params: SamplingParams,
                    version: int) -> tuple[list[Trajectory], list[float], int]:
        """The group's episodes, their rewards, and how many of them failed in their environment (their rewards
        mean nothing: the job drops such a group)."""
        played = await self.play([problem] * params.n, params, version)
        return played, [t.reward for t in played], sum(t.failed for t in played)

    async def evaluate(self, problems: list, params: SamplingParams) -> list[float | None]:
        """Each problem's reward; None where its environment failed."""
        played = await _split_across_replicas(self.generators, problems, lambda part: self.play(part, params))
        return [None if t.failed else t.reward for t in played]


async def make_rollout(cfg: GRPOConfig, task: Any, actors: Any, rewards: RewardScorer) -> SingleTurn | MultiTurn:
    """A multi-turn task's rollout starts its environment host first when `environment.isolated`."""
    if not is_multi_turn(task):
        return SingleTurn(actors.generators, rewards)
    hosts = None
    if cfg.environment.isolated:
        hosts = await EnvironmentHost.options(num_replicas=1, mesh_name="environments").as_service(task.environment)
    return MultiTurn(cfg, task, actors.tokenizer, actors.generators, hosts)


def warm_started_model(cfg: GRPOConfig, task: Any) -> tuple[str, float | None]:
    """`cfg.model`, first trained briefly on the task when `warm_start.enabled` (cached by its inputs): a multi-turn
    task on its correct episodes (apps.warm_start.multiturn), arithmetic on its answers (apps.grpo.launch)."""
    if not is_multi_turn(task):
        return single_turn_warm_start(cfg, task)
    if not cfg.warm_start.enabled:
        return cfg.model, None
    eval_problems = task.sample_prompts(cfg.warm_start.eval_prompts, random.Random(f"{cfg.seed}-warm-start-eval"))
    train_rng = random.Random(f"{cfg.seed}-warm-start")
    path, accuracy = warm_start_multiturn(cfg.model, Path(cfg.model_cache) / "warm_start", task=task,
                                          train_problems=lambda n: task.sample_prompts(n, train_rng),
                                          eval_problems=eval_problems, limits=cfg.environment,
                                          config=cfg.warm_start, seed=cfg.seed, max_tokens=cfg.rollout.max_tokens)
    return str(path), accuracy
