"""forge's default GRPO job against TRL's GRPOTrainer on the same job, side by side, per seed.

Every runner starts from the same warm-started checkpoint (forge's, cached by its inputs), samples forge's
arithmetic prompts, is scored by the same reward and evaluated greedily on the same 500 held-out prompts every
`--eval-every` steps (a step: one batch of 64 prompts x 16 completions; TRL's mapping is in bench/trl_grpo_run.py):

    trl          TRL's GRPOTrainer in its own environment (made here on first use: `--trl-python` to reuse one)
    forge sync   python -m apps.grpo --config configs/grpo_tiny.yaml replay_buffer.max_policy_age=0
    forge        python -m apps.grpo --config configs/grpo_tiny.yaml (the default, asynchronous)

It prints each seed's held-out accuracy at equal steps and at equal training time (evaluations excluded from every
clock; the time of the last evaluation at or before it), and the training time each runner took to first reach
70%, 75% and 80% with TRL's time over forge's. Run it under the shared lock: it takes about 15 minutes a seed.

    python bench/trl_side_by_side.py --seeds 0 1 2 [--runners trl forge-sync forge] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRL_VENV = REPO / ".cache" / "trl-venv"  # ignored by git, beside the warm starts
# TRL's newest release; it runs beside forge's torch and transformers, which are pinned to the same versions.
TRL_PINS = ("trl==1.16.0", "torch==2.13.0", "transformers==5.19.0")
TARGETS = (0.70, 0.75, 0.80)
EVAL_LINE = re.compile(r"eval \((start|step (\d+)|end), policy version \d+\): held-out greedy accuracy ([\d.]+)%")


def trl_python(given: str | None) -> str:
    """The TRL environment's python: `given`, else .cache/trl-venv, made with forge's uv on first use."""
    if given:
        return given
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        uv = str(REPO / ".venv" / "bin" / "uv")
        wheels = sorted(Path("/opt/wheels").glob("torch-2.13.0+cpu-*.whl"))
        source = (["--find-links", "/opt/wheels"] if wheels else
                  ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "--index-strategy", "unsafe-best-match"])
        subprocess.run([uv, "venv", str(TRL_VENV), "--python", sys.executable, "-q"], check=True)
        subprocess.run([uv, "pip", "install", "--python", str(python), *TRL_PINS, *source], check=True)
    return str(python)


def warm_checkpoint(seed: int) -> tuple[str, float | None]:
    """forge's warm start for `seed` (what `python -m apps.grpo` trains from), made or found in its cache."""
    from apps.app_config import load_app_config
    from apps.grpo.config import GRPOConfig
    from apps.grpo.launch import make_task
    from apps.grpo.rollouts import warm_started_model

    cfg = load_app_config(REPO / "configs/grpo_tiny.yaml", [f"seed={seed}"], GRPOConfig,
                          check=GRPOConfig.check)
    return warm_started_model(cfg, make_task(cfg))


