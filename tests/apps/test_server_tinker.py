"""The unmodified Tinker SDK (`tinker`, pinned in the dev extra) against `python -m apps.server` on loopback with the
tiny model: sessions, LoRA models, futures, forward/forward_backward with Tinker's losses, optim_step, state and
sampler checkpoints, sampling, and the errors the SDK documents."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from forge.provisioner import free_port
from rl.tasks.arithmetic import ArithmeticTask
from tests.support import start_http_app, stop_http_app

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "tml-forge-test-key"
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("server-tinker")
    command = [sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml", f"http.port={free_port()}",
               f"run_dir={run_dir}", f"http.api_key={API_KEY}", "sessions.max_lora_sessions=4",
               "tinker.retrieve_hold_s=2", "warm_start.max_steps=20"]
    proc, base_url = start_http_app(command, run_dir / "server.log", ROOT)
    yield {"url": base_url, "run_dir": run_dir}
    code = stop_http_app(proc)
    assert code == 128 + signal.SIGTERM, (run_dir / "server.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def service(server, monkeypatch_module):
    client = tinker.ServiceClient(base_url=server["url"], api_key=API_KEY)
    yield client
    client.holder.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        yield patch


def _base_model(service) -> str:
    return service.get_server_capabilities().supported_models[0].model_name


def _sft_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """Tinker's datum: input = tokens[:-1], target_tokens = tokens[1:], weight 1 on the answer's targets."""
    prompt_ids = tokenizer.encode(prompt)
    answer_ids = tokenizer.encode(answer) + [tokenizer.eos_token_id]
    tokens = prompt_ids + answer_ids
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def test_a_supervised_loop_through_the_sdk_lowers_held_out_loss(service, server):
    training = service.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    task = ArithmeticTask(seed=1, num_digits=2, held_out=64)
    held_out = [_sft_datum(tokenizer, p.prompt, str(p.answer)) for p in task.held_out()[:32]]

    def held_out_loss() -> float:
        out = training.forward(held_out, "cross_entropy").result()
        weights = sum(float(np.sum(d.loss_fn_inputs["weights"].to_numpy())) for d in held_out)
        return out.metrics["loss:sum"] / weights

    before = held_out_loss()
    import random
    rng = random.Random(0)
    for _ in range(8):
        batch = [_sft_datum(tokenizer, p.prompt, str(p.answer)) for p in task.sample_prompts(32, rng)]
        fb = training.forward_backward(batch, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=3e-3))
        assert fb.result().metrics["loss:sum"] > 0
        step.result()
    after = held_out_loss()
    assert after < before - 0.05, (before, after)
