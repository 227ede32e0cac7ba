"""Learning speed: how fast GRPO lifts held-out accuracy on the tiny arithmetic task, on CPU.

The baseline is a hand loop in one process (`run_hand_loop`): a supervised warm start stopped early at
a low accuracy, then plain GRPO with the project's own engine, advantages and loss. A full-app runner
(`run_app`) starts `python -m apps.grpo` with the same `LearningSpeedConfig` as overrides of the tiny
default and reads its run folder back into the same result keys, so `print_results` shows both side by side.

    python bench/learning_speed.py --seed 0 1 2            # the hand loop, then the app, per seed
    python bench/learning_speed.py --seed 0 --hand-only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

# Run as a script from the repository root: make the packages importable without installing.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from actors.engines.hf import HFEngine  # noqa: E402
from rl.tasks.arithmetic import ArithmeticTask, Problem  # noqa: E402
from rl.tiny_model import ensure_tiny_checkpoint  # noqa: E402
from apps.warm_start.config import WarmStartConfig  # noqa: E402
from apps.warm_start.supervised import warm_start  # noqa: E402
from rl.types import Episode, SamplingParams, TrainBatch  # noqa: E402
from losses.advantages import group_advantages  # noqa: E402
from losses.grpo import grpo  # noqa: E402


@dataclass
class LearningSpeedConfig:
    """Shared by every runner so their numbers are comparable."""

    seed: int = 0
    num_threads: int = 1  # measured: 1 beats 2 on the shared 2-core machine
    # Task: 2-digit addition; answers have at most 3 digits, plus EOS.
    num_digits: int = 2
    reverse_answer: bool = True
    held_out: int = 500
    max_tokens: int = 4
    # Supervised warm start (apps.warm_start.supervised, as the app runs it): stop at the threshold's greedy accuracy.
    warm_lr: float = 3e-3
    warm_batch_size: int = 64
    warm_threshold: float = 0.15
    warm_eval_every: int = 5
    warm_eval_prompts: int = 200
    warm_max_steps: int = 3000
    # GRPO.
    lr: float = 3e-4
    group_size: int = 16
    prompts_per_step: int = 64
    temperature: float = 0.7  # as configs/grpo_tiny.yaml
    clip_eps: float = 0.2
    # Optimizer steps per sampled batch, each on a contiguous slice of whole groups; after the first the
    # samples are off-policy and the clip bounds the update.
    minibatches: int = 4
    grpo_steps: int = 400
    max_grpo_seconds: float = 240.0
    target_accuracy: float = 0.75  # stop GRPO early once held-out accuracy reaches this
    eval_every: int = 10
    gain_target: float = 0.30  # report the time to gain this much held-out accuracy

    def __post_init__(self) -> None:
        if self.lr > 3e-4:
            raise ValueError(f"LearningSpeedConfig.lr={self.lr}: must be <= 3e-4 (1e-3 collapses GRPO here)")
        if self.held_out < 500:
            raise ValueError(f"LearningSpeedConfig.held_out={self.held_out}: must be >= 500 prompts")
        if self.prompts_per_step % self.minibatches:
            raise ValueError(
                f"LearningSpeedConfig.minibatches={self.minibatches}: must divide prompts_per_step="
                f"{self.prompts_per_step} so every minibatch holds whole groups"
            )
        if self.group_size < 2:
            raise ValueError(f"LearningSpeedConfig.group_size={self.group_size}: must be >= 2 (group advantages)")


def completion_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(token t+1 | tokens <= t) at the sampling temperature (the engine's behaviour log-probs are at
    that temperature, so the policy ratio must be too), [B, T-1]: the alignment `TrainBatch` uses.

    Right padding needs no attention mask: causal attention keeps pads from reaching earlier positions.
    """
    logits = model(input_ids=input_ids).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def held_out_accuracy(engine: HFEngine, task: ArithmeticTask, problems: list[Problem], max_tokens: int) -> float:
    """Greedy exact-match accuracy."""
    completions = engine.generate([p.prompt for p in problems], SamplingParams(max_tokens=max_tokens, temperature=0))
    rewards = [task.reward(group[0].text, p.answer) for group, p in zip(completions, problems)]
    return sum(rewards) / len(rewards)


