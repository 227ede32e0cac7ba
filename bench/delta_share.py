"""How much of a published weight changes from one policy version to the next, and what a delta costs.

    python -m bench.delta_share --model-shape qwen3-1.7b --layers 2 --lrs 1e-6,1e-5,1e-4 --steps 4
    python -m bench.delta_share --model-shape forge-tiny --lrs 3e-4 --publish-dtypes bfloat16,float32 --steps 4

The trainer keeps fp32 master weights and publishes them in `publish_dtype`; a published element changes only
when its master value crosses a rounding boundary of that dtype. Each step here is a real Adam step (the
trainer's optimizer, fp32 master weights) on a causal-LM loss over random tokens, from transformers' own random
initialization (no hub here: trained weights have similar magnitudes). The 1.7B shape keeps its full vocabulary
(tied embeddings) and `--layers` of its 28 decoder layers, said in the output; `forge-tiny` is the model
`configs/grpo_tiny.yaml` trains (rl/tiny_model.py), at that config's trainer lr 3e-4.

Per step it prints the share of changed elements and the bytes of a full copy against three delta encodings:
sparse (int32 index + value per changed element), bitmask (one bit per element + the changed values) and
XOR of the bit patterns compressed with zlib level 1 (the fastest compressor installed), with the time each
takes to encode on one core.

With `--store`, each step's weights are also published through the weight store's host path (shared memory) twice,
side by side, in alternating order: without deltas and with them (`DeltaSync(enabled=True)`), each fetched by a reader
store of this process into pre-allocated tensors that it keeps across versions (a generator's). It prints the
bytes stored per version and publish-to-ready (publish + fetch, both verified) of each:

    python -m bench.delta_share --model-shape qwen3-1.7b --layers 2 --lrs 1e-6,1e-5,1e-4 --steps 4 --store
"""

from __future__ import annotations

import argparse
import asyncio
import time
import zlib

import numpy
import torch

from transformers import AutoModelForCausalLM, Qwen3Config

from bench.publish_to_ready import DTYPES, SHAPES, qwen3_config
from forge import provisioner
from forge.weights.store import DeltaSync, WeightStore
from rl.tiny_model import tiny_config
from forge.weights.startup import start_weight_store


