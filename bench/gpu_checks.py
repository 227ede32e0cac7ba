"""forge on one GPU in one run: the parity measurements the gpu tests' tolerances come from, and the figures of
docs/gpus.md (publish-to-ready, hf engine tokens/s, trainer tokens/s and peak memory), as one table.

    python -m bench.gpu_checks --device cuda --log gpu_log.txt      # what docs/gpus.md reports
    python -m bench.gpu_checks --device cpu --small                  # the same code on tiny shapes, no GPU

Each part runs on its own: one that fails prints its traceback and the run goes on with the next, so a single
run on a lent machine gives every figure it can. Parts that would start after `--deadline` seconds are skipped
(and say so). Real model shapes get random weights (normal, std 0.02; no hub): speeds and memory are the
shape's, not a trained model's. The gpu tests (tests/gpu) import the measuring functions from here, so what the
table shows is what they assert.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rl.sampling import SamplingParams

# The parity model: the tiny Qwen3 of the tests, wider and deeper, with weights spread wider than the default
# init (std 0.1, not 0.02) so next-token distributions are peaked as a trained model's, not near uniform:
# rounding differences show in log-probs as they would in a real run.
PARITY_MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=32, max_position_embeddings=512, initializer_range=0.1)
# Plain sampling (temperature 1, full vocabulary) and truncated sampling (temperature, top-k and top-p), whose
# kept sets the trainer renormalises over.
SAMPLINGS = {
    "t1": dict(temperature=1.0),
    "t0.8-topk40-topp0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
}


def parity_prompts(count: int = 8, vocab: int = 99, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths (5..40 tokens; the engine left-pads them) of ordinary token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (5 + (i * 5) % 36,), generator=gen).tolist() for i in range(count)]


def build_parity_checkpoint(path: str | Path) -> Path:
    from rl.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(path, seed=0, **PARITY_MODEL)


@dataclass
class Parity:
    """|behaviour log-prob - teacher-forced log-prob| over every generated token."""

    tokens: int
    trainer_max: float  # the engine's log-probs vs the trainer's (TitanTrainer.logprobs: what the loss sees)
    trainer_mean: float
    forward_max: float  # the engine's vs the same HF model's teacher-forced forward (decode vs one full pass)
    forward_mean: float


def logprob_parity(checkpoint: Path, *, device: str, dtype: str, sampling: str, max_tokens: int = 48) -> Parity:
    """Generate with the hf engine, then score the same tokens teacher-forced with the trainer (torchtitan model,
    `actors.logprobs.token_logprobs`) and with the engine's own HF model in one forward pass."""
    from actors.engines.hf import HFEngine
    from actors.logprobs import token_logprobs
    from actors.titan_trainer import TitanTrainer
    from actors.trainer_config import TrainerConfig
    from rl.types import Episode, TrainBatch

    params = SamplingParams(n=2, max_tokens=max_tokens, seed=0, **SAMPLINGS[sampling])
    engine = HFEngine(checkpoint, dtype=dtype, device=device, seed=0, kv_reuse_tokens=0)
    completions = [c for group in engine.generate(parity_prompts(), params) for c in group]
    episodes = [Episode.from_completion(c, episode_id=i, group_id=i, reward=0.0) for i, c in enumerate(completions)]
    batch = TrainBatch.from_episodes(episodes, pad_id=engine.pad_token_id)
    mask = batch.response_mask > 0
    behaviour = batch.behaviour_logprobs[mask]

    with torch.no_grad():  # right padding: a causal model's earlier logits ignore it
        logits = engine.model(input_ids=batch.input_ids.to(engine.device)).logits[:, :-1]
        kept = None if batch.kept_token_ids is None else batch.kept_token_ids.to(engine.device)
        forward = token_logprobs(logits, batch.input_ids[:, 1:].to(engine.device), params.temperature, kept).cpu()
    del engine, logits

    trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint), dtype=dtype, device=device,
                                         temperature=params.temperature, micro_batch_size=8))
    scored = trainer.logprobs(batch)
    del trainer
    empty_cache(device)
    trainer_diff = (scored[mask] - behaviour).abs()
    forward_diff = (forward[mask] - behaviour).abs()
    return Parity(int(mask.sum()), float(trainer_diff.max()), float(trainer_diff.mean()),
                  float(forward_diff.max()), float(forward_diff.mean()))


