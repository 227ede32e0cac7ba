"""A short supervised warm start: teach a fresh model the answer format, then stop early.

GRPO needs some reward signal to begin with: a randomly initialised model never emits a correct answer,
so every group has zero variance and nothing is learned. A few hundred teacher-forced steps on
(prompt, reference answer + end token) pairs bring greedy accuracy to a low threshold (~20%); GRPO does the rest.
The examples are apps.sft's (rl/demonstrations.py, shared: every task with reference answers, masks by token ids, a chat
task's answers ended by its template's end of turn); the loss, the token-mean NLL of the answers, is HF's with those
masks as labels (the same as losses/nll.py). Training runs in this process, one model, stopped at the target accuracy:
a warm start is seconds of work on the tiny model, less than starting the trainer's processes.
The result is saved as an ordinary HF checkpoint directory, cached by its inputs.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from collections.abc import Sequence
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from apps.held_out.evaluate import Reward, evaluate_greedy
from apps.held_out.samplers import BatchingSampler
from apps.held_out.scores import TaskScore
from apps.warm_start.config import WarmStartConfig
from rl.demonstrations import completion_example, reference_completion
from rl.tasks import Problem
from rl.tasks.protocol import MultiTurnTask, Task
from rl.sampling import SamplingParams


class ModelSampler:
    """The held-out evaluator's sampler (apps/held_out/) over the training model in this process: `sample_many` decodes
    its problems in one left-padded batch (actors.engines.hf.HFEngine over the model itself, no copy)."""

    def __init__(self, model, tokenizer) -> None:
        from actors.engines.hf import HFEngine

        self.engine = HFEngine.from_model(model, tokenizer)

    async def sample_many(self, problems: list[Problem], params: SamplingParams) -> list[list[str]]:
        return [[c.text for c in out] for out in self.engine.generate([p.prompt for p in problems], params)]


def greedy_accuracy(model, tokenizer, problems: list[Problem], reward: Callable[[str, str], float], max_tokens: int,
                    stop_token_ids: Sequence[int] = (), *, log: Callable[[str], None] | None = None) -> float:
    """The mean reward (exact-answer accuracy) of greedy decoding, stopped where the task's answers end: the shared
    held-out evaluator over one batch of the model (`ModelSampler`), a sample whose reward failed left out (reported
    to `log`). It runs an event loop of its own: call it from plain code or a thread, not from a coroutine."""
    score = asyncio.run(evaluate_greedy(BatchingSampler(ModelSampler(model, tokenizer)), problems, Reward(reward, None),
                                        max_tokens=max_tokens, stop_token_ids=stop_token_ids, label="warm start"))
    return checked_accuracy(score, "samples", log)


def checked_accuracy(score: TaskScore, what: str, log: Callable[[str], None] | None = None, name: str = "") -> float:
    """An evaluation's accuracy (its mean reward); failed `what` are left out, reported to `log`. When every one failed,
    the warm start cannot measure, let alone reach, its target: an error (naming the task `name`)."""
    first = next(iter(score.failures), "")
    if score.failed_samples == score.samples:
        raise RuntimeError(f"warm start{f' of task {name!r}' if name else ''}: all {score.samples} evaluation {what} "
                           f"failed (first: {first}); it cannot produce a correct one")
    if score.failed_samples and log is not None:
        log(f"warm start: {score.failed_samples} of {score.samples} evaluation {what} left out of the accuracy: they "
            f"failed (first: {first})")
    return score.mean_reward


def warm_start_on_task(model: str, model_cache: str | Path, task: Task, config: WarmStartConfig, *, seed: int,
                       max_tokens: int) -> tuple[str, float]:
    """`model` trained on `task`'s reference answers (`warm_start`), cached under `model_cache/warm_start`: training
    and evaluation prompts come from `task.sample_prompts` with generators seeded from `seed`, so every app that warm
    starts the same model on the same task and seed shares one cached checkpoint. Any single-turn task with reference
    answers (arithmetic, gsm8k, reasoning-gym); a task whose environment scores episodes has none and is refused by
    name."""
    if isinstance(task, MultiTurnTask):
        raise ValueError(f"warm start: task {type(task).__name__} has no reference answers (its environment scores "
                         "episodes); the multi-turn warm start trains a task's correct episodes "
                         "(apps.warm_start.multiturn), or set warm_start.enabled=false")
    eval_problems = task.sample_prompts(config.eval_prompts, random.Random(f"{seed}-warm-start-eval"))
    train_rng = random.Random(f"{seed}-warm-start")
    end_id = task.stop_token_ids[-1] if task.stop_token_ids else None  # a chat task's end of turn; else EOS
    path, accuracy = warm_start(model, Path(model_cache) / "warm_start",
                                train_problems=lambda n: task.sample_prompts(n, train_rng), eval_problems=eval_problems,
                                reward=task.reward, config=config, seed=seed, max_tokens=max_tokens,
                                completion=lambda problem: reference_completion(task, problem), end_id=end_id,
                                stop_token_ids=task.stop_token_ids)
    return str(path), accuracy


def log_now(line: str) -> None:
    print(line, flush=True)  # flushed: the output is often a log file, and a start-up must not look hung


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    train_problems: Callable[[int], list[Problem]],
    eval_problems: list[Problem],
    reward: Callable[[str, str], float],
    config: WarmStartConfig,
    seed: int,
    max_tokens: int,
    log: Callable[[str], None] = log_now,
    completion: Callable[[Problem], str] = lambda problem: problem.answer,
    end_id: int | None = None,
    stop_token_ids: Sequence[int] = (),
) -> tuple[Path, float]:
    """Train on `train_problems(n)` (prompt -> `completion(problem)` + `end_id`, EOS when None) until greedy accuracy
    on `eval_problems` (generation stopped at `stop_token_ids`) reaches the target. Returns the saved checkpoint
    directory and the accuracy reached (see `train_until_accurate`)."""

    def batch(tokenizer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = tokenizer.eos_token_id if end_id is None else end_id
        examples = [completion_example(tokenizer, p.prompt, completion(p), end) for p in train_problems(n)]
        labels = [[t if learned else -100 for t, learned in zip(e.ids, e.learned)] for e in examples]
        return padded_batch([list(e.ids) for e in examples], labels,
                            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end)

    return train_until_accurate(
        model_dir, out_dir, cache_key={"eval": [tuple(p) for p in eval_problems[:20]]}, batch=batch,
        accuracy=lambda model, tokenizer: greedy_accuracy(model, tokenizer, eval_problems, reward, max_tokens,
                                                          stop_token_ids, log=log),
        config=config, seed=seed, log=log, what=f"greedy accuracy on {len(eval_problems)} prompts")


def train_until_accurate(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    cache_key: dict,
    batch: Callable[[object, int], tuple[torch.Tensor, torch.Tensor]],
    accuracy: Callable[[object, object], float],
    config: WarmStartConfig,
    seed: int,
    log: Callable[[str], None] = log_now,
    what: str = "greedy accuracy",
) -> tuple[Path, float]:
    """Supervised steps on `batch(tokenizer, config.batch_size)` (input ids, labels with -100 where nothing is
    learned) until `accuracy(model, tokenizer)` reaches the target.

    Returns the saved checkpoint directory and the accuracy reached. A checkpoint made earlier with the
    same model, seed, settings and `cache_key` is reused. `log` gets what is happening as it happens: where the
    result is cached, then one progress line per evaluation (a plain-text bar towards the target accuracy, elapsed
    and estimated time).
    """
    out_dir = Path(out_dir)
    settings = {name: value for name, value in asdict(config).items() if value is not None}  # unset: earlier keys hold
    key = hashlib.sha256(
        json.dumps({"model": str(Path(model_dir).resolve()), "seed": seed, "config": settings, **cache_key},
                   sort_keys=True).encode()
    ).hexdigest()[:12]
    target = (out_dir / f"warm-{key}").resolve()
    if (target / "warm_start.json").exists():
        info = json.loads((target / "warm_start.json").read_text())
        log(f"warm start: reusing {target} (accuracy {info['accuracy']:.1%}, cached by model, seed and settings)")
        return target, info["accuracy"]

    log(f"warm start: none cached for this model, seed and settings; training one (cached in {target} for "
        f"later starts)")
    earlier = _earlier_durations(out_dir)
    log(f"warm start: supervised steps of {config.batch_size} examples until {what} reaches "
        f"{config.target_accuracy:.0%}, checked every {config.eval_every} steps (at most {config.max_steps} steps); "
        + (f"earlier warm starts in {out_dir} took {min(earlier):.0f}-{max(earlier):.0f}s" if earlier
           else "a time estimate follows each check"))
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    # One thread: a warm start's matrices are small, and on a busy host a second thread mostly waits for the first.
    torch.set_num_threads(1)
    try:
        return _train(model_dir, out_dir, key, target, batch, accuracy, config, log)
    finally:
        torch.set_num_threads(threads)


def _train(model_dir, out_dir: Path, key: str, target: Path, batch, accuracy, config: WarmStartConfig,
           log: Callable[[str], None]) -> tuple[Path, float]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    progress = Progress(config.target_accuracy, config.max_steps)
    reached, step, every = 0.0, 0, config.eval_every
    for step in range(1, config.max_steps + 1):
        model.train()
        input_ids, labels = batch(tokenizer, config.batch_size)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % every == 0:
            model.eval()
            with torch.no_grad():
                reached = accuracy(model, tokenizer)
            log(f"warm start {progress.line(step, reached)} | loss {loss.item():.3f}")
            if reached >= config.target_accuracy:
                break
            if config.check_every_step_from is not None and reached >= config.check_every_step_from:
                every = 1
    tmp = out_dir / f".warm-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for extra in ("generation_config.json",):
        if (Path(model_dir) / extra).exists() and not (tmp / extra).exists():
            shutil.copy(Path(model_dir) / extra, tmp / extra)
    (tmp / "warm_start.json").write_text(json.dumps({"accuracy": reached, "steps": step,
                                                     "seconds": round(progress.elapsed(), 1)}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log(f"warm start: {step} steps in {progress.elapsed():.0f}s, greedy accuracy {reached:.1%}; saved {target} "
        "(reused on later starts)")
    return target, reached


def _earlier_durations(out_dir: Path) -> list[float]:
    """Seconds that the warm starts cached in `out_dir` took (a first estimate for this one)."""
    seconds = []
    for record in out_dir.glob("warm-*/warm_start.json"):
        try:
            seconds.append(float(json.loads(record.read_text())["seconds"]))
        except (ValueError, KeyError, OSError):
            continue  # written before durations were recorded, or unreadable
    return seconds


class Progress:
    """Progress towards the target accuracy as one plain-text line (no carriage returns: it reads the same in a
    terminal and in a log file). The bar fills with the best accuracy so far over the target; the estimate
    extrapolates that accuracy linearly in time, and is capped by what the remaining steps can take."""

    WIDTH = 24

    def __init__(self, target_accuracy: float, max_steps: int) -> None:
        self.target = target_accuracy
        self.max_steps = max_steps
        self.best = 0.0
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def line(self, step: int, accuracy: float) -> str:
        self.best = max(self.best, accuracy)
        done = min(1.0, self.best / self.target)
        filled = round(done * self.WIDTH)
        elapsed = self.elapsed()
        bound = elapsed / step * (self.max_steps - step)  # every remaining step at this pace
        if done >= 1:
            left = "done"
        elif self.best > 0:
            left = f"~{min(bound, elapsed * (1 - done) / done):.0f}s left"
        else:
            left = f"at most {bound:.0f}s left (an estimate once accuracy rises)"
        return (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done:4.0%} | step {step}/{self.max_steps} | greedy "
                f"accuracy {accuracy:.1%} (target {self.target:.0%}) | {elapsed:.0f}s, {left}")


def padded_batch(rows: list[list[int]], label_rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on the padding)."""
    length = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (length - len(r)) for r in label_rows])
    return input_ids, labels
