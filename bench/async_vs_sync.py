"""Async vs synchronous GRPO: the same tiny job at max_policy_age = 0, 1, 2, side by side in one invocation.

    python -m bench.async_vs_sync [--steps 20] [--ages 0,1,2] [key=value ...]

Each run is the real app (`python -m apps.grpo`) on the same config and the same number of trained samples;
only `replay_buffer.max_policy_age` differs. From each run's metrics.jsonl it reports steps per second of
the training loop, the trainer's busy fraction (time inside train_step over the loop's wall time) and the
generators' busy fraction (engine time over wall time x replicas), and the speedup over age 0; from its
summary.json, the episodes generated, trained and dropped (too old or buffer full) over the whole run.
Evaluation and the warm start are off: this measures the loop, not the task. Exits 1 when the synchronous run
(age 0) dropped any episode: at age 0 nothing may be generated that cannot be trained.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_app(age: int, steps: int, run_dir: Path, overrides: list[str]) -> dict[str, float]:
    command = [sys.executable, "-m", "apps.grpo", "--config", "configs/grpo_tiny.yaml", f"run_dir={run_dir}",
               f"steps={steps}", f"replay_buffer.max_policy_age={age}", "warm_start.enabled=false",
               "eval.at_start=false", "eval.at_end=false", "checkpoint.interval=0", "checkpoint.final=false",
               "metrics.console=false", *overrides]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"max_policy_age={age}: the app failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    episodes = json.loads((run_dir / "summary.json").read_text())["episodes"]
    # The first step includes start-up (first generations, first publish): measure steps 2..N.
    timed = rows[1:]
    wall = timed[-1]["time"] - rows[0]["time"]
    train_busy = sum(r["step_s"] - r["train/wait_s"] for r in timed)
    generator_busy = sum(r.get("generator/busy_s", 0.0) for r in timed)
    replicas = int(next((o.split("=")[1] for o in overrides if o.startswith("resources.generator_replicas=")), 1))
    return {
        "max_policy_age": age,
        "steps_per_s": len(timed) / wall,
        "trainer_busy": train_busy / wall,
        "generator_busy": generator_busy / (wall * replicas),
        "mean_version_lag": sum(r["train/version_lag"] for r in timed) / len(timed),
        "generated": episodes["generated"],
        "trained": episodes["trained"],
        "dropped": episodes["dropped_too_old"] + episodes["dropped_buffer_full"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ages", default="0,1,2")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every run (key=value)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for age in (int(a) for a in args.ages.split(",")):
            print(f"running max_policy_age={age} ...", flush=True)
            results.append(run_app(age, args.steps, Path(tmp) / f"age{age}", args.overrides))
    base = results[0]["steps_per_s"]
    print(f"\n{'max_policy_age':>14} {'steps/s':>8} {'speedup':>8} {'trainer busy':>13} {'generator busy':>15} "
          f"{'version lag':>12} {'generated':>10} {'trained':>8} {'dropped':>8}")
    for r in results:
        print(f"{r['max_policy_age']:>14} {r['steps_per_s']:>8.3f} {r['steps_per_s'] / base:>7.2f}x "
              f"{r['trainer_busy']:>12.0%} {r['generator_busy']:>15.0%} {r['mean_version_lag']:>12.2f} "
              f"{r['generated']:>10} {r['trained']:>8} {r['dropped']:>8}")
    wasted = [r for r in results if r["max_policy_age"] == 0 and r["dropped"]]
    if wasted:
        print(f"FAIL: max_policy_age=0 dropped {wasted[0]['dropped']} episodes: a synchronous run must generate only "
              "what it trains", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