def step_batch(rows: int = 8, length: int = 40, vocab: int = 99, prompt: int = 8, seed: int = 0):
    """A right-padded RL batch of random tokens with responses of different lengths and mixed advantages."""
    from rl.types import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, length), generator=gen)
    response_mask = torch.zeros(rows, length - 1)
    for row in range(rows):
        end = length - 1 - 3 * (row % 4)
        response_mask[row, prompt - 1 : end] = 1
        input_ids[row, end + 1 :] = 0
    return TrainBatch(input_ids=input_ids, response_mask=response_mask,
                      behaviour_logprobs=torch.full((rows, length - 1), -4.0),
                      policy_versions=torch.where(response_mask > 0, 0, -1).long(),
                      advantages=torch.randn(rows, generator=gen), rewards=torch.rand(rows, generator=gen))


def trainer_step(checkpoint: Path, *, device: str, dtype: str, batch, micro_batch_size: int = 3) -> dict[str, float]:
    """One TitanTrainer.train_step (GRPO, micro-batched: the exact-accumulation path with its recomputation): its
    metrics, 'policy_version' (the trainer's after the step) and 'logprobs_after', the batch's log-probs after the
    step. A small lr: Adam's first update is about lr * sign(g), so a gradient element near 0 whose sign rounding
    flips moves its weight by 2 * lr."""
    from actors.titan_trainer import TitanTrainer
    from actors.trainer_config import TrainerConfig

    trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint), dtype=dtype, device=device, loss="grpo",
                                         lr=1e-5, eps=1e-6, micro_batch_size=micro_batch_size))
    metrics = trainer.train_step(batch)
    after, version = trainer.logprobs(batch), trainer.policy_version
    del trainer
    empty_cache(device)
    return {**metrics, "policy_version": version, "logprobs_after": after}


