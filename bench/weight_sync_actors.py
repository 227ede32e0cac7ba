"""The weight-sync benches' shared parts: the model shapes they publish, and the Publisher and Reader actors
(bench/weight_sync.py on one host, bench/weight_sync_hosts.py across two)."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from forge import compat
from forge.actor import ForgeActor, endpoint
from forge.weights.store import WeightStore
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


async def delete_torchstore_prefix(prefix: str) -> None:
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
        return self.stamp(version)

    def stamp(self, version: int) -> list[float]:
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
    async def fetch_forge_views(self, namespace: str, version: int) -> None:
        """Make `version` the live weights as forge's Generator does: views of its segment (no copy), swapped in
        by pointer; the previous version's views are dropped, and with them their lease on its file."""
        fetched = await WeightStore(namespace, transport="shm").fetch(version)
        with self.lock:
            self.live = fetched

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