def grpo_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    engine: HFEngine,
    task: ArithmeticTask,
    problems: list[Problem],
    cfg: LearningSpeedConfig,
) -> dict[str, float]:
    """Sample a group per prompt with the engine, score, and take `cfg.minibatches` GRPO steps."""
    params = SamplingParams(n=cfg.group_size, max_tokens=cfg.max_tokens, temperature=cfg.temperature)
    groups = engine.generate([p.prompt for p in problems], params)
    episodes = [
        Episode.from_completion(c, episode_id=g * cfg.group_size + i, group_id=g, reward=task.reward(c.text, p.answer))
        for g, (group, p) in enumerate(zip(groups, problems))
        for i, c in enumerate(group)
    ]
    rewards = torch.tensor([e.reward for e in episodes])
    advantages, zero_variance = group_advantages(rewards, torch.tensor([e.group_id for e in episodes]))
    for episode, advantage in zip(episodes, advantages.tolist()):
        episode.advantage = advantage
    batch = TrainBatch.from_episodes(episodes, pad_id=engine.pad_token_id)
    rows = batch.num_sequences // cfg.minibatches
    for start in range(0, rows * cfg.minibatches, rows):
        minibatch = batch.slice(start, start + rows)
        out = grpo(completion_logprobs(model, minibatch.input_ids, cfg.temperature), minibatch, clip_eps=cfg.clip_eps)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return {"reward": rewards.mean().item(), "zero_variance": zero_variance.float().mean().item(), **out.metrics}


def run_hand_loop(cfg: LearningSpeedConfig, log: Callable[[str], None] = print) -> dict[str, float]:
    """The single-process baseline: warm start, then GRPO with the engine's weights reloaded every step.

    The engine keeps its own copy of the model (as the generator actor does) and receives the trainer's
    weights through `load_weights` before each sampling step, so sampling never sees a half-made update.
    """
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    task = ArithmeticTask(seed=cfg.seed, num_digits=cfg.num_digits, held_out=cfg.held_out,
                          reverse_answer=cfg.reverse_answer)
    held_out = task.held_out()
    # The app's warm start, with the app's data streams: both runners start from the same checkpoint.
    start = run_start = time.perf_counter()
    train_rng = random.Random(f"{cfg.seed}-warm-start")
    checkpoint, _ = warm_start(
        ensure_tiny_checkpoint(REPO / ".cache/forge/tiny-qwen3"), REPO / ".cache/forge/warm_start",
        train_problems=lambda n: task.sample_prompts(n, train_rng),
        eval_problems=task.sample_prompts(cfg.warm_eval_prompts, random.Random(f"{cfg.seed}-warm-start-eval")),
        reward=task.reward, seed=cfg.seed, max_tokens=cfg.max_tokens, log=log,
        config=WarmStartConfig(target_accuracy=cfg.warm_threshold, lr=cfg.warm_lr, batch_size=cfg.warm_batch_size,
                               max_steps=cfg.warm_max_steps, eval_every=cfg.warm_eval_every,
                               eval_prompts=cfg.warm_eval_prompts))
    warm_seconds = time.perf_counter() - start
    warm_steps = json.loads((checkpoint / "warm_start.json").read_text())["steps"]
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    engine = HFEngine(str(checkpoint), seed=cfg.seed)
    model.train()
    start_accuracy = held_out_accuracy(engine, task, held_out, cfg.max_tokens)
    log(f"warm start: {warm_steps} steps, {warm_seconds:.1f}s, held-out accuracy {start_accuracy:.1%}")

    # The app's trainer: AdamW without weight decay, gradients clipped at norm 1.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(f"{cfg.seed}-grpo")
    accuracy, train_seconds, gain_seconds = start_accuracy, 0.0, math.nan
    steps = evaluated_at = 0
    for steps in range(1, cfg.grpo_steps + 1):
        tick = time.perf_counter()
        stats = grpo_step(model, optimizer, engine, task, task.sample_prompts(cfg.prompts_per_step, rng), cfg)
        engine.load_weights(model.state_dict(), version=steps)
        train_seconds += time.perf_counter() - tick
        if steps % cfg.eval_every == 0 or train_seconds >= cfg.max_grpo_seconds:
            accuracy, evaluated_at = held_out_accuracy(engine, task, held_out, cfg.max_tokens), steps
            if accuracy - start_accuracy >= cfg.gain_target and math.isnan(gain_seconds):
                gain_seconds = train_seconds
            log(
                f"grpo step {steps:4d} {train_seconds:6.1f}s reward {stats['reward']:.3f} "
                f"zero-variance groups {stats['zero_variance']:.0%} held-out accuracy {accuracy:.1%}"
            )
            if accuracy >= cfg.target_accuracy or train_seconds >= cfg.max_grpo_seconds:
                break
    if evaluated_at != steps:
        accuracy = held_out_accuracy(engine, task, held_out, cfg.max_tokens)
    return {
        "warm_steps": warm_steps,
        "warm_seconds": warm_seconds,
        "start_accuracy": start_accuracy,
        "final_accuracy": accuracy,
        "grpo_steps": steps,
        "grpo_seconds": train_seconds,
        "seconds_to_gain": gain_seconds,
        "total_seconds": time.perf_counter() - run_start,
    }


