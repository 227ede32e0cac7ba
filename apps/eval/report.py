"""The results: a console table, results.json, the metrics backends, and accuracy.png over a run's steps."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from apps.held_out.scores import TaskScore
from apps.eval.sources import ModelVersion


@dataclass
class VersionResult:
    """One evaluated model's scores, task by task (in the config's order)."""

    version: ModelVersion
    tasks: dict[str, TaskScore] = field(default_factory=dict)
    wall_s: float = 0.0

    def as_json(self) -> dict:
        return {"label": self.version.label, "kind": self.version.kind, "path": self.version.path,
                "step": self.version.step, "wall_s": round(self.wall_s, 3),
                "tasks": {name: score.as_json() for name, score in self.tasks.items()}}

    def metrics(self) -> dict[str, float]:
        """`eval/<task>/<figure>` for the metrics backends."""
        out = {}
        for name, s in self.tasks.items():
            out[f"eval/{name}/mean_reward"] = s.mean_reward
            out.update({f"eval/{name}/pass@{k}": v for k, v in s.pass_at.items()})
            out[f"eval/{name}/failed_samples"] = float(s.failed_samples)
        return out


def table(results: list[VersionResult], n: int, ks: list[int]) -> str:
    """One row per model and task: prompts, samples, failed samples, mean@n, pass@k for each k."""
    head = ["model", "task", "prompts", "samples", "failed", f"mean@{n}", *(f"pass@{k}" for k in ks)]
    rows = [[r.version.label, task, str(s.prompts), str(s.samples), str(s.failed_samples), _pct(s.mean_reward),
             *(_pct(s.pass_at[k]) for k in ks)]
            for r in results for task, s in r.tasks.items()]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [head, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def failures_text(results: list[VersionResult]) -> str:
    """Every kind of sample failure with its count, or '' when none failed."""
    lines = [f"  {r.version.label} {task}: {count} x {error}"
             for r in results for task, s in r.tasks.items() for error, count in s.failures.items()]
    total = sum(s.failed_samples for r in results for s in r.tasks.values())
    return f"{total} samples failed (left out of the scores):\n" + "\n".join(lines) if lines else ""


def write_json(path: Path, results: list[VersionResult], config: dict) -> None:
    data = {"config": config, "results": [r.as_json() for r in results]}
    path.write_text(json.dumps(_without_nan(data), indent=1, allow_nan=False) + "\n")


def plot(path: Path, results: list[VersionResult], ks: list[int]) -> None:
    """pass@k (each k) and mean@n of every task against the run's step."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    steps = [r.version.step for r in results]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for task in results[0].tasks:
        for k in ks:
            axes.plot(steps, [r.tasks[task].pass_at[k] for r in results], marker="o", label=f"{task} pass@{k}")
        if ks != [1]:
            axes.plot(steps, [r.tasks[task].mean_reward for r in results], marker="x", linestyle="--",
                      label=f"{task} mean reward")
    axes.set_xlabel("step")
    axes.set_ylabel("held-out accuracy")
    axes.set_ylim(-0.02, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}%"


def _without_nan(value: object) -> object:
    """NaN (no problem could be scored) as null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nan(v) for v in value]
    return value
