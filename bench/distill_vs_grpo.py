"""On-policy distillation vs GRPO from the same warm start, with a GRPO-trained teacher (issue 31's bar).

    python -m bench.distill_vs_grpo --seeds 0 1 2 [--grpo-steps N] [--distill-steps N] [--eval-every 10]
                                    [--margin 0.05] [--run-dir runs/distill_vs_grpo] [--lock FILE] [--reuse]
                                    [key=value ...]

Per seed, two runs of the real app (`python -m apps.grpo`, one after the other) from the same cached warm start:
1. GRPO, configs/grpo_tiny.yaml: its held-out curve is GRPO's steps-to-accuracy, its final held-out accuracy is the
   teacher's, and its HF export is the teacher;
2. distillation, configs/distill_tiny.yaml with teacher.model=<that export> (the key=value overrides apply here).
The target is the teacher's accuracy less `--margin`; the bar holds on a seed when the student first reaches it at
an earlier step than GRPO first did. Both runs evaluate the same held-out prompts greedily every `--eval-every` steps,
so a step is known to that resolution. By default distillation runs as many steps as GRPO needed to reach the
target: reaching it later fails the bar anyway. Curves come from each run's summary.json (start and end) and
metrics.jsonl (the app records the evaluation after step k into step k+1's row); the seconds to the target are the
training loop's (the sum of the app's `step_s`, evaluations excluded), the wall times each whole run's. Exits 1 when a
seed misses the bar.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_app(config: str, run_dir: Path, overrides: list[str],
            args: argparse.Namespace) -> tuple[dict, dict[int, float], list[float]]:
    """One app run, under `flock args.lock` when given (a machine's heavy runs take its cores one at a time); with
    `args.reuse`, a run already finished in `run_dir` is read back instead."""
    if args.reuse and (run_dir / "summary.json").exists():
        return read_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [*(["flock", args.lock] if args.lock else []), sys.executable, "-m", "apps.grpo", "--config", config,
               f"run_dir={run_dir}", "checkpoint.interval=0", "checkpoint.final=false", *overrides]
    with open(run_dir / "console.log", "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = (run_dir / "console.log").read_text()[-3000:]
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{tail}")
    return read_run(run_dir)


def read_run(run_dir: Path) -> tuple[dict, dict[int, float], list[float]]:
    """A finished run's summary.json, held-out curve {step: accuracy} (step 0: the start) and each step's seconds."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {0: summary["accuracy_start"]}
    curve |= {row["step"] - 1: row["eval/accuracy"] for row in rows[1:] if "eval/accuracy" in row}
    curve[summary["steps"]] = summary["accuracy_end"]
    return summary, curve, [row["step_s"] for row in rows]


def first_step_at(curve: dict[int, float], target: float) -> int | None:
    return next((step for step, accuracy in sorted(curve.items()) if accuracy >= target), None)


def seconds_to(step_seconds: list[float], step: int | None) -> float | None:
    """The training loop's seconds up to `step` (the app's `step_s`; the held-out evaluations run outside it)."""
    return None if step is None else sum(step_seconds[:step])


def bench_seed(seed: int, args: argparse.Namespace) -> dict:
    common = [f"seed={seed}", f"eval.every={args.eval_every}"]
    folder = Path(args.run_dir) / f"seed{seed}"
    grpo_steps = [f"steps={args.grpo_steps}"] if args.grpo_steps else []
    grpo, grpo_curve, grpo_seconds = run_app("configs/grpo_tiny.yaml", folder / "grpo", common + grpo_steps, args)
    teacher_accuracy = grpo["accuracy_end"]
    target = teacher_accuracy - args.margin
    grpo_at = first_step_at(grpo_curve, target)
    distill_steps = args.distill_steps or grpo_at or grpo["steps"]
    print(f"seed {seed}: GRPO {grpo_curve}; teacher {grpo['hf_model']} at {teacher_accuracy:.1%}, target "
          f"{target:.1%} reached by GRPO at step {grpo_at}; distilling {distill_steps} steps", flush=True)
    distill, distill_curve, distill_seconds = run_app("configs/distill_tiny.yaml", folder / "distill",
                                     common + [f"teacher.model={grpo['hf_model']}", f"steps={distill_steps}",
                                               *args.overrides], args)
    student_at = first_step_at(distill_curve, target)
    print(f"seed {seed}: distillation {distill_curve}", flush=True)
    return {"seed": seed, "start": grpo_curve[0], "teacher": teacher_accuracy, "target": target,
            "student_end": distill["accuracy_end"], "student_at": student_at, "grpo_at": grpo_at,
            "student_s": seconds_to(distill_seconds, student_at), "grpo_s": seconds_to(grpo_seconds, grpo_at),
            "grpo_wall_s": grpo["wall_s"], "distill_wall_s": distill["wall_s"],
            "met": student_at is not None and grpo_at is not None and student_at < grpo_at,
            "grpo_curve": grpo_curve, "distill_curve": distill_curve}


def reached(step: int | None, seconds: float | None) -> str:
    return "not reached" if step is None else f"step {step} ({seconds:.0f} s)"


def print_table(rows: list[dict]) -> None:
    print("\n| seed | start | teacher (GRPO end) | target | student end | student reaches target | GRPO reaches it "
          "| wall: GRPO, distillation | bar |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['start']:.1%} | {r['teacher']:.1%} | {r['target']:.1%} | {r['student_end']:.1%} "
              f"| {reached(r['student_at'], r['student_s'])} | {reached(r['grpo_at'], r['grpo_s'])} "
              f"| {r['grpo_wall_s']:.0f} s, {r['distill_wall_s']:.0f} s | {'met' if r['met'] else 'not met'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--grpo-steps", type=int, default=0, help="0: configs/grpo_tiny.yaml's steps")
    parser.add_argument("--distill-steps", type=int, default=0, help="0: the step GRPO reached the target at")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--margin", type=float, default=0.05, help="the student's target: the teacher's less this")
    parser.add_argument("--run-dir", default="runs/distill_vs_grpo")
    parser.add_argument("--reuse", action="store_true", help="read back the runs already finished in --run-dir")
    parser.add_argument("--lock", help="run each app under `flock LOCK` (e.g. /tmp/forge-heavy.lock)")
    parser.add_argument("overrides", nargs="*", help="config overrides for the distillation runs (key=value)")
    args = parser.parse_args(argv)
    rows = [bench_seed(seed, args) for seed in args.seeds]
    (Path(args.run_dir) / "results.json").write_text(json.dumps(rows, indent=2))
    print_table(rows)
    met = sum(r["met"] for r in rows)
    print(f"\nverdict: the bar is {'met' if met == len(rows) else 'NOT met'} (met on {met} of {len(rows)} seeds: "
          f"the student within {args.margin * 100:g} points of the teacher in fewer steps than GRPO)")
    return 0 if met == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
