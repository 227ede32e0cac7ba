"""Memory of the training service's sessions: LoRA sessions (adapters over one shared base, one process) side by
side with full-model sessions (a trainer process each), measured on a running server through apps.server.client.

    cd <repo> && .venv/bin/python -m bench.server_lora_memory                                  # forge's tiny model
    cd <repo> && .venv/bin/python -m bench.server_lora_memory --hidden-size 1024 --layers 8     # a larger shape

One server (`python -m apps.server`, configs/server_tiny.yaml) serves every step, in this order:
1 LoRA session, 3 LoRA sessions, then 3 full-model sessions. Each session takes one forward_backward and one
optim_step (so its optimizer state exists), each LoRA session also saves its adapter and samples with it (so
the sampler is built). Figures: the resident memory (RSS) of the server's trainer processes, read from the
server's `GET /api/v1/memory` after every session has stepped; the generator and the server process are
shared by both kinds and listed apart. A larger shape is a randomly initialized Qwen3 checkpoint with the
tiny tokenizer (`rl.tiny_model.build_tiny_checkpoint`), so its size is the blocks'.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from apps.server.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _data(rows: int, length: int, vocab: int) -> list[Datum]:
    rng = random.Random(0)
    return [Datum(ModelInput.from_ints(rng.randrange(2, vocab) for _ in range(length)),
                  {"logprobs": [-1.0] * (length - 1), "advantages": 1.0 if i % 2 else -1.0,
                   "mask": [0.0] * 4 + [1.0] * (length - 5)}) for i, _ in enumerate(range(rows))]


def _step(client, data: list[Datum]) -> None:
    client.forward_backward(data, "grpo")
    client.optim_step(AdamParams(learning_rate=1e-3)).result()


def _trainers(service: ServiceClient) -> dict[str, int]:
    processes = service.get_memory().result().processes
    return {name: rss for name, rss in processes.items() if "trainer" in name}


def _shared(service: ServiceClient) -> dict[str, int]:
    processes = service.get_memory().result().processes
    return {name: rss for name, rss in processes.items() if "trainer" not in name}


def measure(url: str, api_key: str, *, rows: int, length: int) -> dict:
    with ServiceClient(url, api_key) as service:
        vocab = service.get_server_info().result().vocab_size
        data = _data(rows, length, vocab)
        lora, figures = [], {}
        for count in (1, 3):
            while len(lora) < count:
                client = service.create_lora_training_client(rank=16, seed=len(lora))
                _step(client, data)
                sampler = client.save_weights_and_get_sampling_client(f"bench-lora-{len(lora)}")
                sampler.sample([5, 6, 7], SamplingParams(max_tokens=4)).result()
                lora.append(client)
            figures[f"lora x{count}"] = _trainers(service)
        full = []
        for _ in range(3):
            client = service.create_training_client()
            _step(client, data)
            full.append(client)
        figures["full x3"] = {k: v for k, v in _trainers(service).items() if k.startswith("session-trainer")}
        figures["shared"] = _shared(service)
        for client in lora + full:
            client.unload().result()
        return figures


def start_server(command: list[str], log_path: Path, url: str, timeout_s: float = 900) -> subprocess.Popen:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server did not come up:\n{log_path.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # forge.lifecycle stops every actor process
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=None, help="a larger random Qwen3 shape (default: tiny)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args(argv)

    from forge.provisioner import free_port

    run_dir = Path(tempfile.mkdtemp(prefix="forge-bench-lora-memory-"))
    overrides = ["warm_start.enabled=false"]
    if args.hidden_size is not None:
        from rl.tiny_model import build_tiny_checkpoint

        h = args.hidden_size
        model = build_tiny_checkpoint(run_dir / "model", seed=0, hidden_size=h, intermediate_size=3 * h,
                                      num_hidden_layers=args.layers, num_attention_heads=h // 64,
                                      num_key_value_heads=max(1, h // 128), head_dim=64)
        overrides.append(f"model={model}")
    api_key = "bench-key-0123"
    port = free_port()
    command = [sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml", f"http.port={port}",
               f"run_dir={run_dir}", f"http.api_key={api_key}", "sessions.max_sessions=3",
               "sessions.max_lora_sessions=3", "trainer.micro_batch_size=8", *overrides]
    url = f"http://127.0.0.1:{port}"
    proc = start_server(command, run_dir / "server.log", url)
    try:
        figures = measure(url, api_key, rows=args.rows, length=args.length)
    except Exception:
        print(f"the server's log: {run_dir / 'server.log'}", file=sys.stderr)
        raise
    finally:
        stop_server(proc)
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints and the larger shape's model

    def total(name: str) -> float:
        return sum(figures[name].values()) / MIB

    shape = "tiny" if args.hidden_size is None else f"hidden {args.hidden_size}, {args.layers} layers"
    print(f"\nmodel: {shape}; batch {args.rows} x {args.length} tokens; RSS of the trainer processes (MiB)")
    print("| sessions | trainer processes | trainer RSS | per session |")
    print("|---|---|---|---|")
    for name, label, count in (("lora x1", "1 LoRA", 1), ("lora x3", "3 LoRA", 3), ("full x3", "3 full-model", 3)):
        print(f"| {label} | {len(figures[name])} | {total(name):.0f} | {total(name) / count:.0f} |")
    print(f"3 LoRA sessions: {total('lora x3') - total('lora x1'):.0f} MiB more than 1; 3 full-model sessions: "
          f"{total('full x3') / total('lora x3'):.1f}x the RSS of 3 LoRA sessions")
    print("shared by both kinds:", json.dumps({k: round(v / MIB) for k, v in figures["shared"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
