"""Publish-to-ready for a real model shape, with no actors: how long from a trainer's weights on a device to a
second copy of the model (a generator's) holding them, stage by stage, beside two references in the same run.

    python -m bench.publish_to_ready --model-shape qwen3-1.7b                   # bf16, on CPU
    python -m bench.publish_to_ready --model-shape qwen3-8b --device cuda
    python -m bench.publish_to_ready --model-shape tiny --trainer-dtype float32  # the publish casts to bf16

It builds a Qwen3 model of that shape with random weights from a config it writes (no hub) on `--device` (the
trainer's), and an empty second copy there (the generator's). The weights then go the way forge moves them
(forge/weights/segment.py, the shared-memory path of the weight store), timed per stage:
  device->host  each tensor cast to the generator dtype on its device and copied to host memory, one at a time
  checksum      a hash of every tensor (xxh3-64, or crc32 without xxhash), taken once at publish
  write         pwrite into one shared-memory segment in /dev/shm
  read          preadv from the segment into fresh host tensors, every piece verified against its checksum
  host->device  those tensors copied to the generator's device
  load          the generator model's check of the state dict (actors/engines/weights.py) and load_state_dict
References, on the same weights in the same run:
  raw copy      the same bytes device->host->device into the generator's parameters, nothing else (the limit;
                pinned host memory on CUDA)
  torch.save    the naive way: torch.save of the cast state dict to /dev/shm, torch.load, load_state_dict
The forge path runs twice: the first publish writes fresh shared memory (the job's first version), the second
rewrites that file (what the weight store does from then on: a deleted version's file is reused); the table shows
the second, with the first beside it. The bench checks that the generator copy equals the source (cast to the
generator dtype) after each way.

Needs only torch and transformers (no Monarch, torchstore, torchtitan or vLLM), so it runs unchanged on a GPU
machine that has nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from actors.engines.weights import check_state_dict, hf_weight_specs
from forge.job import job_id
from forge.weights.checksums import CHECKSUM, checksums
from forge.weights.manifest import Manifest, layout
from forge.weights.publisher import gathered_on_host
from forge.weights.segment import SHM_DIR, create_segment, read_segment

# Qwen3 dimensions (the published config.json of each model); "tiny" is for tests.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def qwen3_config(shape: str) -> Qwen3Config:
    if shape not in SHAPES:
        raise ValueError(f"--model-shape={shape!r}: must be one of {sorted(SHAPES)}")
    return Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def build_model(config: Qwen3Config, dtype: torch.dtype, device: torch.device, seed: int | None) -> PreTrainedModel:
    """A model of `config` on `device`: random weights (normal, std 0.02) from `seed`, or left uninitialized
    (a generator's copy, about to be loaded) when `seed` is None."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    if seed is not None:
        generator = torch.Generator(device).manual_seed(seed)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def published_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What a trainer publishes: every HF-named parameter once (a tied lm_head is left out, as checkpoints do)."""
    return {name: tensor for name, tensor in model.named_parameters()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Stages:
    """Seconds per stage, in the order they ran."""

    device: torch.device
    seconds: dict[str, float]

    def timed(self, stage: str, work: Callable[[], object]) -> object:
        synchronize(self.device)
        start = time.perf_counter()
        result = work()
        synchronize(self.device)
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
        return result

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def load_into(model: PreTrainedModel, weights: dict[str, torch.Tensor]) -> None:
    """As a generator takes a version: the engines' state-dict check, then the tensors taken over by the model
    (no copy when dtype and device match; tied weights tied again)."""
    specs, required = hf_weight_specs(model)
    check_state_dict(weights, 0, specs, required, "publish_to_ready", current_version=-1)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()


def publish_and_load(source: PreTrainedModel, target: PreTrainedModel, dtype: torch.dtype,
                     spare: Path | None = None) -> Stages:
    """The forge path: publish `source`'s weights through a shared-memory segment in `dtype`, one tensor at a
    time, and load them into `target`. The segment is written into the file at `spare` when there is one (as
    the weight store rewrites a deleted version's file) and left there afterwards; without `spare` it is
    written into fresh shared memory and removed."""
    device = next(target.parameters()).device
    stages = Stages(device, {})
    state_dict = published_state_dict(source)
    entries, size = layout(state_dict, dtype)
    segment = create_segment(SHM_DIR / f"forge-{job_id()}-bench-publish-v0", size, 0, spare)
    try:
        for name, tensor in state_dict.items():
            host = stages.timed("device->host", lambda: gathered_on_host(tensor, dtype))
            sums = stages.timed("checksum", lambda: checksums(host, CHECKSUM))
            entries[name] = dataclasses.replace(entries[name], checksums=sums)
            stages.timed("write", lambda: segment.write(host, entries[name].offset))
            del host
        segment.commit()
        manifest = Manifest(0, "", segment.path.name, False, entries, CHECKSUM)
        fetched = stages.timed("read", lambda: read_segment(segment.path, manifest))
        on_device = stages.timed("host->device", lambda: {n: t.to(device) for n, t in fetched.items()})
        del fetched
        stages.timed("load", lambda: load_into(target, on_device))
    finally:
        segment.abort()
        if spare is not None and segment.path.exists():
            segment.path.replace(spare)
        segment.path.unlink(missing_ok=True)
    return stages


def raw_copy(source: PreTrainedModel, target: PreTrainedModel, dtype: torch.dtype) -> float:
    """Seconds to copy the published bytes device->host->device into `target`'s parameters, nothing else."""
    device = next(source.parameters()).device
    weights = {name: tensor.detach().to(dtype) for name, tensor in published_state_dict(source).items()}
    pin = device.type == "cuda"
    host = {name: torch.empty_like(tensor, device="cpu", pin_memory=pin) for name, tensor in weights.items()}
    params = dict(target.named_parameters())

    @torch.no_grad()
    def copy_there_and_back() -> None:
        for name, tensor in weights.items():
            host[name].copy_(tensor, non_blocking=pin)
        for name, tensor in host.items():
            params[name].copy_(tensor, non_blocking=pin)

    stages = Stages(device, {})
    stages.timed("raw", copy_there_and_back)
    return stages.total


def save_and_load(source: PreTrainedModel, target: PreTrainedModel, dtype: torch.dtype) -> float:
    """Seconds for the naive way: torch.save of the cast state dict to /dev/shm, torch.load, load_state_dict."""
    device = next(target.parameters()).device
    path = SHM_DIR / f"forge-{job_id()}-bench-torch-save.pt"
    stages = Stages(device, {})
    try:
        stages.timed("save", lambda: torch.save({n: t.detach().to(dtype).cpu()
                                                 for n, t in published_state_dict(source).items()}, path))
        stages.timed("load", lambda: load_into(target, torch.load(path, map_location=device, weights_only=True)))
    finally:
        path.unlink(missing_ok=True)
    return stages.total


def check_equal(source: PreTrainedModel, target: PreTrainedModel, dtype: torch.dtype, way: str) -> None:
    """Raise unless `target` holds `source`'s weights cast to `dtype`, tied ones included."""
    expected = source.state_dict()
    for name, tensor in target.state_dict().items():
        if tensor.dtype != dtype or not torch.equal(tensor, expected[name].to(dtype)):
            raise AssertionError(f"after {way}: {name} in the generator copy differs from the published weights")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="the generator's dtype")
    parser.add_argument("--trainer-dtype", default=None, choices=sorted(DTYPES),
                        help="the trainer's parameter dtype (default: --dtype)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda: CUDA is not available on this host; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dtype, trainer_dtype = DTYPES[args.dtype], DTYPES[args.trainer_dtype or args.dtype]
    config = qwen3_config(args.model_shape)
    source = build_model(config, trainer_dtype, device, seed=0)
    target = build_model(config, dtype, device, seed=None)
    nbytes = sum(t.numel() for t in published_state_dict(source).values()) * dtype.itemsize
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"publish-to-ready: {args.model_shape}, {nbytes / 1e9:.3f} GB published in {args.dtype} "
          f"(trainer {args.trainer_dtype or args.dtype}) on {name}, torch {torch.__version__}, "
          f"{len(os.sched_getaffinity(0))} cores, {CHECKSUM} checksums", flush=True)

    spare = SHM_DIR / f"forge-{job_id()}-bench-spare"
    try:
        first = publish_and_load(source, target, dtype, spare)  # fresh shared memory: the job's first publish
        check_equal(source, target, dtype, "the forge path (first publish)")
        del target
        target = build_model(config, dtype, device, seed=None)
        stages = publish_and_load(source, target, dtype, spare)  # the file rewritten: every later publish
        check_equal(source, target, dtype, "the forge path")
    finally:
        spare.unlink(missing_ok=True)
    del target
    target = build_model(config, dtype, device, seed=None)
    raw = raw_copy(source, target, dtype)
    check_equal(source, target, dtype, "the raw copy")
    del target
    target = build_model(config, dtype, device, seed=None)
    naive = save_and_load(source, target, dtype)
    check_equal(source, target, dtype, "torch.save/torch.load")

    print(f"{'stage':<14}{'seconds':>9}{'GB/s':>8}{'first publish s':>17}")
    for stage, seconds in stages.seconds.items():
        print(f"{stage:<14}{seconds:>9.3f}{nbytes / 1e9 / seconds:>8.2f}{first.seconds[stage]:>17.3f}")
    print(f"{'total':<14}{stages.total:>9.3f}{nbytes / 1e9 / stages.total:>8.2f}{first.total:>17.3f}")
    print(f"{'raw copy':<14}{raw:>9.3f}{nbytes / 1e9 / raw:>8.2f}   total / raw copy = {stages.total / raw:.2f}x "
          f"(first publish {first.total / raw:.2f}x)")
    print(f"{'torch.save':<14}{naive:>9.3f}{nbytes / 1e9 / naive:>8.2f}   total / torch.save+load = "
          f"{stages.total / naive:.2f}x (first publish {first.total / naive:.2f}x)")
    print("the generator copy equals the published weights after each way")
    return {**stages.seconds, "total": stages.total, "first publish total": first.total, "raw copy": raw,
            "torch.save": naive}


if __name__ == "__main__":
    main()
