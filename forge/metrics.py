"""Metrics: `record_metric` from any actor in any process, reduced per step by the controller.

Each process keeps partial reductions (count, sum, sum of squares, min, max) per metric in a
process-local accumulator. At the end of a step the controller collects the partials from every process
(see `forge.provisioner`, which puts a collector on each proc mesh), merges them, and hands the reduced
values to the backends: console, JSONL file, TensorBoard, Weights & Biases.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol


class Reduce(str, Enum):
    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    STD = "std"


@dataclass
class Partial:
    """Mergeable partial reduction of one metric."""

    reduce: Reduce
    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.total_sq += value * value
        self.low = min(self.low, value)
        self.high = max(self.high, value)

    def merge(self, other: Partial) -> None:
        if other.reduce != self.reduce:
            raise ValueError(f"metric reduced both as {self.reduce.value} and {other.reduce.value}")
        self.count += other.count
        self.total += other.total
        self.total_sq += other.total_sq
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)

    def value(self) -> float:
        if self.reduce is Reduce.SUM:
            return self.total
        if self.reduce is Reduce.MAX:
            return self.high
        if self.reduce is Reduce.MIN:
            return self.low
        mean = self.total / self.count
        if self.reduce is Reduce.MEAN:
            return mean
        return math.sqrt(max(self.total_sq / self.count - mean * mean, 0.0))


class MetricAccumulator:
    """The process-local store behind `record_metric` (thread-safe: endpoints may run on threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partials: dict[str, Partial] = {}

    def record(self, name: str, value: float, reduce: Reduce | str = Reduce.MEAN) -> None:
        reduce = Reduce(reduce)
        value = float(value)
        with self._lock:
            partial = self._partials.get(name)
            if partial is None:
                partial = self._partials[name] = Partial(reduce)
            elif partial.reduce is not reduce:
                raise ValueError(
                    f"record_metric({name!r}): recorded with reduce={reduce.value} after reduce={partial.reduce.value}"
                )
            partial.add(value)

    def drain(self) -> dict[str, Partial]:
        """Return and clear everything recorded since the last drain."""
        with self._lock:
            partials, self._partials = self._partials, {}
        return partials


_local = MetricAccumulator()


def record_metric(name: str, value: float, reduce: Reduce | str = Reduce.MEAN) -> None:
    """Record one value of `name` in this process; the controller reduces it with `reduce` each step."""
    _local.record(name, value, reduce)


def drain_local() -> dict[str, Partial]:
    return _local.drain()


def merge_partials(groups: list[dict[str, Partial]]) -> dict[str, float]:
    merged: dict[str, Partial] = {}
    for group in groups:
        for name, partial in group.items():
            if name in merged:
                merged[name].merge(partial)
            else:
                merged[name] = Partial(partial.reduce, partial.count, partial.total, partial.total_sq, partial.low, partial.high)
    return {name: p.value() for name, p in sorted(merged.items()) if p.count}


class MetricBackend(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlBackend:
    """One JSON object per step: {"step": s, "time": t, name: value, ...}."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self) -> None:
        self._file.close()


class ConsoleBackend:
    """A live progress line per step: the chosen keys, then a bar when the total is known."""

    def __init__(self, keys: list[str] | None = None, total_steps: int | None = None, stream=None) -> None:
        self.keys = keys
        self.total_steps = total_steps
        self.stream = stream or sys.stdout

    def log(self, step: int, metrics: dict[str, float]) -> None:
        keys = self.keys if self.keys is not None else sorted(metrics)
        parts = [f"{k}={_fmt(metrics[k])}" for k in keys if k in metrics]
        prefix = f"step {step}"
        if self.total_steps:
            done = min(step, self.total_steps)
            filled = int(20 * done / self.total_steps)
            prefix = f"[{'#' * filled}{'.' * (20 - filled)}] step {done}/{self.total_steps}"
        self.stream.write(f"{prefix} | {' '.join(parts)}\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class TensorBoardBackend:
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    def __init__(self, project: str, run_name: str | None = None, config: dict | None = None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("metrics.wandb is configured but wandb is not installed: pip install wandb") from e
        self._run = wandb.init(project=project, name=run_name, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def _fmt(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


@dataclass
class MetricsConfig:
    """Where each step's metrics go."""

    console: bool = True
    """A progress line per step on the console."""
    console_keys: list[str] | None = None
    """The metrics the console line shows (null: all)."""
    jsonl: str | None = None
    """Path of the JSONL file (apps.grpo: `${run_dir}/metrics.jsonl` when null)."""
    tensorboard: str | None = None
    """TensorBoard log dir (null: none)."""
    wandb_project: str | None = None
    """Weights & Biases project (null: none)."""
    wandb_run_name: str | None = None
    """Weights & Biases run name."""


@dataclass
class MetricLogger:
    """Merges per-process partials into one value per metric per step and writes to the backends."""

    backends: list[MetricBackend] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: MetricsConfig, total_steps: int | None = None,
                    jsonl_default: str | Path | None = None) -> MetricLogger:
        """The configured backends; `jsonl_default` is the JSONL file written when `config.jsonl` is not set."""
        backends: list[MetricBackend] = []
        if config.console:
            backends.append(ConsoleBackend(config.console_keys, total_steps))
        if config.jsonl or jsonl_default:
            backends.append(JsonlBackend(config.jsonl or jsonl_default))
        if config.tensorboard:
            backends.append(TensorBoardBackend(config.tensorboard))
        if config.wandb_project:
            backends.append(WandbBackend(config.wandb_project, config.wandb_run_name))
        return cls(backends)

    def log(self, step: int, partial_groups: list[dict[str, Partial]], extra: dict[str, float] | None = None) -> dict[str, float]:
        metrics = merge_partials(partial_groups)
        if extra:
            metrics.update(extra)
        self.history.append({"step": step, **metrics})
        for backend in self.backends:
            backend.log(step, metrics)
        return metrics

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
