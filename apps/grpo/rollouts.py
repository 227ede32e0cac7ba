"""How the GRPO job plays, scores and selects prompt groups: its rollout (rl.rollout: `SingleTurn` scored by the task's
reward or the user's, `MultiTurn` against the task's environments), which groups are trained (`GroupSelector`), the
greedy held-out evaluation (`HeldOut`: the shared evaluator, apps/held_out/), and the model it starts from (a warm
start, a distillation teacher).

Environments run on threads of their own (rl.environments.threads), or in their own process with
`environment.isolated`: the job's event loop never runs their code.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from apps.grpo.config import TEACHER_WARM_START, GRPOConfig, RolloutConfig
from apps.grpo.launch import JobActors, reward_function
from apps.grpo.rewards import RewardScorer
from apps.grpo.summary import EpisodeCounters
from apps.held_out.evaluate import Reward, evaluate_greedy
from apps.held_out.samplers import BatchingSampler, RolloutSampler
from apps.held_out.scores import TaskScore
from forge.metrics import record_metric
from rl.environments.player import start_player
from rl.rollout import EPISODE_BITS, FATAL, Group, MultiTurn, Rollout, SingleTurn  # noqa: F401 (EPISODE_BITS: main.py)
from rl.tasks.protocol import MultiTurnTask, Task
from rl.types import SamplingParams
from apps.warm_start.config import WarmStartConfig
from apps.warm_start.multiturn import warm_start_multiturn
from apps.warm_start.supervised import warm_start_on_task


MIN_GROUP = 2  # episodes a group needs to be trained: advantages are relative to the group's other rewards


def held_out_score(cfg: GRPOConfig, task: Task) -> str:
    """What the mean of held-out rewards is: "accuracy" when every reward is 0 or 1 (the task's `binary_rewards`;
    without one, forge's own tasks with their exact-match rewards), else "mean reward" (an environment's or a
    dataset's partial scores, or a user's reward function)."""
    binary = getattr(task, "binary_rewards", cfg.task.source == "forge" and cfg.task.reward is None)
    return "accuracy" if binary else "mean reward"


def sampling_params(cfg: GRPOConfig, task: Task) -> SamplingParams:
    """A training group's sampling (`rollout.*`); the held-out evaluation's is greedy (`HeldOut`)."""
    r = cfg.rollout
    return SamplingParams(n=r.group_size, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                          stop_token_ids=list(task.stop_token_ids))


class GroupSelector:
    """Which played groups are trained, with every episode that is not counted (EpisodeCounters, rollout/* metrics).

    - A problem whose generation failed (an error in place of its group) has no episodes (`generation_failures`).
    - Episodes whose environment failed are left out (`environment_failures`); the rest of the group is trained when at
      least MIN_GROUP are left, else dropped with them (`environment_dropped` counts both).
    - With `drop_zero_variance_groups`, a group whose rewards are all equal carries no signal and is dropped
      (`zero_variance_dropped`), at most `max_dropped_groups_per_step` a step (`new_step`)."""

    def __init__(self, cfg: RolloutConfig, counters: EpisodeCounters) -> None:
        self.cfg, self.counters = cfg, counters
        self.dropped_this_step = 0  # zero-variance groups

    def new_step(self) -> None:
        self.dropped_this_step = 0

    def trainable(self, group: Group | Exception | None) -> Group | None:
        c = self.counters
        if not isinstance(group, Group):
            c.generation_failures += 1
            record_metric("rollout/generation_failures", 1, "sum")
            return None
        failures = sum(group.failed)
        kept = group.without_failures()
        if failures:
            c.environment_failures += failures
            record_metric("rollout/environment_failures", failures, "sum")
        if len(kept.rewards) < MIN_GROUP:
            self._drop("environment", len(group.rewards))
            return None
        self._drop("environment", failures)
        record_metric("rollout/reward_mean", sum(kept.rewards) / len(kept.rewards))  # groups' means, over the step
        budget = self.cfg.max_dropped_groups_per_step
        if (self.cfg.drop_zero_variance_groups and all(r == kept.rewards[0] for r in kept.rewards)
                and (budget is None or self.dropped_this_step < budget)):
            self.dropped_this_step += 1
            self._drop("zero_variance", len(kept.rewards))
            return None
        return kept

    def _drop(self, reason: str, episodes: int) -> None:
        if episodes:
            self.counters.generated += episodes
            setattr(self.counters, f"{reason}_dropped", getattr(self.counters, f"{reason}_dropped") + episodes)
            record_metric(f"rollout/{reason}_dropped", episodes, "sum")


class HeldOut:
    """The greedy held-out evaluation, through the evaluator apps.eval and apps.sft report with (apps/held_out/): the
    task's first `eval.num_prompts` held-out problems, one greedy sample each, played by the job's rollout as one call
    (one batch per generator replica), a single-turn one unscored: the evaluator scores each text with the task's
    reward (or the user's, under its timeout). A sample whose generation, environment or reward failed is left out of
    the score and counted; a rollout error that ends the job (rl.rollout.FATAL) ends it here too."""

    def __init__(self, cfg: GRPOConfig, task: Task, rollout: Rollout, tokenizer: Any = None) -> None:
        if isinstance(rollout, SingleTurn):
            rollout = SingleTurn(rollout.generators)
        self.sampler = BatchingSampler(RolloutSampler(rollout, tokenizer))
        self.reward = Reward(*reward_function(cfg, task))
        self.task, self.num_prompts, self.max_tokens = task, cfg.eval.num_prompts, cfg.rollout.max_tokens

    async def score(self, label: str) -> TaskScore:
        return await evaluate_greedy(self.sampler, self.task.held_out()[: self.num_prompts], self.reward,
                                     max_tokens=self.max_tokens, stop_token_ids=self.task.stop_token_ids,
                                     label=f"eval {label}", fatal=FATAL)


async def make_rollout(cfg: GRPOConfig, task: Task, actors: JobActors) -> SingleTurn | MultiTurn:
    """A single-turn task's rollout scores with the task's reward (or the user's, `task.reward`) and leaves the
    completions on the generator replicas for the replay buffer to take: a replica holds at most one kept batch per
    group in flight (`rollout.concurrency`), twice that before it evicts the oldest. A multi-turn task's starts its
    environment host first when `environment.isolated`."""
    if not isinstance(task, MultiTurnTask):
        reward, timeout_s = reward_function(cfg, task)
        return SingleTurn(actors.generators, RewardScorer(reward, timeout_s, name=f"task.reward={cfg.task.reward}"),
                          keep_at_most=2 * cfg.rollout.concurrency)
    return MultiTurn(await start_player(task, actors.tokenizer, cfg.environment, actors.generators,
                                        cfg.task.chat_template_kwargs))


def warm_started_model(cfg: GRPOConfig, task: Task,
                       settings: WarmStartConfig | None = None) -> tuple[str, float | None]:
    """`cfg.model`, first trained briefly on the task when `warm_start.enabled` (cached by its inputs): a multi-turn
    task on its correct episodes (apps.warm_start.multiturn), a single-turn task on its reference answers
    (apps.warm_start.supervised, apps.sft's examples: arithmetic, GSM8K, reasoning-gym).
    `settings`: other warm-start settings than `cfg.warm_start` (a distillation teacher's: `teacher_model`)."""
    settings = cfg.warm_start if settings is None else settings
    if not settings.enabled:
        return cfg.model, None
    if not isinstance(task, MultiTurnTask):
        return warm_start_on_task(cfg.model, cfg.model_cache, task, settings, seed=cfg.seed,
                                  max_tokens=cfg.rollout.max_tokens)
    eval_problems = task.sample_prompts(settings.eval_prompts, random.Random(f"{cfg.seed}-warm-start-eval"))
    train_rng = random.Random(f"{cfg.seed}-warm-start")
    path, accuracy = warm_start_multiturn(cfg.model, Path(cfg.model_cache) / "warm_start", task=task,
                                          task_name=cfg.task.name,
                                          train_problems=lambda n: task.sample_prompts(n, train_rng),
                                          eval_problems=eval_problems, limits=cfg.environment,
                                          config=settings, seed=cfg.seed, max_tokens=cfg.rollout.max_tokens)
    return str(path), accuracy


def teacher_model(cfg: GRPOConfig, task: Task) -> tuple[str | None, float | None]:
    """The distillation teacher's checkpoint (None without one) and, when forge trains it, its warm start's accuracy:
    `teacher.model: warm_start` is the task's warm start (`warm_started_model`) trained on to
    `teacher.warm_start_accuracy`, cached by its inputs like the student's."""
    if cfg.teacher.model != TEACHER_WARM_START:
        return cfg.teacher.model, None
    settings = replace(cfg.warm_start, enabled=True, target_accuracy=cfg.teacher.warm_start_accuracy)
    return warm_started_model(cfg, task, settings)
