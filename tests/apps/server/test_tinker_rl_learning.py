"""The RL loop as Tinker's docs write it (apps/examples/tinker_rl_loop.py, its defaults), driven by the unmodified
`tinker` SDK against `python -m apps.server` on loopback, learns the tiny task: held-out greedy accuracy rises by at
least 30 points (issue 58's bar; bench/tinker_rl_learning.py measures the three seeds of docs/serving.md)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from forge.provisioner import free_port
from tests.support import start_http_app, stop_http_app

ROOT = Path(__file__).resolve().parents[3]
API_KEY = "tml-forge-test-rl-learning"
# Several minutes of training: a module of its own beside the other Monarch modules, not among the timed ones.
pytestmark = [pytest.mark.monarch, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("server-tinker-rl")
    # configs/grpo_tiny.yaml's warm start (docs/serving.md's figures start from it), the example's task order.
    command = [sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml", f"http.port={free_port()}",
               f"run_dir={run_dir}", f"http.api_key={API_KEY}", "reverse_answer=true",
               "warm_start.target_accuracy=0.15", "warm_start.lr=3e-3", "warm_start.eval_every=5"]
    proc, base_url = start_http_app(command, run_dir / "server.log", ROOT, timeout=900)
    yield base_url
    code = stop_http_app(proc)
    assert code == 128 + signal.SIGTERM, (run_dir / "server.log").read_text()[-4000:]


def test_the_tinker_rl_loop_raises_held_out_accuracy_by_30_points(server, monkeypatch):
    from apps.examples.tinker_rl_loop import LoopConfig, run

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    lines: list[str] = []
    result = run(LoopConfig(base_url=server, seed=0), log=lines.append)  # the example's defaults: 45 steps, ppo
    gain = result["accuracy_end"] - result["accuracy_start"]
    print(f"held-out accuracy {result['accuracy_start']:.1%} -> {result['accuracy_end']:.1%}")
    assert gain >= 0.30, "\n".join(lines[-20:])