def app_overrides(cfg: LearningSpeedConfig, run_dir: Path) -> list[str]:
    """`key=value` overrides that give the app the hand loop's task, warm start and GRPO settings."""
    return [
        f"run_dir={run_dir}", f"seed={cfg.seed}", f"steps={cfg.grpo_steps}",
        f"task.num_digits={cfg.num_digits}", f"task.reverse_answer={str(cfg.reverse_answer).lower()}",
        f"task.held_out={cfg.held_out}", f"eval.num_prompts={cfg.held_out}",
        f"eval.every={cfg.eval_every}",
        f"warm_start.lr={cfg.warm_lr}", f"warm_start.batch_size={cfg.warm_batch_size}",
        f"warm_start.target_accuracy={cfg.warm_threshold}", f"warm_start.eval_every={cfg.warm_eval_every}",
        f"warm_start.eval_prompts={cfg.warm_eval_prompts}", f"warm_start.max_steps={cfg.warm_max_steps}",
        f"rollout.group_size={cfg.group_size}", f"rollout.max_tokens={cfg.max_tokens}",
        f"rollout.temperature={cfg.temperature}", f"trainer.temperature={cfg.temperature}",
        f"replay_buffer.batch_size={cfg.group_size * cfg.prompts_per_step}",
        f"trainer.lr={cfg.lr}", f"trainer.minibatches={cfg.minibatches}",
        f"trainer.loss_params.clip_eps={cfg.clip_eps}",
    ]


# The app prints each held-out evaluation; its metrics.jsonl holds the per-step times.
EVAL_LINE = re.compile(r"eval \((start|step (\d+)|end), policy version \d+\): held-out greedy accuracy ([\d.]+)%")


def run_app(cfg: LearningSpeedConfig, config: str = "configs/grpo_tiny.yaml",
            log: Callable[[str], None] = print) -> dict[str, float]:
    """The full app as a subprocess: rollout actors, replay buffer and trainer, with `cfg`'s settings.

    GRPO time is the sum of the app's `step_s` (held-out evaluations run between steps, outside it);
    `total_seconds` is the whole command, process start-up and warm start included.
    """
    with tempfile.TemporaryDirectory(prefix="forge-learning-speed-app-") as folder:
        run_dir = Path(folder)
        command = [sys.executable, "-m", "apps.grpo", "--config", config, *app_overrides(cfg, run_dir)]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        total_seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_seconds = {row["step"]: row["step_s"] for row in steps}
    start_accuracy, gain_seconds = summary["accuracy_start"], math.nan
    for match in EVAL_LINE.finditer(done.stdout):
        label, step, percent = match.groups()
        if not step:
            continue
        log(f"app step {step}: held-out accuracy {percent}%")
        if float(percent) / 100 - start_accuracy >= cfg.gain_target and math.isnan(gain_seconds):
            gain_seconds = sum(s for k, s in step_seconds.items() if k <= int(step))
    if summary["accuracy_end"] - start_accuracy >= cfg.gain_target and math.isnan(gain_seconds):
        gain_seconds = sum(step_seconds.values())
    warm = re.findall(r"warm start: (\d+) steps", done.stdout)
    return {
        "warm_steps": int(warm[-1]) if warm else -1,  # -1: a cached warm start was reused
        "warm_seconds": math.nan,
        "start_accuracy": start_accuracy,
        "final_accuracy": summary["accuracy_end"],
        "grpo_steps": summary["steps"],
        "grpo_seconds": sum(step_seconds.values()),
        "seconds_to_gain": gain_seconds,
        "total_seconds": total_seconds,
    }


RESULT_COLUMNS = (
    ("runner", "{}"),
    ("seed", "{}"),
    ("warm_steps", "{:d}"),
    ("start_accuracy", "{:.1%}"),
    ("final_accuracy", "{:.1%}"),
    ("grpo_steps", "{:d}"),
    ("grpo_seconds", "{:.1f}"),
    ("seconds_to_gain", "{:.1f}"),
    ("total_seconds", "{:.1f}"),
)


def print_results(rows: list[dict[str, object]]) -> None:
    """One line per (runner, seed) run."""
    cells = [[name for name, _ in RESULT_COLUMNS]]
    cells += [[fmt.format(row[name]) for name, fmt in RESULT_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(RESULT_COLUMNS))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--hand-only", action="store_true", help="run only the single-process hand loop")
    parser.add_argument("--app-only", action="store_true", help="run only the full app (python -m apps.grpo)")
    parser.add_argument("--config", default="configs/grpo_tiny.yaml", help="the app's base config")
    for field in dataclasses.fields(LearningSpeedConfig):
        if field.name != "seed":
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(LearningSpeedConfig) if f.name != "seed"}
    rows = []
    for seed in args.seed:
        cfg = LearningSpeedConfig(seed=seed, **overrides)
        if not args.app_only:
            rows.append({"runner": "hand loop", "seed": seed, **run_hand_loop(cfg)})
        if not args.hand_only:
            rows.append({"runner": "app", "seed": seed, **run_app(cfg, args.config)})
    print_results(rows)


if __name__ == "__main__":
    main()
