"""Weight sync: publish a ~1 GB HF-named state dict from one process and make it ready in 2 generator
processes, three ways, side by side in one run.

    cd <repo> && .venv/bin/python -m bench.weight_sync --size-gb 1.0 --dtypes bf16,fp32 --repeats 3

With `--hosts 2` the publisher and the readers run on two simulated hosts instead (bench/weight_sync_hosts.py).

(a) forge: `WeightStore.publish` (shared memory) in the publisher, `WeightStore.fetch(v, into=...)` in
    both readers.
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from forge import compat, provisioner
from forge.actor import ForgeActor, endpoint
from forge.weight_store import SHM_DIR, WeightStore, job_id
from monarch.actor import current_rank  # after forge.compat, which makes Monarch importable

ts = compat.import_torchstore()

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SWAP_MODES = ("copy", "pointer")


def qwen3_layer_shapes(layer: int, hidden: int = 2048, intermediate: int = 6144, kv_dim: int = 1024) -> dict:
    """One decoder layer of Qwen3-1.7B, in HF names: seven 2-D projections of 4-25 M elements, plus norms."""
    prefix = f"model.layers.{layer}"
    return {
        f"{prefix}.input_layernorm.weight": (hidden,),
        f"{prefix}.self_attn.q_proj.weight": (hidden, hidden),
        f"{prefix}.self_attn.k_proj.weight": (kv_dim, hidden),
        f"{prefix}.self_attn.v_proj.weight": (kv_dim, hidden),
        f"{prefix}.self_attn.o_proj.weight": (hidden, hidden),
        f"{prefix}.self_attn.q_norm.weight": (128,),
        f"{prefix}.self_attn.k_norm.weight": (128,),
        f"{prefix}.post_attention_layernorm.weight": (hidden,),
        f"{prefix}.mlp.gate_proj.weight": (intermediate, hidden),
        f"{prefix}.mlp.up_proj.weight": (intermediate, hidden),
        f"{prefix}.mlp.down_proj.weight": (hidden, intermediate),
    }


def state_dict_shapes(size_gb: float, dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    """As many Qwen3-1.7B layers as come closest to `size_gb` (at least one)."""
    per_layer = sum(_numel(s) for s in qwen3_layer_shapes(0).values()) * dtype.itemsize
    layers = max(1, round(size_gb * 1e9 / per_layer))
    return {name: shape for layer in range(layers) for name, shape in qwen3_layer_shapes(layer).items()}


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _fingerprint(tensors: dict[str, torch.Tensor]) -> list[float]:
    """Cheap identity of a state dict: every tensor's first and last element (set per version by the publisher)."""
    return [float(v) for t in tensors.values() for v in (t.reshape(-1)[0], t.reshape(-1)[-1])]


async def _delete_torchstore_prefix(prefix: str) -> None:
    # torchstore 0.1.2 has no call that deletes a state dict, and keys(prefix) misses: filter by hand.
    for key in await ts.keys():
        if key.startswith(prefix):
            await ts.delete(key)


class Publisher(ForgeActor):
    """The trainer's side: holds the state dict and publishes it."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    @endpoint
    async def build(self, shapes: dict[str, tuple[int, ...]], dtype: str) -> int:
        generator = torch.Generator().manual_seed(0)
        self.weights = {n: torch.randn(s, generator=generator).to(DTYPES[dtype]) for n, s in shapes.items()}
        return _nbytes(self.weights)

    @endpoint
    async def mark(self, version: int) -> list[float]:
        """Stamp `version` into every tensor's ends, so readers can prove they hold this version."""
        for tensor in self.weights.values():
            flat = tensor.view(-1)
            flat[0], flat[-1] = version, -version
        return _fingerprint(self.weights)

    @endpoint
    async def publish_forge(self, namespace: str, version: int) -> None:
        await WeightStore(namespace, transport="shm").publish(self.weights, version)

    @endpoint
    async def publish_torchstore(self, key: str) -> None:
        await ts.put_state_dict(self.weights, key)

    @endpoint
    async def free(self) -> None:
        self.weights = {}