def run_trl(python: str, model: str, seed: int, steps: int, eval_every: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([python, str(REPO / "bench/trl_grpo_run.py"), "--model", model, "--seed", str(seed),
                           "--steps", str(steps), "--eval-every", str(eval_every), "--threads", str(threads)],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"TRL run exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_forge(seed: int, steps: int, eval_every: int, overrides: list[str]) -> dict:
    """The app; each evaluation's training seconds are the summed `step_s` of the steps before it."""
    with tempfile.TemporaryDirectory(prefix="forge-vs-trl-") as folder:
        command = [sys.executable, "-m", "apps.grpo", "--config", "configs/grpo_tiny.yaml", f"seed={seed}",
                   f"steps={steps}", f"eval.every={eval_every}", f"run_dir={folder}", "checkpoint.interval=0",
                   *overrides]
        done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}"
                               f"{done.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        wall_s = json.loads((Path(folder) / "summary.json").read_text()).get("wall_s", math.nan)
    step_s = {row["step"]: row["step_s"] for row in rows}
    reward = {row["step"]: row.get("reward/mean", math.nan) for row in rows}
    evals = []
    for match in EVAL_LINE.finditer(done.stdout):
        label, step, percent = match.groups()
        at = 0 if label == "start" else int(step) if step else max(step_s)
        if label == "end" and evals and evals[-1]["step"] == at:
            continue
        evals.append({"step": at, "train_s": sum(s for k, s in step_s.items() if k <= at),
                      "accuracy": float(percent) / 100, "reward": reward.get(at, math.nan)})
    mean = lambda key: sum(row.get(key, math.nan) for row in rows) / len(rows)  # noqa: E731
    stats = {"step_s": mean("step_s"), "wait_s": mean("train/wait_s"), "clip_fraction": mean("clip_fraction"),
             "version_lag": mean("train/version_lag"), "last_reward": rows[-1].get("reward/mean", math.nan),
             "wall_s": wall_s}
    return {"evals": evals, "stats": stats}


def time_to(evals: list[dict], target: float) -> float:
    return next((e["train_s"] for e in evals if e["accuracy"] >= target), math.nan)


def accuracy_at_time(evals: list[dict], seconds: float) -> float:
    seen = [e["accuracy"] for e in evals if e["train_s"] <= seconds]
    return seen[-1] if seen else math.nan


def print_seed(seed: int, runs: dict[str, dict]) -> None:
    names = list(runs)
    steps = sorted({e["step"] for run in runs.values() for e in run["evals"]})
    print(f"\n== seed {seed}: held-out greedy accuracy at equal steps (training seconds)")
    print(f"{'step':>6} " + " ".join(f"{n:>20}" for n in names))
    for step in steps:
        cells = []
        for run in runs.values():
            e = next((e for e in run["evals"] if e["step"] == step), None)
            cells.append(f"{e['accuracy']:>9.1%} ({e['train_s']:>6.1f}s)" if e else f"{'-':>20}")
        print(f"{step:>6} " + " ".join(f"{c:>20}" for c in cells))
    last = max(e["train_s"] for run in runs.values() for e in run["evals"])
    print(f"== seed {seed}: accuracy at equal training time")
    print(f"{'seconds':>8} " + " ".join(f"{n:>12}" for n in names))
    for seconds in range(30, int(last) + 30, 30):
        print(f"{seconds:>8} " + " ".join(f"{accuracy_at_time(run['evals'], seconds):>12.1%}" for run in runs.values()))
    print(f"== seed {seed}: training seconds to reach the accuracy (and TRL's time over each runner's)")
    for target in TARGETS:
        times = {n: time_to(run["evals"], target) for n, run in runs.items()}
        base = times.get("trl", math.nan)
        print(f"{target:>7.0%}: " + "  ".join(f"{n} {t:.1f}s (x{base / t:.2f})" for n, t in times.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runners", nargs="+", default=["trl", "forge-sync", "forge"],
                        help="trl, forge-sync, forge, or the name of a --variant")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE ...",
                        help="a forge runner with these overrides of the default, e.g. "
                             "'no-tis:trainer.loss_params.tis_cap=null' (then name it in --runners)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--trl-python", help="python of an environment with TRL (default: make .cache/trl-venv)")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (2 cores)")
    parser.add_argument("--forge-overrides", nargs="*", default=[], help="key=value for both forge runners")
    parser.add_argument("--json", help="write every run's evaluations here")
    args = parser.parse_args(argv)
    variants = {"forge-sync": ["replay_buffer.max_policy_age=0"], "forge": []}
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        variants[name] = overrides.split()
    unknown = [name for name in args.runners if name != "trl" and name not in variants]
    if unknown:
        parser.error(f"--runners {unknown}: not trl, forge-sync, forge nor a --variant name ({', '.join(variants)})")
    python = trl_python(args.trl_python) if "trl" in args.runners else None
    results = {}
    for seed in args.seeds:
        model, accuracy = warm_checkpoint(seed)
        print(f"seed {seed}: warm start {model} (accuracy {accuracy})", flush=True)
        runs = {}
        for name in args.runners:
            if name == "trl":
                runs[name] = run_trl(python, model, seed, args.steps, args.eval_every, args.trl_threads)
                print(f"  trl {runs[name]['versions']}", flush=True)
            else:
                runs[name] = run_forge(seed, args.steps, args.eval_every, variants[name] + args.forge_overrides)
            print(f"  {name}: " + " ".join(f"{e['step']}:{e['accuracy']:.1%}@{e['train_s']:.0f}s"
                                           for e in runs[name]["evals"]), flush=True)
            if "stats" in runs[name]:
                print("    " + ", ".join(f"{k} {v:.3f}" for k, v in runs[name]["stats"].items()), flush=True)
        results[seed] = runs
        print_seed(seed, runs)
    if len(results) > 1:
        print_summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def print_summary(results: dict[int, dict[str, dict]]) -> None:
    """Across seeds: mean accuracy at each step (min-max), and the mean time to each target with TRL's over it."""
    names = list(next(iter(results.values())))
    print(f"\n== seeds {', '.join(map(str, results))}: mean held-out accuracy at equal steps [min, max]")
    steps = sorted({e["step"] for runs in results.values() for run in runs.values() for e in run["evals"]})
    print(f"{'step':>6} " + " ".join(f"{n:>22}" for n in names))
    for step in steps:
        cells = []
        for name in names:
            values = [e["accuracy"] for runs in results.values() for e in runs[name]["evals"] if e["step"] == step]
            cells.append(f"{sum(values) / len(values):.1%} [{min(values):.1%}, {max(values):.1%}]" if values else "-")
        print(f"{step:>6} " + " ".join(f"{c:>22}" for c in cells))
    print("== mean training seconds to reach the accuracy (TRL's over each runner's; nan: a seed never reached it)")
    for target in TARGETS:
        times = {n: sum(time_to(runs[n]["evals"], target) for runs in results.values()) / len(results) for n in names}
        base = times.get("trl", math.nan)
        print(f"{target:>7.0%}: " + "  ".join(f"{n} {t:.1f}s (x{base / t:.2f})" for n, t in times.items()))


if __name__ == "__main__":
    main()