def publish_round_trip(*, device: str, trainer_dtype: torch.dtype, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """bench.publish_to_ready's forge path (device->host, checksum, shared memory, host->device, load) for the
    tiny shape; raises unless the generator copy equals the source cast to `dtype`. Returns the copy's weights."""
    from bench.publish_to_ready import build_model, check_equal, publish_and_load, qwen3_config

    config = qwen3_config("tiny")
    source = build_model(config, trainer_dtype, torch.device(device), seed=0)
    target = build_model(config, dtype, torch.device(device), seed=None)
    publish_and_load(source, target, dtype)
    check_equal(source, target, dtype, "the forge path")
    return dict(target.state_dict())


def empty_cache(device: str) -> None:
    gc.collect()  # a model in a reference cycle would hold its GPU memory until the next collection
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ----- figures on real shapes ---------------------------------------------------------------------------------


def write_shape_checkpoint(shape: str, path: Path, device: str) -> Path:
    """A HF checkpoint of a Qwen3 shape (bench.publish_to_ready.SHAPES) with random bf16 weights and the tiny
    character tokenizer: what HFEngine and TitanTrainer load."""
    from bench.publish_to_ready import build_model, qwen3_config
    from rl.tiny_model import build_tokenizer

    model = build_model(qwen3_config(shape), torch.bfloat16, torch.device(device), seed=0)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    del model
    empty_cache(device)
    return path


def engine_throughput(checkpoint: Path, *, device: str, batches: tuple[int, ...], prompt_len: int,
                      max_tokens: int) -> list[dict]:
    """Tokens/s of HFEngine (bf16) per batch size, with KV reuse off and on: turn 1 generates `max_tokens` after a
    `prompt_len`-token prompt; turn 2's prompt is turn 1's prompt, its completion and 32 new tokens (a multi-turn
    episode's next turn: with reuse, only the suffix is prefilled)."""
    from actors.engines.hf import KV_REUSE_TOKENS, HFEngine

    rows = []
    for reuse in (0, KV_REUSE_TOKENS):
        engine = HFEngine(checkpoint, dtype="bfloat16", device=device, seed=0, kv_reuse_tokens=reuse)
        vocab = engine.model.config.vocab_size
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            # The same two turns on other prompts first, untimed: the process's first pass over each shape (kernel
            # selection, allocator growth, the KV pool's growth) is not what a running generator pays.
            for timed in (False, True):
                prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
                row = {"batch": batch, "kv_reuse": bool(reuse)}
                for turn in (1, 2):
                    completions, row[f"turn{turn}_s"], metrics = _timed_generate(engine, prompts, max_tokens, device)
                    tokens = sum(len(c.token_ids) for c in completions)
                    row[f"turn{turn}_tokens_per_s"] = tokens / row[f"turn{turn}_s"]
                    row[f"turn{turn}_prefill_s"] = metrics.get("generator/prefill_s", float("nan"))
                    row[f"turn{turn}_cached_share"] = metrics.get("generator/prefix_cached_share", 0.0)
                    prompts = [c.prompt_ids + c.token_ids + torch.randint(3, vocab, (32,), generator=gen).tolist()
                               for c in completions]
            rows.append(row)
        del engine
        empty_cache(device)
    return rows


def _timed_generate(engine, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[list, float, dict]:
    """One batch, one completion per prompt: the completions, the seconds and the engine's metrics."""
    from forge.metrics import drain_local, merge_partials

    drain_local()
    synchronize(device)
    start = time.perf_counter()
    completions = [group[0] for group in engine.generate(prompts, SamplingParams(max_tokens=max_tokens, seed=0))]
    seconds = time.perf_counter() - start
    return completions, seconds, merge_partials([drain_local()])


def trainer_throughput(checkpoint: Path, *, device: str, rows: int, length: int, micro_batch_sizes: tuple[int, ...],
                       steps: int = 2) -> dict:
    """TitanTrainer (bf16 autocast, fp32 parameters, AdamW, GRPO) on `rows` x `length` random tokens: seconds and
    tokens/s per step after one warm-up step, and peak GPU memory. Tries each micro-batch size in turn until one fits."""
    from actors.titan_trainer import TitanTrainer
    from actors.trainer_config import TrainerConfig
    from rl.types import TrainBatch

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (rows, length), generator=gen)
    response_mask = torch.zeros(rows, length - 1)
    response_mask[:, length // 4 :] = 1
    batch = TrainBatch(input_ids=input_ids, response_mask=response_mask,
                       behaviour_logprobs=torch.full((rows, length - 1), -12.0),
                       policy_versions=torch.where(response_mask > 0, 0, -1).long(),
                       advantages=torch.randn(rows, generator=gen), rewards=torch.rand(rows, generator=gen))
    errors = []
    for micro in micro_batch_sizes:
        trainer = None
        try:
            trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint), dtype="bfloat16", device=device,
                                                 loss="grpo", lr=1e-6, micro_batch_size=micro))
            if torch.device(device).type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            trainer.train_step(batch)  # warm-up
            times = []
            for _ in range(steps):
                synchronize(device)
                start = time.perf_counter()
                metrics = trainer.train_step(batch)
                synchronize(device)
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else float("nan")
            step_s = sorted(times)[len(times) // 2]
            return {"micro_batch_size": micro, "step_s": step_s, "tokens_per_s": rows * length / step_s,
                    "peak_gib": peak, "loss": metrics["loss"], "errors": errors}
        except torch.OutOfMemoryError as error:
            errors.append(f"micro_batch_size={micro}: out of memory ({str(error).splitlines()[0][:120]})")
        finally:
            del trainer
            empty_cache(device)
    raise RuntimeError("; ".join(errors))


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ----- the run ---------------------------------------------------------------------------------------------------


class Log:
    """Prints and appends to the log file as it goes (a run stopped at its limit keeps what it wrote)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.summary: list[str] = []
        if path is not None:
            path.write_text("")

    def __call__(self, line: str = "", summary: bool = False) -> None:
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")
        if summary:
            self.summary.append(line)


def environment(log: Log, device: str) -> None:
    log(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus", summary=True)
    for name in ("torch", "transformers", "tokenizers", "huggingface_hub", "safetensors", "xxhash", "peft", "triton",
                 "torchtitan", "torchdata", "datasets", "tyro", "omegaconf", "pytest", "monarch", "torchstore", "vllm"):
        try:
            module = importlib.import_module(name)
            log(f"  {name} {getattr(module, '__version__', '?')}")
        except Exception as error:  # a missing package is a figure here, not a failure
            log(f"  {name}: not importable ({type(error).__name__})")
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(0)
        log(f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}", summary=True)
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            log(f"nvidia-smi: {out.stdout.strip()}", summary=True)
    shm = shutil.disk_usage("/dev/shm")
    log(f"/dev/shm: {shm.free / 2**30:.1f} GiB free of {shm.total / 2**30:.1f}", summary=True)


def part_parity(log: Log, device: str, work: Path) -> None:
    checkpoint = build_parity_checkpoint(work / "parity")
    log(f"{'log-prob parity':<24}{'dtype':<10}{'sampling':<22}{'tokens':>7}{'trainer max':>13}{'mean':>10}"
        f"{'hf fwd max':>12}{'mean':>10}", summary=True)
    for dtype in ("float32", "bfloat16"):
        for sampling in SAMPLINGS:
            p = logprob_parity(checkpoint, device=device, dtype=dtype, sampling=sampling)
            log(f"{'':<24}{dtype:<10}{sampling:<22}{p.tokens:>7}{p.trainer_max:>13.2e}{p.trainer_mean:>10.2e}"
                f"{p.forward_max:>12.2e}{p.forward_mean:>10.2e}", summary=True)


def part_trainer_parity(log: Log, device: str, work: Path) -> None:
    """One trainer step on `device` (fp32 and bf16) against the CPU fp32 step on the same batch."""
    checkpoint = build_parity_checkpoint(work / "step")
    batch = step_batch()
    reference = trainer_step(checkpoint, device="cpu", dtype="float32", batch=batch)
    log(f"{'trainer step vs cpu fp32':<26}{'dtype':<8}{'loss':>12}{'|d loss|':>11}{'grad_norm':>11}"
        f"{'|d gnorm|':>11}{'max |d lp| after':>18}", summary=True)
    log(f"{'':<26}{'cpu fp32':<8}{reference['loss']:>12.6f}{'':>11}{reference['grad_norm']:>11.5f}", summary=True)
    for dtype in ("float32", "bfloat16"):
        m = trainer_step(checkpoint, device=device, dtype=dtype, batch=batch)
        after = (m["logprobs_after"] - reference["logprobs_after"])[batch.response_mask > 0].abs().max()
        log(f"{'':<26}{dtype:<8}{m['loss']:>12.6f}{abs(m['loss'] - reference['loss']):>11.2e}"
            f"{m['grad_norm']:>11.5f}{abs(m['grad_norm'] - reference['grad_norm']):>11.2e}{float(after):>18.2e}",
            summary=True)


def part_publish(log: Log, device: str, shape: str, timeout: float) -> None:
    command = [sys.executable, "-m", "bench.publish_to_ready", "--model-shape", shape, "--device", device]
    log(f"$ {' '.join(command[1:])}")
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    for line in result.stdout.splitlines():
        log(f"  {line}", summary=line.split()[:1] in (["publish-to-ready:"], ["total"], ["raw"], ["torch.save"]))
    if result.returncode:
        raise RuntimeError(f"publish_to_ready exited {result.returncode}: {result.stderr[-3000:]}")


def part_engine(log: Log, device: str, checkpoint: Path, small: bool) -> None:
    batches, prompt_len, max_tokens = ((1, 4), 16, 8) if small else ((1, 16, 64), 256, 64)
    log(f"hf engine, bf16, prompt {prompt_len} tokens, {max_tokens} generated per turn, turn 2 = turn 1 + its "
        "completion + 32 tokens", summary=True)
    log(f"{'batch':>7}{'kv reuse':>10}{'turn1 tok/s':>13}{'prefill s':>11}{'turn2 tok/s':>13}{'prefill s':>11}"
        f"{'turn2 cached':>14}", summary=True)
    for r in engine_throughput(checkpoint, device=device, batches=batches, prompt_len=prompt_len,
                               max_tokens=max_tokens):
        log(f"{r['batch']:>7}{'on' if r['kv_reuse'] else 'off':>10}{r['turn1_tokens_per_s']:>13.1f}"
            f"{r['turn1_prefill_s']:>11.3f}{r['turn2_tokens_per_s']:>13.1f}{r['turn2_prefill_s']:>11.3f}"
            f"{r['turn2_cached_share']:>14.2f}", summary=True)


def part_trainer(log: Log, device: str, checkpoint: Path, small: bool) -> None:
    rows, length, micro = (4, 32, (2,)) if small else (64, 1024, (4, 2, 1))
    r = trainer_throughput(checkpoint, device=device, rows=rows, length=length, micro_batch_sizes=micro)
    log(f"trainer step, bf16 autocast, fp32 AdamW, GRPO, {rows} x {length} tokens: micro_batch_size "
        f"{r['micro_batch_size']}, {r['step_s']:.2f} s/step, {r['tokens_per_s']:.0f} tokens/s, peak "
        f"{r['peak_gib']:.1f} GiB allocated" + (f" (refused first: {r['errors']})" if r["errors"] else ""), summary=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--small", action="store_true", help="the tiny shape for the engine and trainer figures")
    parser.add_argument("--log", type=Path, default=None, help="also write everything printed to this file")
    parser.add_argument("--deadline", type=float, default=400.0, help="seconds after which no part starts")
    parser.add_argument("--parts", default="env,parity,step,publish-1.7b,engine,trainer,publish-8b")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda: CUDA is not available on this host; use --device cpu")
    log, started, failed = Log(args.log), time.perf_counter(), []
    work = Path(tempfile.mkdtemp(prefix="forge-gpu-checks-", dir="/dev/shm"))
    shape = "tiny" if args.small else "qwen3-1.7b"
    checkpoint: list[Path] = []

    def shape_checkpoint() -> Path:
        if not checkpoint:
            checkpoint.append(write_shape_checkpoint(shape, work / shape, args.device))
        return checkpoint[0]

    parts: dict[str, Callable[[], None]] = {
        "env": lambda: environment(log, args.device),
        "parity": lambda: part_parity(log, args.device, work),
        "step": lambda: part_trainer_parity(log, args.device, work),
        "publish-1.7b": lambda: part_publish(log, args.device, "tiny" if args.small else "qwen3-1.7b", 240),
        "engine": lambda: part_engine(log, args.device, shape_checkpoint(), args.small),
        "trainer": lambda: part_trainer(log, args.device, shape_checkpoint(), args.small),
        "publish-8b": lambda: part_publish(log, args.device, "tiny" if args.small else "qwen3-8b", 170),
    }
    try:
        for name in args.parts.split(","):
            elapsed = time.perf_counter() - started
            if elapsed > args.deadline:
                log(f"[{name}] skipped: {elapsed:.0f} s elapsed, past --deadline {args.deadline:.0f} s", summary=True)
                continue
            log(f"[{name}] start at {elapsed:.0f} s")
            try:
                parts[name]()
            except Exception:  # one part's failure must not cost the others' figures
                failed.append(name)
                log(f"[{name}] FAILED:\n{traceback.format_exc()}")
                log(f"[{name}] FAILED: {traceback.format_exc().strip().splitlines()[-1][:300]}", summary=True)
            log(f"[{name}] done at {time.perf_counter() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log("")
    log("===== summary =====")
    for line in log.summary:
        log(line)
    log(f"total {time.perf_counter() - started:.0f} s; failed parts: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