class Reader(ForgeActor):
    """A generator's side: pre-allocated engine weights, a staging copy, and (rank 0) a decode loop."""

    def __init__(self) -> None:
        torch.set_num_threads(1)  # as forge's Generator on CPU (torch_threads=1)
        self.live: dict[str, torch.Tensor] = {}
        self.staging: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()  # the engine's weights lock: held by each decode step and by the swap
        self.steps: list[tuple[float, float, float]] = []  # (start, end, seconds waiting for the lock)
        self.generating = False
        self.thread: threading.Thread | None = None

    @endpoint
    async def allocate(self, shapes: dict[str, tuple[int, ...]], dtype: str, staging: bool = True) -> None:
        """The engine's weights, and (`staging`) the buffer a swap mode fetches into first."""
        self.live = {n: torch.zeros(s, dtype=DTYPES[dtype]) for n, s in shapes.items()}
        self.staging = {n: torch.zeros_like(t) for n, t in self.live.items()} if staging else {}

    @endpoint
    async def free(self) -> None:
        self.live, self.staging = {}, {}

    @endpoint
    async def fingerprint(self) -> list[float]:
        return _fingerprint(self.live)

    @endpoint
    async def fetch_forge(self, namespace: str, version: int, swap: str | None) -> None:
        """Make `version` ready in the live weights: fetched straight into them, or staged and swapped."""
        store = WeightStore(namespace, transport="shm")
        if swap is None:
            await store.fetch(version, into=self.live)
        else:
            await store.fetch(version, into=self.staging)
            await asyncio.to_thread(self._swap, swap)

    @endpoint
    async def fetch_torchstore(self, key: str, swap: str | None) -> None:
        if swap is None:
            await ts.get_state_dict(key, user_state_dict=self.live)
        else:
            await ts.get_state_dict(key, user_state_dict=self.staging)
            await asyncio.to_thread(self._swap, swap)

    def _swap(self, mode: str) -> None:
        with self.lock, torch.no_grad():
            if mode == "copy":
                for name, tensor in self.live.items():
                    tensor.copy_(self.staging[name])
            else:
                self.live, self.staging = self.staging, self.live

    @endpoint
    async def start_generation(self, size: int, gpu_wait_s: float) -> None:
        if current_rank().rank != 0:
            return
        self.steps, self.generating = [], True
        self.thread = threading.Thread(target=self._decode_loop, args=(size, gpu_wait_s), daemon=True)
        self.thread.start()

    @endpoint
    async def stop_generation(self) -> list[tuple[float, float, float]]:
        if self.thread is None:
            return []
        self.generating = False
        await asyncio.to_thread(self.thread.join)
        self.thread = None
        return self.steps

    def _decode_loop(self, size: int, gpu_wait_s: float) -> None:
        x, w = torch.randn(size, size), torch.randn(size, size)
        while self.generating:
            start = time.perf_counter()
            with self.lock:
                acquired = time.perf_counter()
                x = torch.tanh(x @ w)
                time.sleep(gpu_wait_s)
            self.steps.append((start, time.perf_counter(), acquired - start))


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

    async def _check(self, expected: list[float], path: str) -> None:
        for rank, got in (await self.readers.fingerprint.call()).items():
            if got != expected:
                raise RuntimeError(f"{path}: reader {rank} does not hold version {self.version} after the update")

    async def forge_once(self, swap: str | None = None) -> tuple[float, float, float]:
        """(start, published, ready) times of one version through path (a)."""
        self.version += 1
        expected = await self.publisher.mark.call_one(self.version)
        start = time.perf_counter()
        await self.publisher.publish_forge.call_one(self.namespace, self.version)
        published = time.perf_counter()
        await self.readers.fetch_forge.call(self.namespace, self.version, swap)
        end = time.perf_counter()
        await self._check(expected, "forge")
        await WeightStore(self.namespace).delete(self.version)
        return start, published, end

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
        await _delete_torchstore_prefix(key + "/")
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
    await provisioner.get_provisioner().start_weight_store()
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
        await publisher.free.call_one()
        await readers.free.call()
        copy_s = memcpy_seconds(shapes, DTYPES[dtype], args.repeats)
        rows.append({"dtype": dtype, "gb": nbytes / 1e9, "tensors": len(shapes), "forge": forge,
                     "torchstore": torchstore, "copy": (copy_s, copy_s, 0.0), "stalls": stalls})
        print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    gb = row["gb"]
    print(f"\n{row['dtype']}: {gb:.3f} GB in {row['tensors']} tensors; publish-to-ready, median")
    print(f"  {'path':<46}{'seconds':>9}{'GB/s':>8}{'publish s':>11}{'fetch s':>9}")
    for label, key in (("(a) forge WeightStore (shm), 2 readers", "forge"),
                       ("(b) torchstore put/get_state_dict, 2 readers", "torchstore"),
                       ("(c) in-memory copy, 1 thread (limit)", "copy")):
        total, publish, fetch = row[key]
        print(f"  {label:<46}{total:>9.3f}{gb / total:>8.2f}{publish:>11.3f}{fetch:>9.3f}")
    speedup, gap = row["torchstore"][0] / row["forge"][0], row["forge"][0] / row["copy"][0]
    print(f"  (b)/(a) = {speedup:.1f}x (target >= 5: {'met' if speedup >= 5 else 'MISSED'});"
          f"  (a)/(c) = {gap:.2f}x (target <= 4: {'met' if gap <= 4 else 'MISSED'})")
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
    args = parser.parse_args(argv)
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
