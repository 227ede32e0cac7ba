"""Learning of the RL loop as Tinker's docs write it (apps/examples/tinker_rl_loop.py), driven by the unmodified
`tinker` SDK against `python -m apps.server` on loopback: held-out greedy accuracy before and after, per seed.

    cd <repo> && .venv/bin/python -m bench.tinker_rl_learning --seeds 0 1 2 --server warm_start.target_accuracy=0.15 \\
        warm_start.lr=3e-3 warm_start.eval_every=5        # the example's defaults, configs/grpo_tiny.yaml's warm start
    cd <repo> && .venv/bin/python -m bench.tinker_rl_learning --seeds 0 --loop loss=importance_sampling shuffle=false
    cd <repo> && .venv/bin/python -m bench.tinker_rl_learning --seeds 0 --loop steps=20 learning_rate=5e-4
    cd <repo> && .venv/bin/python -m bench.tinker_rl_learning --seeds 0 --server reverse_answer=false \\
        --loop reverse_answer=false                                                              # "12+34=" -> "46"

One server (configs/server_tiny.yaml with the `--server` overrides; the example's defaults need
`reverse_answer=true`, given unless overridden) serves every seed in turn; each seed is one Tinker session
(its own LoRA model, finished at the end). `--loop` overrides the example's LoopConfig fields (name=value).
Prints one line per seed and, with `--json`, writes the results (per-step sampled rewards included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "tml-bench-tinker-rl"
SERVER_DEFAULTS = ("reverse_answer=true",)  # the task the example's defaults learn (its LoopConfig.reverse_answer)


def loop_overrides(pairs: list[str]) -> dict:
    """name=value pairs -> LoopConfig keyword arguments, each parsed as its field's type."""
    from apps.examples.tinker_rl_loop import LoopConfig, parse

    fields = {f.name for f in dataclasses.fields(LoopConfig)}
    argv = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--loop {pair!r}: give name=value with name one of {sorted(fields)}")
        argv += [f"--{name.replace('_', '-')}", value]
    parsed = dataclasses.asdict(parse(argv))
    return {name: parsed[name] for name in (p.partition("=")[0] for p in pairs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--loop", nargs="*", default=[], help="LoopConfig overrides, name=value")
    parser.add_argument("--server", nargs="*", default=[], help="server config overrides, key=value")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        overrides = loop_overrides(args.loop)
    except ValueError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ["TINKER_API_KEY"] = API_KEY
    from apps.examples.tinker_rl_loop import LoopConfig, run
    from forge.provisioner import free_port
    from tests.support import start_http_app, stop_http_app

    server = [*(d for d in SERVER_DEFAULTS if d.partition("=")[0] not in {s.partition("=")[0] for s in args.server}),
              *args.server]
    results = []
    with tempfile.TemporaryDirectory(prefix="tinker-rl-") as run_dir:
        command = [sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml",
                   f"http.port={free_port()}", f"run_dir={run_dir}", f"http.api_key={API_KEY}", *server]
        started = time.perf_counter()
        proc, url = start_http_app(command, Path(run_dir) / "server.log", ROOT, timeout=900)
        print(f"server up in {time.perf_counter() - started:.0f}s ({' '.join(server) or 'defaults'})", flush=True)
        try:
            for seed in args.seeds:
                cfg = LoopConfig(base_url=url, **{**overrides, "seed": seed})
                began = time.perf_counter()
                result = run(cfg, log=lambda line: print(f"  seed {seed}: {line}", flush=True))
                result.update(seed=seed, seconds=time.perf_counter() - began,
                              config={k: v for k, v in dataclasses.asdict(cfg).items() if k != "base_url"})
                results.append(result)
                print(f"seed {seed}: {result['accuracy_start']:.1%} -> {result['accuracy_end']:.1%} "
                      f"({100 * (result['accuracy_end'] - result['accuracy_start']):+.1f} points) in "
                      f"{result['seconds']:.0f} s", flush=True)
        finally:
            stop_http_app(proc)
    if args.json is not None:
        args.json.write_text(json.dumps({"server": server, "results": results}, indent=1))
    gains = [100 * (r["accuracy_end"] - r["accuracy_start"]) for r in results]
    print(f"mean gain {sum(gains) / len(gains):+.1f} points over seeds {args.seeds}; least {min(gains):+.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
