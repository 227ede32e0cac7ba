"""Peak memory of publishing a Qwen3-1.7B-shaped model (random weights) from a trainer process, side by side
with baselines that write or copy the same state dict, each in a fresh process of its own.

    cd <repo> && .venv/bin/python -m bench.publish_memory                      # parameters in bf16
    cd <repo> && .venv/bin/python -m bench.publish_memory --param-dtype fp32 --methods forge,copy   # fp32 params

Methods (every one publishes/writes in bf16, the generators' dtype):
- forge: `WeightPublisher.start(...)` + `wait()` (actors/weight_publisher.py), which streams the tensors into a
  shared-memory segment through `WeightStore.publish` (forge/weights/store.py), as the trainer does after a step.
- torch.save: `torch.save` of the bf16 state dict into /dev/shm (a plain file of the same bytes).
- copy: a bf16 copy of the whole state dict in the process (what gathering the full state dict costs).

Figures: the process's peak RSS above its RSS just before the method (VmHWM after `clear_refs`), and the peak
growth of /dev/shm's used bytes (sampled every 2 ms), each also as a ratio of the published bytes.
One process is one rank here: with FSDP, rank 0 gathers one tensor at a time on top of this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.weight_sync_actors import qwen3_layer_shapes

METHODS = ("forge", "torch.save", "copy")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Qwen3-1.7B's config.json: 28 layers, hidden 2048, intermediate 6144, 8 KV heads of 128, vocabulary 151936,
# tied input and output embeddings (so no lm_head.weight).
LAYERS, HIDDEN, VOCAB = 28, 2048, 151_936


def qwen3_1_7b_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        shapes.update(qwen3_layer_shapes(layer))
    shapes["model.norm.weight"] = (HIDDEN,)
    return shapes


def random_state_dict(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # Filled in place: freed temporaries would stay in the heap, inflate "RSS before" and be reused by a copy.
    generator = torch.Generator().manual_seed(0)
    return {name: torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator)
            for name, shape in qwen3_1_7b_shapes().items()}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _shm_used_bytes(shm: Path) -> int:
    stats = os.statvfs(shm)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


class ShmPeak:
    """The largest growth of the shared-memory folder's used bytes while it runs (a sampling thread)."""

    def __init__(self, shm: Path, every_s: float = 0.002) -> None:
        self.shm, self.every_s = shm, every_s
        self.start = _shm_used_bytes(shm)
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _shm_used_bytes(self.shm) - self.start)
            time.sleep(self.every_s)

    def __enter__(self) -> ShmPeak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _shm_used_bytes(self.shm) - self.start)


async def run_method(method: str, param_dtype: torch.dtype) -> dict:
    """One method in this (fresh) process: its peak RSS and /dev/shm growth."""
    publish_dtype = torch.bfloat16
    store = None
    if method == "forge":
        from actors.weight_publisher import WeightPublisher
        from forge.weights.store import SHM_DIR, WeightStore
        from forge.weights.startup import start_weight_store

        await start_weight_store()  # before measuring: the Monarch runtime is not the publish
        store = WeightStore("bench-publish-memory", transport="shm")
    else:
        from forge.weights.store import SHM_DIR
    params = [torch.nn.Parameter(t, requires_grad=False) for t in random_state_dict(param_dtype).values()]
    state_dict = dict(zip(qwen3_1_7b_shapes(), params))
    published_bytes = sum(t.numel() for t in params) * publish_dtype.itemsize
    target = SHM_DIR / f"bench-publish-memory-{os.getpid()}.pt"
    rss_before = _status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.perf_counter()
    with ShmPeak(SHM_DIR) as shm:
        if method == "forge":
            publisher = WeightPublisher(store, dtype=publish_dtype, keep_versions=1)
            publisher.start(state_dict, 0, torch.optim.SGD(params, lr=0.0))
            await publisher.wait()
        elif method == "torch.save":
            torch.save({n: t.detach().to(publish_dtype) for n, t in state_dict.items()}, target)
        else:
            copy = {n: t.detach().to(publish_dtype, copy=True) for n, t in state_dict.items()}
            del copy
    seconds = time.perf_counter() - started
    peak_rss = _status_kib("VmHWM") * 1024
    if store is not None:
        await store.delete(0)
        from forge.provisioner import shutdown

        await shutdown()
    target.unlink(missing_ok=True)
    return {"method": method, "param_dtype": str(param_dtype).removeprefix("torch."), "tensors": len(state_dict),
            "published_bytes": published_bytes, "rss_before": rss_before, "rss_extra": peak_rss - rss_before,
            "shm_extra": shm.peak, "seconds": seconds}


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16",
                        help="the dtype of the trainer's parameters (published in bf16 either way)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, forge first: {METHODS}")
    parser.add_argument("--method", choices=METHODS, help="run one method in this process (used by the parent)")
    args = parser.parse_args(argv)
    param_dtype = DTYPES[args.param_dtype]
    if args.method:
        print(json.dumps(asyncio.run(run_method(args.method, param_dtype))), flush=True)
        return
    methods = args.methods.split(",")
    if methods[0] != "forge" or not set(methods) <= set(METHODS):
        parser.error(f"--methods={args.methods!r}: forge first, then any of {METHODS[1:]}")
    published = sum(torch.Size(s).numel() for s in qwen3_1_7b_shapes().values()) * 2
    # The parameters, a bf16 copy and a file of them (torch.save of fp32 parameters), and room to spare: never
    # push a shared host into the OOM killer.
    copies = 2 if "torch.save" in methods and param_dtype != torch.bfloat16 else 1
    needed = published // 2 * param_dtype.itemsize + copies * published + (2 << 30)
    if mem_available_bytes() < needed:
        sys.exit(f"needs about {needed / 2**30:.1f} GiB available, {mem_available_bytes() / 2**30:.1f} GiB are")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    rows = []
    for method in methods:
        out = subprocess.run([sys.executable, "-m", "bench.publish_memory", "--method", method, "--param-dtype",
                              args.param_dtype], env=env, cwd=root, capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not lines:
            sys.exit(f"method {method} failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows.append(json.loads(lines[-1]))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    gb = rows[0]["published_bytes"] / 1e9
    print(f"Qwen3-1.7B-shaped state dict: {rows[0]['tensors']} tensors, {rows[0]['param_dtype']} parameters, "
          f"published in bf16: {gb:.3f} GB")
    print(f"  {'method':<12}{'RSS before GB':>14}{'peak extra RSS GB':>19}{'x bytes':>9}{'peak /dev/shm GB':>18}"
          f"{'x bytes':>9}{'seconds':>9}")
    for row in rows:
        rss, shm = row["rss_extra"] / 1e9, row["shm_extra"] / 1e9
        print(f"  {row['method']:<12}{row['rss_before'] / 1e9:>14.3f}{rss:>19.3f}{rss / gb:>9.3f}{shm:>18.3f}"
              f"{shm / gb:>9.3f}{row['seconds']:>9.2f}")
    forge, *baselines = rows
    for base in baselines:
        ratios = [f"{label} {forge[key] / base[key]:.3f}x" for label, key in
                  (("peak extra RSS", "rss_extra"), ("peak /dev/shm", "shm_extra"), ("time", "seconds"))
                  if base[key] > 0.01 * forge["published_bytes"] or key == "seconds"]
        print(f"  forge / {base['method']}: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
