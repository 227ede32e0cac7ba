"""What a GRPO run reports at its end: accuracy, reward, throughput, memory, and where every episode went.

Every episode played is trained, still held by the replay buffer, or dropped with a counted reason:
`generated == trained + held_in_buffer + dropped_too_old + dropped_buffer_full + dropped_zero_variance
+ dropped_environment_failure` (tests/apps/grpo/test_main.py checks it on whole runs; an episode whose environment failed is
never trained, nor is the rest of its group when fewer than 2 are left: apps/grpo/rollouts.py, GroupSelector). The
summary is printed and written to `run_dir/summary.json`.

The held-out score is the mean greedy reward, by the evaluator the apps share (apps/held_out/): "accuracy" when the
task's rewards are 0 or 1, else "mean reward".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from apps.held_out.scores import TaskScore
from forge.weights import segment as weight_segments
from forge.metrics import record_metric
from forge.provisioner import get_provisioner


@dataclass
class EpisodeCounters:
    """The controller's side of the accounting (the replay buffer counts the rest); saved in checkpoints."""

    generated: int = 0  # episodes played (scored, or in a group dropped for an environment failure)
    zero_variance_dropped: int = 0
    trained: int = 0
    generation_failures: int = 0  # prompt groups whose generation failed (no episodes)
    environment_failures: int = 0  # episodes whose environment failed (raised, timed out): never scored
    environment_dropped: int = 0  # those episodes, and the rest of their groups where fewer than 2 were left


