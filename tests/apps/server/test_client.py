"""apps.server.client against a fake server (httpx.MockTransport): no processes, no network.

What the real server does with these requests is tested over HTTP in tests/apps/server/test_service.py.
"""

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from apps.server.client import (
    AdamParams,
    APIFuture,
    Datum,
    ForgeAPIError,
    ModelInput,
    Result,
    SamplingParams,
    ServiceClient,
)

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process


class FakeServer:
    """Records requests; answers like the training service would (enough for the client's logic)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict, dict]] = []
        self.lock = threading.Lock()
        self.slow_prompts: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        with self.lock:
            self.requests.append((request.method, request.url.path, body, dict(request.headers)))
        path = request.url.path
        if path == "/api/v1/create_session":
            return httpx.Response(200, json={"session_id": "s-1", "model_id": "s-1", "next_seq_id": 0, **body})
        if path == "/api/v1/forward_backward":
            if body["chunk_index"] < body["num_chunks"] - 1:
                return httpx.Response(202, json={"status": "accepted", "seq_id": body["seq_id"]})
            return httpx.Response(200, json={"seq_id": body["seq_id"], "loss": 0.5, "loss_fn_outputs": [
                {"logprobs": [-1.0]}]})
        if path == "/api/v1/optim_step":
            return httpx.Response(200, json={"seq_id": body["seq_id"], "step": 1})
        if path == "/api/v1/sample":
            if body.get("prompt") == "bad":
                return httpx.Response(422, json={"detail": [{"loc": ["body", "prompt"], "msg": "bad prompt"}]})
            if isinstance(body.get("prompt"), str) and body["prompt"] in self.slow_prompts:
                time.sleep(1.0)
            return httpx.Response(200, json={"policy_version": 3, "samples": [[{"text": "46", "tokens": [1]}]]})
        if path == "/api/v1/save_weights_for_sampler":
            return httpx.Response(200, json={"seq_id": body["seq_id"], "checkpoint": {"checkpoint_id": body["path"]}})
        if path == "/api/v1/checkpoints/missing":
            return httpx.Response(404, json={"detail": "checkpoint 'missing' not found; known: none"})
        return httpx.Response(200, json={"path": path, "seq_id": body.get("seq_id")})

    def bodies(self, path: str) -> list[dict]:
        return [body for _, p, body, _ in self.requests if p == path]


@pytest.fixture
def fake():
    return FakeServer()


@pytest.fixture
def service(fake):
    with ServiceClient("http://fake:1234", "key-123", transport=httpx.MockTransport(fake)) as client:
        yield client


def test_base_url_and_api_key_come_from_the_environment(monkeypatch, fake):
    monkeypatch.setenv("FORGE_BASE_URL", "http://envhost:9999/")
    monkeypatch.setenv("FORGE_API_KEY", "env-key-456")
    with ServiceClient(transport=httpx.MockTransport(fake)) as client:
        assert client.base_url == "http://envhost:9999"
        client.health().result()
    method, path, _, headers = fake.requests[-1]
    assert (method, path) == ("GET", "/health")
    assert headers["authorization"] == "Bearer env-key-456"


def test_arguments_win_over_the_environment(monkeypatch, fake):
    monkeypatch.setenv("FORGE_BASE_URL", "http://envhost:9999")
    monkeypatch.setenv("FORGE_API_KEY", "env-key-456")
    with ServiceClient("http://arg:1", "arg-key-789", transport=httpx.MockTransport(fake)) as client:
        assert client.base_url == "http://arg:1"
        client.health().result()
    assert fake.requests[-1][3]["authorization"] == "Bearer arg-key-789"


def test_calls_are_numbered_in_call_order_and_return_futures(service, fake):
    training = service.create_training_client()
    assert training.session_id == training.model_id == "s-1"
    datum = Datum(ModelInput.from_ints([1, 2, 3]), {"logprobs": [0.0, -1.0], "advantages": [0.0, 1.0]})
    futures = [training.forward_backward([datum]), training.optim_step(AdamParams(learning_rate=1e-3)),
               training.forward_backward([datum]), training.sync_inference_weights()]
    assert all(isinstance(f, APIFuture) for f in futures)
    assert [f.result(timeout=10).seq_id for f in futures] == [0, 1, 2, 3]
    step = fake.bodies("/api/v1/optim_step")[0]
    assert step["model_id"] == "s-1" and step["adam_params"]["learning_rate"] == 1e-3
    sent = fake.bodies("/api/v1/forward_backward")[0]
    assert sent["data"][0] == {"model_input": {"input_ids": [1, 2, 3]},
                               "loss_fn_inputs": {"logprobs": [0.0, -1.0], "advantages": [0.0, 1.0]}}
    assert sent["loss_fn"] == "grpo" and sent["loss_fn_params"] == {}


def test_a_large_batch_goes_in_chunks_of_one_request(service, fake):
    training = service.create_training_client()
    training.max_chunk_datums = 2
    data = [{"model_input": {"input_ids": [1, 2, i]}, "loss_fn_inputs": {}} for i in range(5)]
    out = training.forward_backward(data, "dapo", {"clip_eps_low": 0.2}).result(timeout=10)
    assert out.loss == 0.5
    chunks = fake.bodies("/api/v1/forward_backward")
    assert [c["chunk_index"] for c in chunks] == [0, 1, 2]
    assert {c["num_chunks"] for c in chunks} == {3} and {c["seq_id"] for c in chunks} == {0}
    assert [len(c["data"]) for c in chunks] == [2, 2, 1]
    assert all(c["loss_fn"] == "dapo" and c["loss_fn_params"] == {"clip_eps_low": 0.2} for c in chunks)
    assert training.optim_step().result(timeout=10).seq_id == 1  # one seq_id for the whole chunked request


def test_futures_can_be_awaited(service):
    sampler = service.create_sampling_client()

    async def main():
        return await sampler.sample("12+34=", SamplingParams(max_tokens=4), num_samples=2)

    out = asyncio.run(main())
    assert out.samples[0][0].text == "46" and out.policy_version == 3


def test_errors_carry_the_status_and_the_servers_detail(service):
    with pytest.raises(ForgeAPIError) as error:
        service.create_sampling_client().sample("bad").result(timeout=10)
    assert error.value.status_code == 422
    assert error.value.detail[0]["loc"] == ["body", "prompt"]
    with pytest.raises(ForgeAPIError) as error:
        service.create_rest_client().get_checkpoint("missing").result(timeout=10)
    assert error.value.status_code == 404 and "not found" in str(error.value)


def test_sample_batch_reports_completed_failed_and_stragglers(service, fake):
    fake.slow_prompts.add("slow")
    out = service.create_sampling_client().sample_batch(["1+1=", "bad", "slow"], timeout=0.5).result(timeout=10)
    assert sorted(out.completed) == [0]
    assert sorted(out.failed) == [1] and isinstance(out.failed[1], ForgeAPIError)
    assert out.cancelled == [2]


def test_sampling_params_and_prompts_are_sent_as_given(service, fake):
    sampler = service.create_sampling_client()
    sampler.sample([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, seed=1), num_samples=4).result(timeout=10)
    sampler.sample_many(["1+1=", [5, 6]], SamplingParams()).result(timeout=10)
    single, many = fake.bodies("/api/v1/sample")
    assert single["prompt"] == [5, 6, 7] and single["num_samples"] == 4
    assert single["sampling_params"]["temperature"] == 0.0 and single["sampling_params"]["seed"] == 1
    assert many["prompts"] == ["1+1=", [5, 6]]


def test_checkpoint_and_session_calls_hit_their_paths(service, fake):
    training = service.create_training_client_from_state_with_optimizer("ck")
    assert fake.bodies("/api/v1/create_session")[-1] == {"from_checkpoint": "ck", "with_optimizer": True}
    service.create_training_client_from_state("ck")
    assert fake.bodies("/api/v1/create_session")[-1] == {"from_checkpoint": "ck", "with_optimizer": False}
    training.save_state("a", with_optimizer=False).result(timeout=10)
    training.load_state_with_optimizer("a").result(timeout=10)
    training.save_weights_for_sampler("hf").result(timeout=10)
    training.heartbeat().result(timeout=10)
    training.unload().result(timeout=10)
    rest = service.create_rest_client()
    rest.list_checkpoints().result(timeout=10)
    rest.delete_checkpoint("a").result(timeout=10)
    paths = [(m, p) for m, p, _, _ in fake.requests]
    for expected in [("POST", "/api/v1/save_state"), ("POST", "/api/v1/load_state"),
                     ("POST", "/api/v1/save_weights_for_sampler"), ("POST", "/api/v1/session_heartbeat"),
                     ("POST", "/api/v1/unload_model"), ("GET", "/api/v1/checkpoints"),
                     ("DELETE", "/api/v1/checkpoints/a")]:
        assert expected in paths
    assert fake.bodies("/api/v1/save_state")[0] == {"model_id": "s-1", "seq_id": 0, "path": "a", "with_optimizer": False}
    assert fake.bodies("/api/v1/load_state")[0]["with_optimizer"] is True


def test_result_gives_attribute_access_recursively():
    r = Result.wrap({"a": [{"b": 1}], "c": {"d": "x"}})
    assert r.a[0].b == 1 and r.c.d == "x" and r["c"]["d"] == "x"
    with pytest.raises(AttributeError):
        r.missing


def test_a_sample_becomes_a_datum_with_its_kept_sets():
    prompt = [3, 4, 5]
    top_k = Result.wrap({"tokens": [7, 8], "logprobs": [-0.5, -0.25], "kept_token_ids": [[7, 9], [8]]})
    datum = Datum.from_sample(prompt, top_k, 1.5, reward=1.0).to_json()
    assert datum["model_input"] == {"input_ids": [3, 4, 5, 7, 8]}
    assert datum["loss_fn_inputs"] == {"logprobs": [0.0, 0.0, -0.5, -0.25], "advantages": [0.0, 0.0, 1.5, 1.5],
                                       "mask": [0.0, 0.0, 1.0, 1.0], "reward": 1.0,
                                       "kept_token_ids": [[], [], [7, 9], [8]]}
    full = Datum.from_sample(prompt, {"tokens": [7], "logprobs": [-0.5], "kept_token_ids": None}, -1.0).to_json()
    assert "kept_token_ids" not in full["loss_fn_inputs"]  # sampled from the full vocabulary


def test_a_sample_becomes_a_datum_that_keeps_the_policy_version_of_each_sampled_token():
    from apps.server.batches import build_batch
    from apps.server.schemas import Datum as ServerDatum

    sample = Result.wrap({"tokens": [7, 8, 9], "logprobs": [-0.5, -0.25, -0.1], "policy_versions": [3, 3, 4],
                          "kept_token_ids": None})
    datum = Datum.from_sample([3, 4, 5], sample, 1.0).to_json()
    assert datum["loss_fn_inputs"]["policy_versions"] == [-1, -1, 3, 3, 4]  # -1: the prompt, sampled by none
    batch = build_batch([ServerDatum.model_validate(datum)], pad_id=0, vocab_size=100, max_len=16,
                        needs_rl_inputs=True)
    assert batch.policy_versions.tolist() == [[-1, -1, 3, 3, 4]]
    assert batch.oldest_policy_versions().tolist() == [3]


def test_a_sample_becomes_a_datum_at_its_own_temperature():
    # The server scores a datum at loss_fn_inputs.temperature (the trainer's own when absent): a sample's log-probs
    # are at the temperature it was drawn at, which the datum must say.
    sample = Result.wrap({"tokens": [7, 8], "logprobs": [-0.5, -0.25], "temperature": 0.7, "kept_token_ids": None})
    assert Datum.from_sample([3, 4], sample, 1.0).to_json()["loss_fn_inputs"]["temperature"] == 0.7
    assert "temperature" not in Datum.from_sample([3, 4], {"tokens": [7], "logprobs": [-0.5]}, 1.0).loss_fn_inputs


def test_importing_the_client_loads_no_torch_no_monarch_and_leaves_the_environment_alone():
    script = ("import os, sys, json\n"
              "before = dict(os.environ)\n"
              "import apps.server.client\n"
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'monarch', 'torchstore'))\n"
              "print(json.dumps({'heavy': heavy, 'changed': sorted(k for k in set(before) | set(os.environ)\n"
              "                                                    if before.get(k) != os.environ.get(k))}))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"heavy": [], "changed": []}


def test_one_sampling_params_everywhere():
    import rl.sampling
    import rl.types

    assert SamplingParams is rl.sampling.SamplingParams is rl.types.SamplingParams
    with pytest.raises(ValueError, match=r"SamplingParams.top_p=0: must be in \(0, 1\]"):
        SamplingParams(top_p=0)


def test_num_samples_and_n_are_one_count(service, fake):
    sampler = service.create_sampling_client()
    sampler.sample("1+1=", SamplingParams(n=3)).result(timeout=10)
    sampler.sample("1+1=", SamplingParams(n=3), num_samples=5).result(timeout=10)
    from_n, overridden = fake.bodies("/api/v1/sample")
    assert (from_n["num_samples"], from_n["sampling_params"]["n"]) == (3, 3)
    assert (overridden["num_samples"], overridden["sampling_params"]["n"]) == (5, 5)
    with pytest.raises(ValueError, match="SamplingParams.n=0"):
        sampler.sample("1+1=", num_samples=0)


def test_a_lora_client_asks_for_its_adapter_and_samples_with_the_saved_one(service, fake):
    training = service.create_lora_training_client("tiny", 8, target_modules=["q_proj", "v_proj"])
    assert fake.bodies("/api/v1/create_session") == [{"base_model": "tiny", "metadata": {}, "lora": {
        "rank": 8, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}]
    service.create_lora_training_client(rank=4, seed=3)  # default targets: the server's (every block layer)
    assert fake.bodies("/api/v1/create_session")[1]["lora"] == {"rank": 4, "alpha": 32.0, "dropout": 0.0, "seed": 3}

    sampler = training.save_weights_and_get_sampling_client("adapter-1")
    assert fake.bodies("/api/v1/save_weights_for_sampler")[0]["path"] == "adapter-1"
    sampler.sample("12+34=").result()
    sampler.sample_many(["1+1=", [5, 6]]).result()
    service.create_sampling_client().sample("12+34=").result()
    assert [b.get("model_path") for b in fake.bodies("/api/v1/sample")] == ["adapter-1", "adapter-1", None]
