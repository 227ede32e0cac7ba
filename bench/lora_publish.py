"""Adapter-only publish against full weights, side by side in one run: bytes per policy version and seconds from
the trainer's tensors to a generator running them, for a real model shape and LoRA rank.

    python -m bench.lora_publish                                   # Qwen3-1.7B shape, rank 16, every block's linear layer
    python -m bench.lora_publish --rank 16 --targets q_proj,v_proj
    python -m bench.lora_publish --model-shape tiny                # seconds, for a smoke test

Both ways take forge's shared-memory path (forge/weights/segment.py, as bench/publish_to_ready.py times it stage by
stage): cast to the generator dtype, checksum, write into /dev/shm, read back verified. Then
  full     the hf engine's load of a whole state dict (bench.publish_to_ready.publish_and_load)
  adapter  what the hf engine does with a LoRA version (actors/engines/lora_weights.py): every adapted layer set to
           its kept base + B @ A. The adapter is what a LoRA trainer publishes: A [rank, in] and B [out, rank] of
           each targeted layer, in HF names.
The generator copy is checked against a merge computed here after the adapter way, and equal to the source after
the full way. Median of `--repeats` runs of each, alternating.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from transformers import PreTrainedModel

from actors.engines import lora_weights
from actors.lora_config import LORA_TARGETS
from bench.publish_to_ready import DTYPES, SHAPES, Stages, build_model, check_equal, publish_and_load, qwen3_config
from forge.job import job_id
from forge.weights.checksums import CHECKSUM, checksums
from forge.weights.manifest import Manifest, layout
from forge.weights.publisher import gathered_on_host
from forge.weights.segment import SHM_DIR, create_segment, read_segment


def lora_adapter(model: PreTrainedModel, rank: int, targets: list[str], seed: int) -> dict[str, torch.Tensor]:
    """A trained-looking adapter in float32 (the trainer's parameters) on every layer whose name ends in a target."""
    gen = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, weight in model.named_parameters():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in targets:
            out_dim, in_dim = weight.shape
            adapter[module + lora_weights.LORA_A] = torch.randn(rank, in_dim, generator=gen) / in_dim ** 0.5
            adapter[module + lora_weights.LORA_B] = torch.randn(out_dim, rank, generator=gen) * 1e-3
    return adapter


def publish_adapter_and_merge(adapter: dict[str, torch.Tensor], target: PreTrainedModel,
                              base: dict[str, torch.Tensor], dtype: torch.dtype) -> Stages:
    """The adapter through a shared-memory segment in `dtype`, then merged onto `base` (the kept base weights) in
    `target`, as the hf engine swaps a LoRA version in."""
    stages = Stages(torch.device("cpu"), {})
    entries, size = layout(adapter, dtype)
    segment = create_segment(SHM_DIR / f"forge-{job_id()}-bench-lora-v0", size, 0, None)
    params = dict(target.named_parameters())
    try:
        for name, tensor in adapter.items():
            host = stages.timed("device->host", lambda: gathered_on_host(tensor, dtype))
            entries[name] = dataclasses.replace(entries[name], checksums=stages.timed(
                "checksum", lambda: checksums(host, CHECKSUM)))
            stages.timed("write", lambda: segment.write(host, entries[name].offset))
        segment.commit()
        fetched = stages.timed("read", lambda: read_segment(segment.path, Manifest(0, "", segment.path.name, False,
                                                                                  entries, CHECKSUM)))

        def merge() -> None:
            with torch.no_grad():
                for weight, (a, b) in lora_weights.adapter_pairs(fetched).items():
                    params[weight].data = lora_weights.merged(base[weight], a, b)

        stages.timed("load", merge)
    finally:
        segment.abort()
        segment.path.unlink(missing_ok=True)
    return stages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--rank", type=int, default=16)
    # lm_head is not a default: Qwen3-1.7B ties it to the embedding, where the trainer refuses an adapter on it.
    parser.add_argument("--targets", default=",".join(t for t in LORA_TARGETS["qwen3"] if t != "lm_head"),
                        help="comma-separated HF module names (default: every linear layer of the blocks)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="the generator's (published) dtype")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    args.targets = args.targets.split(",")
    unknown = sorted(set(args.targets) - set(LORA_TARGETS["qwen3"]))
    if unknown:
        parser.error(f"--targets: {unknown} are not qwen3 linear layers; allowed: {list(LORA_TARGETS['qwen3'])}")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    config = qwen3_config(args.model_shape)
    source = build_model(config, dtype, torch.device("cpu"), seed=0)
    target = build_model(config, dtype, torch.device("cpu"), seed=None)
    adapter = lora_adapter(source, args.rank, args.targets, seed=1)
    full_bytes = sum(t.numel() * t.element_size() for t in source.parameters())
    adapter_bytes = sum(t.numel() for t in adapter.values()) * dtype.itemsize
    full_runs, adapter_runs = [], []
    for _ in range(args.repeats):
        full_runs.append(publish_and_load(source, target, dtype))
        check_equal(source, target, dtype, "full")
        base = {n: p.detach().clone() for n, p in target.named_parameters()
                if n.removesuffix(".weight").rsplit(".", 1)[-1] in args.targets}  # the engine's kept base
        adapter_runs.append(publish_adapter_and_merge(adapter, target, base, dtype))
        published = {n: t.to(dtype) for n, t in adapter.items()}
        for weight, (a, b) in lora_weights.adapter_pairs(published).items():
            assert torch.equal(dict(target.named_parameters())[weight], lora_weights.merged(base[weight], a, b)), weight
        del base
    full_s = statistics.median(r.total for r in full_runs)
    adapter_s = statistics.median(r.total for r in adapter_runs)
    stages = list(full_runs[0].seconds)
    print(f"{args.model_shape}, {args.dtype}, LoRA rank {args.rank} on {','.join(args.targets)}; median of "
          f"{args.repeats} (publish to a generator running the version, shared-memory path, CPU)")
    print(f"| way | bytes per version | {' | '.join(stages)} | total s |")
    print(f"|---|---|{'---|' * len(stages)}---|")
    for label, runs, size in (("full weights", full_runs, full_bytes), ("adapter only", adapter_runs, adapter_bytes)):
        medians = [statistics.median(r.seconds.get(s, 0.0) for r in runs) for s in stages]
        print(f"| {label} | {size / 1e6:.1f} MB | {' | '.join(f'{m:.3f}' for m in medians)} | "
              f"{statistics.median(r.total for r in runs):.3f} |")
    moved = [s for s in stages if s != "load"]  # trainer to generator memory, before the engine applies it
    full_moved = statistics.median(sum(r.seconds.get(s, 0.0) for s in moved) for r in full_runs)
    adapter_moved = statistics.median(sum(r.seconds.get(s, 0.0) for s in moved) for r in adapter_runs)
    print(f"full / adapter: {full_bytes / adapter_bytes:.0f}x the bytes; {full_moved / adapter_moved:.1f}x the seconds "
          f"to move a version ({full_moved:.3f} s vs {adapter_moved:.3f} s); {full_s / adapter_s:.2f}x the seconds "
          "with the engine's apply (adapter 'load' = merging onto the kept base)")
    return dict(full_bytes=full_bytes, adapter_bytes=adapter_bytes, full_s=full_s, adapter_s=adapter_s)


if __name__ == "__main__":
    main()