@dataclass
class RunSummary:
    steps: int = 0
    policy_version: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0  # the training loop of this run (a resumed run counts from its resume)
    # The controller process's CPU time (all its threads, Monarch's included) over the training loop: what
    # rollouts, rewards and moving episodes between actors cost the one process every actor call goes through.
    controller_cpu_s: float = 0.0
    steps_this_run: int = 0
    warm_start_accuracy: float | None = None
    teacher: str | None = None  # the distillation teacher's checkpoint
    teacher_warm_start_accuracy: float | None = None  # when forge trained it (teacher.model: warm_start)
    # What accuracy_start / accuracy_end are: "accuracy" (rewards 0 or 1) or "mean reward" (partial rewards).
    held_out_score: str = "accuracy"
    accuracy_start: float | None = None
    accuracy_end: float | None = None
    # Held-out samples that failed (their generation, environment or reward; apps/held_out/): left out of the scores.
    eval_environment_failures: int = 0
    first_step: dict[str, float] = field(default_factory=dict)  # this run's first and last step's metrics
    clip_fraction_max: float | None = None  # the PPO clip fraction's largest step value (0: the clip never bound)
    last_step: dict[str, float] = field(default_factory=dict)
    episodes: dict[str, int] = field(default_factory=dict)
    reward_failures: int = 0
    generation_failures: int = 0
    environment_failures: int = 0  # training episodes whose environment failed (never trained)
    rss_start: dict[str, int] = field(default_factory=dict)  # resident bytes per process at the first step
    rss_end: dict[str, int] = field(default_factory=dict)
    shm_bytes: int = 0  # the weight store's shared memory at the end
    checkpoint: str | None = None
    hf_model: str | None = None  # the exported model (None when the run was interrupted)
    interrupted: str | None = None  # the signal that stopped the run early

    def step_logged(self, metrics: dict[str, float], memory: Callable[[], dict[str, int]]) -> None:
        """A training step's metrics; `memory()` (resident bytes per process) is read at the first step only."""
        if not self.first_step:
            self.first_step, self.rss_start = metrics, memory()
        self.last_step = metrics
        if "clip_fraction" in metrics:
            self.clip_fraction_max = max(self.clip_fraction_max or 0.0, metrics["clip_fraction"])

    def count_episodes(self, counters: EpisodeCounters, buffer_stats: dict[str, int]) -> None:
        self.episodes = {"generated": counters.generated, "trained": counters.trained,
                         "consumed_by_buffer": buffer_stats["consumed"], "held_in_buffer": buffer_stats["held"],
                         "dropped_too_old": buffer_stats["dropped_too_old"],
                         "dropped_buffer_full": buffer_stats["dropped_buffer_full"],
                         "dropped_zero_variance": counters.zero_variance_dropped,
                         "dropped_environment_failure": counters.environment_dropped}
        self.generation_failures = counters.generation_failures
        self.environment_failures = counters.environment_failures

    def evaluated(self, label: str, version: int, score: TaskScore) -> float:
        """A held-out evaluation's mean reward (apps/held_out/: one greedy sample a prompt), printed and recorded; the
        prompts whose sample failed (its generation, environment or reward) are left out, counted with their errors."""
        failed = score.failed_samples
        self.eval_environment_failures += failed
        record_metric(self.score_metric, score.mean_reward)
        reasons = "; ".join(f"{error} x{count}" for error, count in list(score.failures.items())[:3])
        print(f"eval ({label}, policy version {version}): held-out greedy {self.held_out_score} "
              f"{self.score_text(score.mean_reward)} on {score.prompts - failed} prompts"
              + (f" ({failed} more left out, failed: {reasons})" if failed else ""), flush=True)
        return score.mean_reward

    def finish(self, run_dir: Path, *, steps: int, policy_version: int, interrupted: str | None,
               counters: EpisodeCounters, buffer_stats: dict[str, int], reward_failures: int, wall_s: float) -> None:
        """The run's end: the last figures, the processes' memory and the weight store's, then the summary printed and
        written to `run_dir/summary.json`."""
        self.count_episodes(counters, buffer_stats)
        self.steps, self.policy_version, self.interrupted = steps, policy_version, interrupted
        self.reward_failures, self.wall_s = reward_failures, wall_s
        self.rss_end, self.shm_bytes = get_provisioner().memory_rss(), weight_segments.job_segments_bytes()
        print(self.text(), flush=True)
        self.write(Path(run_dir) / "summary.json")

    @property
    def score_metric(self) -> str:
        return "eval/accuracy" if self.held_out_score == "accuracy" else "eval/mean_reward"

    def score_text(self, value: float) -> str:
        return f"{value:.1%}" if self.held_out_score == "accuracy" else f"{value:.3f}"

    def write(self, path: str | Path) -> None:
        """summary.json: everything but the per-step metrics (those are in metrics.jsonl)."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("first_step", "last_step")}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(fields, indent=2, default=str))

    def _off_policy_lines(self) -> list[str]:
        """The last step's trainer/generator mismatch per version lag (losses.mismatch) and the run's largest clip."""
        by_lag: dict[str, dict[str, float]] = {}
        for key, value in self.last_step.items():
            if key.startswith("mismatch/"):
                _, lag, name = key.split("/")
                by_lag.setdefault(lag, {})[name] = value
        lines = []
        if self.clip_fraction_max is not None:
            lines.append(f"PPO clip fraction: largest step {self.clip_fraction_max:.4f}")
        order = sorted((lag for lag in by_lag if lag != "all"), key=lambda lag: int(lag.removeprefix("lag")))
        for lag in order + (["all"] if "all" in by_lag else []):
            m = by_lag[lag]
            lines.append(f"off-policy, last step, {lag} ({m['token_share']:.0%} of tokens): |dlogp| "
                         f"{m['abs_logp_diff']:.2e}, KL k3 {m['kl_k3']:.2e}, chi2 {m['chi2']:.2e}, out of band "
                         f"{m['out_of_band']:.2%}, masked {m['masked']:.2%}, truncated {m['tis_truncated']:.2%}")
        return lines

    def text(self) -> str:
        lines = ["", "=== GRPO run summary ===",
                 f"steps: {self.steps} (policy version {self.policy_version}), wall time {self.wall_s:.0f}s"]
        if self.warm_start_accuracy is not None:
            lines.append(f"warm start: greedy accuracy {self.warm_start_accuracy:.1%} (on its own eval prompts)")
        if self.teacher is not None:
            lines.append(f"teacher: {self.teacher}" + ("" if self.teacher_warm_start_accuracy is None else
                         f" (its warm start: greedy accuracy {self.teacher_warm_start_accuracy:.1%} on its own eval "
                         "prompts)"))
        if self.accuracy_start is not None and self.accuracy_end is not None:
            change = self.accuracy_end - self.accuracy_start
            lines.append(f"held-out {self.held_out_score}: {self.score_text(self.accuracy_start)} -> "
                         f"{self.score_text(self.accuracy_end)} ("
                         + (f"{change:+.1%})" if self.held_out_score == "accuracy" else f"{change:+.3f})")
                         + (f"; {self.eval_environment_failures} held-out episodes left out: their generation, "
                            "environment or reward failed" if self.eval_environment_failures else ""))
        if self.first_step:
            lines.append(f"reward (batch mean): first step {self.first_step.get('reward/mean', float('nan')):.3f} -> "
                         f"last step {self.last_step.get('reward/mean', float('nan')):.3f}")
        if self.train_s:
            lines.append(f"throughput: {self.steps_this_run / self.train_s:.2f} steps/s, "
                         f"{self.episodes['trained'] / self.train_s:.1f} trained episodes/s, controller CPU "
                         f"{self.controller_cpu_s / max(1, self.steps_this_run):.3f} core-s per step")
        lines.extend(self._off_policy_lines())
        e = self.episodes
        lines.append(f"episodes: generated {e['generated']} = trained {e['trained']} + held {e['held_in_buffer']} "
                     f"+ dropped (too old {e['dropped_too_old']}, buffer full {e['dropped_buffer_full']}, "
                     f"zero-variance {e['dropped_zero_variance']}, environment failure "
                     f"{e['dropped_environment_failure']}); environment failures {self.environment_failures}, "
                     f"reward failures {self.reward_failures}, failed "
                     f"generations {self.generation_failures} (prompt groups)")
        if self.rss_start:
            lines.append("resident memory, first step -> end (MB): " + ", ".join(
                f"{name} {self.rss_start[name] / 2**20:.0f} -> {self.rss_end[name] / 2**20:.0f}"
                for name in self.rss_start if name in self.rss_end)
                + f"; weight store shared memory {self.shm_bytes / 2**20:.1f} MB")
        if self.checkpoint:
            lines.append(f"checkpoint: {self.checkpoint}  (resume with --resume)")
        if self.interrupted:
            lines.append(f"interrupted by {self.interrupted} after step {self.steps}: no final evaluation or export")
        else:
            lines.append(f"exported HF model: {self.hf_model}")
        return "\n".join(lines)



def step_record(batch: Any, result: Any, waited_s: float, step_s: float, cpu_s: float) -> dict[str, float]:
    """A training step's own metrics, beside what the processes recorded: `batch` (the buffer's HandedBatch) trained
    into `result` (a TrainStepResult), after `waited_s` waiting for it, in `step_s` (the controller's CPU: `cpu_s`)."""
    return {"reward/mean": batch.reward_mean, "train/version_lag": batch.version_lag_mean,
            "buffer/dropped_too_old": float(batch.stats["dropped_too_old"]), "train/wait_s": waited_s,
            "train/episodes_per_s": batch.episodes / step_s, "step_s": step_s, "controller/cpu_s": cpu_s,
            "policy_version": float(result.version), **result.metrics}
