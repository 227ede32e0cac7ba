"""The warm start two ways, side by side: in the job's process (apps/warm_start, what apps.grpo runs) against the same
training as an apps.sft run (the trainer actor on its own process mesh, the generator service for the accuracy).

    python -m bench.warm_start_vs_sft [--seeds 0 1 2] [--repeats 1]

Both start from the same tiny checkpoint (built once, not timed) and train configs/grpo_tiny.yaml's warm start: the
task's reference answers, `warm_start.batch_size` examples a step at `warm_start.lr` (constant, no warm-up), greedy
accuracy checked every `warm_start.eval_every` steps on 200 problems, stopped at `warm_start.target_accuracy`. The
in-process one checks training problems (apps/warm_start: the evaluation set is a seeded sample of the task's
prompts), apps.sft its held-out problems; both are drawn from the same distribution. Wall time is the whole call for
the in-process one and the whole `python -m apps.sft` process for the other (its process meshes' start and stop are
what it costs). Ratios are apps.sft's time over the in-process one's. Every run gets a model cache of its own, so
nothing is read back from an earlier run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def grpo_config(seed: int, model_cache: Path):  # -> GRPOConfig
    from apps.app_config import load_app_config
    from apps.grpo.config import GRPOConfig

    return load_app_config(REPO / "configs/grpo_tiny.yaml", [f"seed={seed}", f"model_cache={model_cache}"],
                           GRPOConfig, check=GRPOConfig.check)


def in_process(seed: int, tiny: Path) -> dict:
    from apps.grpo.launch import make_task
    from apps.grpo.rollouts import warm_started_model

    with tempfile.TemporaryDirectory(prefix="ws-inproc-") as folder:
        cache = Path(folder)
        shutil.copytree(tiny, cache / tiny.name)
        cfg = grpo_config(seed, cache)
        started = time.perf_counter()
        _, accuracy = warm_started_model(cfg, make_task(cfg))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "accuracy": accuracy}


def as_sft_run(seed: int, tiny: Path, settings) -> dict:
    """apps.sft with the warm start's settings, stopped at its target accuracy."""
    with tempfile.TemporaryDirectory(prefix="ws-sft-") as folder:
        command = [sys.executable, "-m", "apps.sft", "--config", "configs/sft_tiny.yaml", f"seed={seed}",
                   f"model={tiny}", f"model_cache={folder}", f"run_dir={folder}/run", f"steps={settings.max_steps}",
                   f"batch_size={settings.batch_size}", "resources.trainer_procs=1",
                   f"trainer.micro_batch_size={settings.batch_size}", f"trainer.lr={settings.lr}",
                   "trainer.warmup_steps=0", "trainer.lr_decay=constant", f"eval.every={settings.eval_every}",
                   f"eval.num_prompts={settings.eval_prompts}",
                   f"eval.stop_at_accuracy={settings.target_accuracy}", "eval.at_start=false", "eval.at_end=false",
                   "checkpoint.interval=0"]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}"
                               f"{done.stderr[-3000:]}")
        summary = json.loads((Path(folder) / "run" / "summary.json").read_text())
    return {"seconds": seconds, "steps": summary.get("stopped_at_accuracy"), "train_s": summary.get("train_s")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=1, help="alternated runs of each side per seed")
    args = parser.parse_args(argv)

    build = Path(tempfile.mkdtemp(prefix="ws-tiny-"))
    try:
        cfg = grpo_config(args.seeds[0], build)  # builds the tiny checkpoint once
        tiny, settings = Path(cfg.model), cfg.warm_start
        print(f"warm start: target {settings.target_accuracy}, batch {settings.batch_size}, lr {settings.lr}, "
              f"check every {settings.eval_every} steps on {settings.eval_prompts} problems", flush=True)
        rows = []
        for seed in args.seeds:
            for repeat in range(args.repeats):
                a = in_process(seed, tiny)
                b = as_sft_run(seed, tiny, settings)
                rows.append((seed, a, b))
                print(f"seed {seed} run {repeat}: in process {a['seconds']:.1f} s (accuracy {a['accuracy']}); "
                      f"apps.sft {b['seconds']:.1f} s (stopped at step {b['steps']}, {b['train_s']} s of it training); "
                      f"ratio {b['seconds'] / a['seconds']:.2f}x", flush=True)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    ratios = [b["seconds"] / a["seconds"] for _, a, b in rows]
    print(f"apps.sft over in-process: median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x) over {len(ratios)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
