"""Weight sync: publish a ~1 GB HF-named state dict from one process and make it ready in 2 generator
processes, three ways, side by side in one run.

    cd <repo> && .venv/bin/python -m bench.weight_sync --size-gb 1.0 --dtypes bf16,fp32 --repeats 3

With `--hosts 2` the publisher and the readers run on two simulated hosts instead (bench/weight_sync_hosts.py).

(a) forge: `WeightStore.publish` (shared memory) in the publisher, `WeightStore.fetch(v, into=...)` in
    both readers (a copy into the engine's own tensors).
(a2) forge as its Generator fetches: `WeightStore.fetch(v)`, each reader taking views of the version's segment
    (hashed in place, no copy) as its live weights.
(b) torchstore per tensor (TorchForge's path): `ts.put_state_dict` in the publisher,
    `ts.get_state_dict(user_state_dict=...)` in both readers.
(c) the limit: one in-memory `copy_` of the same bytes, one thread, in the controller.

publish-to-ready: measured in the controller, from the start of the publish call until both readers
hold the version in their own pre-allocated tensors (the engine's weights). GB/s = state-dict bytes /
publish-to-ready (each reader gets its own copy, so twice that crosses into readers).

Generation stall: reader 0 runs a "decode loop" on a thread while the update happens the way forge's
Generator does it. A decode step holds the engine's weights lock for a small matmul plus a sleep that
stands for waiting on the GPU (so the loop does not take a whole core of this CPU host away from the
copies, as a GPU-bound engine would not). The update: fetch into staging tensors
while generating, then swap at a step boundary, under the lock: `copy` copies staging into the live
weights (as the hf engine's `_copy_in` does), `pointer` exchanges the two buffers (double buffering).
stall = time decode steps spent waiting for the weights lock between publish start and ready, as a
fraction of that run's publish-to-ready. `slowdown` is the extra time of the other decode steps over
the quiet median (CPU and memory-bandwidth sharing with the copies).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from forge import provisioner
from bench.weight_sync_actors import DTYPES, SWAP_MODES, Publisher, Reader, delete_torchstore_prefix, state_dict_shapes
from forge.weights.store import SHM_DIR, WeightStore, job_id
from forge.weights.startup import start_weight_store


@dataclass
class Stall:
    ready_s: float
    stall_s: float  # decode steps waiting for the weights lock
    slowdown_s: float  # extra time of decode steps over the quiet median, excluding the lock wait
    baseline_step_ms: float

    @property
    def fraction(self) -> float:
        return self.stall_s / self.ready_s


def stall_in_window(steps: list[tuple[float, float, float]], start: float, end: float) -> Stall:
    """Lock waits and extra step time of the decode steps that overlap [start, end]."""
    quiet = [e - s for s, e, _ in steps if e < start]
    if len(quiet) < 5:
        raise RuntimeError(f"only {len(quiet)} decode steps before the publish; lengthen the quiet period")
    baseline = statistics.median(quiet)
    window = [(s, e, wait) for s, e, wait in steps if e > start and s < end]
    stall = sum(wait for _, _, wait in window)
    slowdown = sum(max(0.0, (e - s) - wait - baseline) for s, e, wait in window)
    return Stall(end - start, stall, slowdown, baseline * 1e3)


class Bench:
    """One publisher and one 2-process reader mesh, reused for every dtype and path."""

    def __init__(self, publisher: Publisher, readers: Reader, dtype: str) -> None:
        self.publisher, self.readers, self.dtype = publisher, readers, dtype
        self.version = 0
        self.namespace = f"bench-{dtype}"
        self.kept: int | None = None  # the forge version the readers hold: deleted once they hold the next one

    async def _check(self, expected: list[float], path: str) -> None:
        for rank, got in (await self.readers.fingerprint.call()).items():
            if got != expected:
                raise RuntimeError(f"{path}: reader {rank} does not hold version {self.version} after the update")

    async def forge_once(self, swap: str | None = None, views: bool = False) -> tuple[float, float, float]:
        """(start, published, ready) times of one version through path (a), or (a2) with `views`. The version
        before it is deleted once the readers hold this one, as a trainer deletes what no generator needs: its
        file is the spare the next publish writes into."""
        self.version += 1
        expected = await self.publisher.mark.call_one(self.version)
        start = time.perf_counter()
        await self.publisher.publish_forge.call_one(self.namespace, self.version)
        published = time.perf_counter()
        if views:
            await self.readers.fetch_forge_views.call(self.namespace, self.version)
        else:
            await self.readers.fetch_forge.call(self.namespace, self.version, swap)
        end = time.perf_counter()
        await self._check(expected, "forge")
        await self.delete_kept()
        self.kept = self.version
        return start, published, end

    async def delete_kept(self) -> None:
        if self.kept is not None:
            await WeightStore(self.namespace).delete(self.kept)
            self.kept = None

    async def torchstore_once(self, swap: str | None = None) -> tuple[float, float, float]:
        self.version += 1
        expected = await self.publisher.mark.call_one(self.version)
        key = f"bench-ts-{self.dtype}-{self.version}"
        start = time.perf_counter()
        await self.publisher.publish_torchstore.call_one(key)
        published = time.perf_counter()
        await self.readers.fetch_torchstore.call(key, swap)
        end = time.perf_counter()
        await self._check(expected, "torchstore")
        await delete_torchstore_prefix(key + "/")
        return start, published, end

    async def stall(self, path: str, swap: str, decode_size: int, gpu_wait_s: float, quiet_s: float = 0.5) -> Stall:
        await self.readers.start_generation.call(decode_size, gpu_wait_s)
        await asyncio.sleep(quiet_s)
        once = self.forge_once if path == "forge" else self.torchstore_once
        try:
            start, _, end = await once(swap)
        finally:
            steps = (await self.readers.stop_generation.call()).item(procs=0)
        return stall_in_window(steps, start, end)


def median_split(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(publish-to-ready, publish, fetch) of the run with the median publish-to-ready."""
    runs = sorted(runs, key=lambda r: r[2] - r[0])
    start, published, end = runs[(len(runs) - 1) // 2]
    return end - start, published - start, end - published


def memcpy_seconds(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, repeats: int) -> float:
    """(c): median time of one single-threaded copy of the same tensors into pre-touched ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = {n: torch.randn(s).to(dtype) for n, s in shapes.items()}
        target = {n: torch.zeros_like(t) for n, t in source.items()}
        times = []
        for _ in range(repeats + 1):  # the first pass is a warm-up
            start = time.perf_counter()
            for name, tensor in target.items():
                tensor.copy_(source[name])
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


async def run(args: argparse.Namespace) -> list[dict]:
    # Spawned processes import this module by name: give them the repository on their path.
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    await start_weight_store()
    publisher = await Publisher.options(procs=1, mesh_name="publisher").as_actor()
    readers = await Reader.options(procs=2, mesh_name="readers").as_actor()
    rows = []
    for dtype in args.dtypes:
        shapes = state_dict_shapes(args.size_gb, DTYPES[dtype])
        nbytes = await publisher.build.call_one(shapes, dtype)
        await readers.allocate.call(shapes, dtype)
        bench = Bench(publisher, readers, dtype)
        await bench.forge_once()  # warm-up: first-touch of the readers' tensors, connections
        forge = median_split([await bench.forge_once() for _ in range(args.repeats)])
        torchstore = median_split([await bench.torchstore_once() for _ in range(args.ts_repeats or args.repeats)])
        stalls = {}
        for swap in args.swap:
            stalls[f"forge/{swap}"] = await bench.stall("forge", swap, args.decode_size, args.gpu_wait_ms / 1e3)
        if args.stall_torchstore:
            stalls["torchstore/copy"] = await bench.stall("torchstore", "copy", args.decode_size, args.gpu_wait_ms / 1e3)
        await bench.forge_once(views=True)  # warm-up: the readers' first mapping
        views = median_split([await bench.forge_once(views=True) for _ in range(args.repeats)])
        await bench.delete_kept()
        await publisher.free.call_one()
        await readers.free.call()
        copy_s = memcpy_seconds(shapes, DTYPES[dtype], args.repeats)
        rows.append({"dtype": dtype, "gb": nbytes / 1e9, "tensors": len(shapes), "forge": forge,
                     "views": views, "torchstore": torchstore, "copy": (copy_s, copy_s, 0.0), "stalls": stalls})
        print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    gb = row["gb"]
    print(f"\n{row['dtype']}: {gb:.3f} GB in {row['tensors']} tensors; publish-to-ready, median")
    print(f"  {'path':<46}{'seconds':>9}{'GB/s':>8}{'publish s':>11}{'fetch s':>9}")
    for label, key in (("(a) forge WeightStore (shm), 2 readers", "forge"),
                       ("(a2) forge, readers take views (Generator)", "views"),
                       ("(b) torchstore put/get_state_dict, 2 readers", "torchstore"),
                       ("(c) in-memory copy, 1 thread (limit)", "copy")):
        total, publish, fetch = row[key]
        print(f"  {label:<46}{total:>9.3f}{gb / total:>8.2f}{publish:>11.3f}{fetch:>9.3f}")
    for name in ("a", "a2"):
        total = row["forge" if name == "a" else "views"][0]
        speedup, gap = row["torchstore"][0] / total, total / row["copy"][0]
        print(f"  (b)/({name}) = {speedup:.1f}x (target >= 20: {'met' if speedup >= 20 else 'MISSED'});"
              f"  ({name})/(c) = {gap:.2f}x (target <= 2.5: {'met' if gap <= 2.5 else 'MISSED'}); every fetch verified")
    print(f"  {'generation stall, reader 0':<30}{'ready s':>9}{'stall s':>9}{'stall %':>9}{'slowdown s':>12}{'step ms':>9}")
    for label, stall in row["stalls"].items():
        print(f"  {label:<30}{stall.ready_s:>9.3f}{stall.stall_s:>9.3f}{100 * stall.fraction:>8.1f}%"
              f"{stall.slowdown_s:>12.3f}{stall.baseline_step_ms:>9.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--dtypes", default="bf16,fp32", help=f"comma-separated, from {sorted(DTYPES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ts-repeats", type=int, default=0, help="repeats of (b); 0: same as --repeats")
    parser.add_argument("--swap", default="copy,pointer", help=f"swap modes for the stall runs, from {SWAP_MODES}")
    parser.add_argument("--stall-torchstore", action="store_true", help="also measure the stall of (b)")
    parser.add_argument("--decode-size", type=int, default=128, help="matmul size of one decode step")
    parser.add_argument("--gpu-wait-ms", type=float, default=2.0, help="sleep per decode step (the GPU's share)")
    parser.add_argument("--hosts", type=int, default=1, choices=(1, 2),
                        help="2: publisher on simulated host A, readers on host B (bench/weight_sync_hosts.py; root)")
    parser.add_argument("--link-gbit", default="",
                        help="--hosts 2, comma-separated: a row set per link rate, each host's link shaped with tc tbf "
                             "(empty: unshaped, loopback speed)")
    parser.add_argument("--no-torchstore", action="store_true", help="--hosts 2: leave out (b), plain torchstore")
    args = parser.parse_args(argv)
    try:
        args.link_gbit = [float(rate) for rate in args.link_gbit.split(",") if rate] or [None]
    except ValueError:
        parser.error(f"--link-gbit={args.link_gbit!r}: must be comma-separated numbers (Gbit/s)")
    if any(rate is not None and rate <= 0 for rate in args.link_gbit) or (args.link_gbit != [None] and args.hosts != 2):
        parser.error(f"--link-gbit={args.link_gbit}: rates must be > 0, and only with --hosts 2")
    args.dtypes = args.dtypes.split(",")
    args.swap = [s for s in args.swap.split(",") if s]
    for name in args.dtypes:
        if name not in DTYPES:
            parser.error(f"--dtypes: {name!r} is not one of {sorted(DTYPES)}")
    for name in args.swap:
        if name not in SWAP_MODES:
            parser.error(f"--swap: {name!r} is not one of {list(SWAP_MODES)}")
    if args.size_gb <= 0:
        parser.error(f"--size-gb={args.size_gb}: must be > 0")
    if args.repeats < 1 or args.ts_repeats < 0:
        parser.error(f"--repeats={args.repeats}, --ts-repeats={args.ts_repeats}: need >= 1 and >= 0")
    return args


async def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.hosts > 1:
        from bench import weight_sync_hosts

        await weight_sync_hosts.main(args)
        return
    try:
        await run(args)
    finally:
        await provisioner.shutdown()
    left = sorted(p.name for p in SHM_DIR.glob(f"forge-{job_id()}-*"))
    if left:
        print(f"warning: shared-memory segments left behind: {left}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
