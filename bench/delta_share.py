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
"""

from __future__ import annotations

import argparse
import time
import zlib

import numpy
import torch

from transformers import AutoModelForCausalLM, Qwen3Config

from bench.publish_to_ready import DTYPES, SHAPES, qwen3_config
from rl.tiny_model import tiny_config


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", default="qwen3-1.7b", choices=sorted([*SHAPES, "forge-tiny"]))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (memory and time on CPU)")
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    parser.add_argument("--publish-dtypes", default="bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    args.publish_dtypes = [DTYPES[x] for x in args.publish_dtypes.split(",")]
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need >= 2 (the first step leaves Adam's bias correction)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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


if __name__ == "__main__":
    main()