def changed_mask(previous: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Bitwise inequality (NaN-safe, -0.0 != +0.0): what a reader must rewrite to hold `new`."""
    bits = {2: torch.int16, 4: torch.int32}[new.element_size()]
    return previous.view(bits) != new.view(bits)


def encoded_bytes(previous: torch.Tensor, new: torch.Tensor) -> tuple[int, dict[str, tuple[int, float]]]:
    """The changed elements of one tensor, and encoding -> (bytes, seconds to encode)."""
    out: dict[str, tuple[int, float]] = {}
    start = time.perf_counter()
    mask = changed_mask(previous, new).flatten()
    changed = int(mask.sum())
    out["sparse"] = (changed * (4 + new.element_size()), time.perf_counter() - start)
    start = time.perf_counter()
    packed = torch.from_numpy(numpy.packbits(mask.numpy()))
    values = new.flatten()[mask]
    out["bitmask"] = (packed.numel() + values.numel() * new.element_size(), time.perf_counter() - start)
    start = time.perf_counter()
    bits = {2: torch.int16, 4: torch.int32}[new.element_size()]
    xor = (previous.view(bits) ^ new.view(bits)).flatten().numpy().tobytes()
    out["xor+zlib1"] = (len(zlib.compress(xor, 1)), time.perf_counter() - start)
    return changed, out


def published(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(dtype, copy=True) for name, p in model.named_parameters()}


class StorePaths:
    """The host path without and with deltas: a publisher store and a reader store each, the reader's tensors kept."""

    def __init__(self, lr: float) -> None:
        self.stores = {way: (WeightStore(f"bench-delta-{way}-{lr:g}", transport="shm", delta=DeltaSync(enabled=on)),
                             WeightStore(f"bench-delta-{way}-{lr:g}", transport="shm"))
                       for way, on in (("full", False), ("delta", True))}
        self.into: dict[str, dict[str, torch.Tensor]] = {}

    async def publish_and_fetch(self, way: str, weights: dict[str, torch.Tensor], version: int,
                                dtype: torch.dtype) -> tuple[int, float]:
        """(bytes stored, publish-to-ready seconds) of one version through `way`."""
        publisher, reader = self.stores[way]
        into = self.into.setdefault(way, {n: torch.empty(t.shape, dtype=dtype) for n, t in weights.items()})
        start = time.perf_counter()
        manifest = await publisher.publish(weights, version, dtype=dtype)
        await reader.fetch(version, into=into)
        seconds = time.perf_counter() - start
        await publisher.delete_older_than(version)
        for name, tensor in weights.items():
            if not torch.equal(into[name].view(torch.int16), tensor.detach().to(dtype).view(torch.int16)):
                raise RuntimeError(f"{way}: the reader's {name} differs from version {version} as published")
        return manifest.nbytes, seconds

    async def step(self, weights: dict[str, torch.Tensor], version: int, dtype: torch.dtype) -> str:
        ways = ("full", "delta") if version % 2 else ("delta", "full")  # alternated: neither always goes first
        measured = {way: await self.publish_and_fetch(way, weights, version, dtype) for way in ways}
        return "; ".join(f"{way}: {measured[way][0] / 1e6:.1f} MB stored, publish-to-ready {measured[way][1]:.3f} s"
                         for way in ("full", "delta"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", default="qwen3-1.7b", choices=sorted([*SHAPES, "forge-tiny"]))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (memory and time on CPU)")
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    parser.add_argument("--publish-dtypes", default="bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", action="store_true",
                        help="also publish every version through the weight store's host path, without and with deltas")
    args = parser.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    args.publish_dtypes = [DTYPES[x] for x in args.publish_dtypes.split(",")]
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need >= 2 (the first step leaves Adam's bias correction)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.store:
        measure(args)
        return

    async def with_store() -> None:
        await start_weight_store()
        try:
            await asyncio.to_thread(measure, args, asyncio.get_running_loop())
        finally:
            await provisioner.shutdown()

    asyncio.run(with_store())


def measure(args: argparse.Namespace, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """The Adam steps and their shares (and, given the event loop of the weight store, the store's paths)."""
    config = Qwen3Config(**tiny_config()) if args.model_shape == "forge-tiny" else qwen3_config(args.model_shape)
    kept = min(args.layers, config.num_hidden_layers)
    config.num_hidden_layers = kept
    for lr in args.lrs:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
        numel = sum(p.numel() for p in model.parameters())
        print(f"{args.model_shape}, {kept} decoder layers, {numel / 1e6:.1f}M parameters (fp32 master), Adam lr {lr:g}",
              flush=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        paths = StorePaths(lr) if loop is not None else None
        if paths is not None:  # version 0: the initial weights, full on both paths
            asyncio.run_coroutine_threadsafe(paths.step(dict(model.named_parameters()), 0, args.publish_dtypes[0]),
                                             loop).result()
        previous = {dtype: published(model, dtype) for dtype in args.publish_dtypes}
        tokens = torch.randint(0, config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(args.seed))
        for step in range(1, args.steps + 1):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for dtype in args.publish_dtypes:
                new = published(model, dtype)
                totals = {"full": [0, 0.0], "sparse": [0, 0.0], "bitmask": [0, 0.0], "xor+zlib1": [0, 0.0]}
                changed = 0
                for name, tensor in new.items():
                    count, encodings = encoded_bytes(previous[dtype][name], tensor)
                    changed += count
                    totals["full"][0] += tensor.numel() * tensor.element_size()
                    for encoding, (size, seconds) in encodings.items():
                        totals[encoding][0] += size
                        totals[encoding][1] += seconds
                previous[dtype] = new
                full = totals["full"][0]
                sizes = ", ".join(f"{k} {v[0] / 1e6:.1f} MB ({v[0] / full:.1%}, {v[1]:.2f} s)"
                                  for k, v in totals.items() if k != "full")
                print(f"  step {step} loss {loss.item():.3f} {str(dtype).removeprefix('torch.')}: "
                      f"{changed / numel:.2%} of elements changed; full {full / 1e6:.1f} MB; {sizes}", flush=True)
            if paths is not None:
                stored = asyncio.run_coroutine_threadsafe(
                    paths.step(dict(model.named_parameters()), step, args.publish_dtypes[0]), loop).result()
                print(f"    weight store, host path, {str(args.publish_dtypes[0]).removeprefix('torch.')}: {stored}",
                      flush=True)


if __name__ == "__main__":
    main()
