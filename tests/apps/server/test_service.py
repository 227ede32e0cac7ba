"""apps.server, the REST training service, over real HTTP on localhost: every endpoint and error code.

One server (`python -m apps.server`, a subprocess) is started for the module; it starts Monarch processes
(a Generator as_service, trainer actors per session), so `make test` runs this module in its own pytest
process. The request-ordering and batch-building pieces are also tested on their own, without processes.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from apps.server.app import build_app
from apps.server.batches import batch_temperature, build_batch, concat_batches
from apps.server.config import ServerConfig
from apps.http.errors import ServiceError
from apps.http.model import model_to_serve
from apps.http.actor_calls import endpoint_failure
from apps.server.runtime import TrainingService
from apps.server.schemas import Datum
from apps.server.sequencer import Sequencer
from apps.http.serving import install_error_handlers
from forge.compat import report_endpoint_errors
from apps.app_config import load_app_config
from forge.provisioner import free_port
from forge.service import NoHealthyReplicaError
from rl.tiny_model import ensure_tiny_checkpoint
from apps.warm_start.config import WarmStartConfig
from tests.docs.snippets import python_blocks, run_block
from tests.apps.app_faults import Endpoint, actor, kill_the_generator_for_good, newest_job_process
from tests.support import start_http_app, stop_http_app
from apps.server.client import AdamParams, Datum as ClientDatum, ForgeAPIError, ModelInput, SamplingParams, ServiceClient

ROOT = Path(__file__).resolve().parents[3]
# 20 supervised steps (cached after the first run): the warm start's output and caching are tested on their own
# below; the full one (to 20% accuracy) takes from 2 minutes to over 15 on a loaded 2-core host.
SHORT_WARM_START = ["warm_start.max_steps=20"]
API_KEY = "test-key-0123"
pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.timeout(600)]


# --- pieces without processes ------------------------------------------------------------------------
async def test_sequencer_runs_requests_in_seq_order_and_assembles_chunks():
    sequencer = Sequencer("s", gap_timeout_s=5)
    ran = []

    def job(name):
        async def execute(seq_id, parts):
            ran.append((name, seq_id, parts))
            return name
        return execute

    late = sequencer.submit(2, "optim_step", job("c"), None)
    first = sequencer.submit(0, "forward_backward", job("a"), "part0", chunk_index=0, num_chunks=2)
    assert not first.complete and first.chunks_received == 1
    middle = sequencer.submit(1, "forward", job("b"), "x")
    last_chunk = sequencer.submit(0, "forward_backward", job("a"), "part1", chunk_index=1, num_chunks=2)
    assert last_chunk.complete
    assert [await f.future for f in (last_chunk, middle, late)] == ["a", "b", "c"]
    assert ran == [("a", 0, ["part0", "part1"]), ("b", 1, ["x"]), ("c", 2, [None])]
    with pytest.raises(ServiceError) as error:
        sequencer.submit(1, "forward", job("again"), None)
    assert error.value.status == 409 and "has already run" in str(error.value)
    await sequencer.close("done")


async def test_sequencer_fails_the_requests_waiting_on_a_gap_and_names_the_gap():
    sequencer = Sequencer("s", gap_timeout_s=0.3)
    ran = []

    async def execute(seq_id, parts):
        ran.append(seq_id)
        return seq_id

    waiting = [sequencer.submit(seq_id, "optim_step", execute, None) for seq_id in (1, 2)]
    for submitted in waiting:  # seq 0 never came: both are answered, neither waits forever nor runs out of order
        with pytest.raises(ServiceError) as error:
            await asyncio.wait_for(submitted.future, 5)
        assert error.value.status == 409
        assert "waited 0.3s (sessions.sequence_gap_timeout_s) for seq_id=0, which never arrived" in str(error.value)
        assert "the next free one is 3" in str(error.value)
    assert ran == []
    with pytest.raises(ServiceError) as error:
        sequencer.submit(0, "forward_backward", execute, None)
    assert error.value.status == 409 and "was skipped after waiting" in str(error.value)
    assert await asyncio.wait_for(sequencer.submit(3, "optim_step", execute, None).future, 5) == 3
    await sequencer.close("done")


async def test_a_refused_seq_id_gives_up_its_place_at_once():
    sequencer = Sequencer("s", gap_timeout_s=60)

    async def execute(seq_id, parts):
        return seq_id

    later = sequencer.submit(1, "optim_step", execute, None)
    half = sequencer.submit(2, "forward", execute, "part0", chunk_index=0, num_chunks=2)
    sequencer.refuse(0, "422: loss_fn_params.clip: not a parameter")
    assert await asyncio.wait_for(later.future, 5) == 1  # not held up for the 60 s gap timeout
    sequencer.refuse(2, "422: data.0: bad datum")  # a refused chunk drops the request's earlier chunks
    with pytest.raises(ServiceError, match=r"seq_id=2: was refused \(422: data.0: bad datum\)"):
        await asyncio.wait_for(half.future, 5)
    with pytest.raises(ServiceError) as error:
        sequencer.submit(0, "forward_backward", execute, None)
    assert error.value.status == 409 and "was refused (422: loss_fn_params.clip" in str(error.value)
    assert "the next free one is 3" in str(error.value)
    assert await asyncio.wait_for(sequencer.submit(3, "optim_step", execute, None).future, 5) == 3
    await sequencer.close("done")


def test_failures_in_the_trainer_are_500_with_the_cause():
    class Trainer:
        def forward_backward(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        def optim_step(self):
            raise RuntimeError("NCCL communicator was aborted")

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/{name}")
    async def call(name: str):
        raised = await report_endpoint_errors("Trainer", name, getattr(Trainer, name))(Trainer())
        raise endpoint_failure(raised.exception())

    @app.get("/bug")
    async def bug():
        raise KeyError("a bug in the server")

    client = TestClient(app, raise_server_exceptions=False)
    oom = client.post("/forward_backward")
    assert oom.status_code == 500
    assert oom.json()["detail"] == ("server-side failure: Trainer.forward_backward raised OutOfMemoryError: CUDA out "
                                    "of memory. Tried to allocate 2.00 GiB")
    runtime = client.post("/optim_step")
    assert runtime.status_code == 500 and "RuntimeError: NCCL communicator was aborted" in runtime.json()["detail"]
    bug = client.get("/bug")
    assert bug.status_code == 500 and bug.json()["detail"] == "server-side failure: KeyError: 'a bug in the server'"


def test_calls_past_call_timeout_s_or_spawn_timeout_s_are_504_naming_the_setting_and_nothing_waits_on(tmp_path):
    # The server's own code (runtime.py, app.py) over HTTP, without processes: a generator service and trainers that
    # never answer stand in for the actors (the module server cannot be given a call that hangs).
    cfg = load_app_config(ROOT / "configs/server_tiny.yaml", [f"model_cache={tmp_path}", f"run_dir={tmp_path / 'run'}",
                                                              "sessions.call_timeout_s=0.5",
                                                              "sessions.spawn_timeout_s=0.5"], ServerConfig)
    service = TrainingService(cfg, cfg.model)
    stuck = Endpoint()
    service.generators = actor(generate_batch=stuck)
    datum = {"model_input": {"input_ids": [5, 6, 7]}, "loss_fn_inputs": {}}
    with TestClient(build_app(service)) as client:
        sample = client.post("/api/v1/sample", json={"prompt": "1+1="})
        assert sample.status_code == 504 and sample.json() == {
            "detail": "sampling did not finish within call_timeout_s=0.5s"}
        service.idle_trainers = [actor(reset=stuck)]  # a new session takes an unloaded session's trainer
        created = client.post("/api/v1/create_session", json={})
        assert created.status_code == 504 and created.json() == {
            "detail": "resetting a trainer took longer than spawn_timeout_s=0.5s"}
        assert service.creating == {"full": 0, "lora": 0} and not service.sessions
        service.idle_trainers = [actor(reset=Endpoint(lambda: None), forward=stuck)]
        session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
        forward = client.post("/api/v1/forward", json={"model_id": session_id, "data": [datum]})
        assert forward.status_code == 504 and forward.json() == {
            "detail": "forward did not finish within call_timeout_s=0.5s"}
        assert stuck.cancelled == 3 and service.sessions[session_id].busy == 0
        # The session's order moves on past the request that timed out.
        service.sessions[session_id].trainer = actor(forward=Endpoint(
            lambda batch, *rest: {"loss": 0.0, "metrics": {}, "logprobs": torch.zeros(1, 3)}))
        answered = client.post("/api/v1/forward", json={"model_id": session_id, "data": [datum]})
        assert answered.status_code == 200 and answered.json()["seq_id"] == 1, answered.text


def test_no_generator_replica_left_is_503_for_sampling_and_for_a_weight_sync(tmp_path):
    # Without processes: a generator service whose replicas are all gone for good (forge.service raises
    # NoHealthyReplicaError) is the server's 503, naming the service's failure, on both paths that use it.
    cfg = load_app_config(ROOT / "configs/server_tiny.yaml", [f"model_cache={tmp_path}", f"run_dir={tmp_path / 'run'}"],
                          ServerConfig)
    service = TrainingService(cfg, cfg.model)

    def gone(*args):
        raise NoHealthyReplicaError("service generator: no healthy replica left (replica 0: killed)")

    service.generators = actor(generate_batch=Endpoint(gone), update_weights=Endpoint(gone))
    service.idle_trainers = [actor(reset=Endpoint(lambda: None), publish_as=Endpoint(lambda version: version))]
    with TestClient(build_app(service)) as client:
        sample = client.post("/api/v1/sample", json={"prompt": "1+1="})
        assert sample.status_code == 503, sample.text
        assert sample.json() == {"detail": "service generator: no healthy replica left (replica 0: killed)"}
        session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
        sync = client.post("/api/v1/sync_inference_weights", json={"model_id": session_id})
        assert sync.status_code == 503, sync.text
        assert sync.json() == {"detail": "service generator: no healthy replica left (replica 0: killed)"}


def test_every_status_code_the_server_answers_is_in_its_openapi_schema(tmp_path):
    # The codes raised in apps/server and apps/http (ServiceError(...), the error handlers, field_error's default) and
    # FastAPI's own 422: each /api/v1 operation of the served schema documents every one (a client generated from it
    # knows them).
    answered = {422}
    for source in [*(ROOT / "apps/server").glob("*.py"), *(ROOT / "apps/http").glob("*.py")]:
        text = source.read_text()
        answered |= {int(code) for code in re.findall(r"(?:ServiceError|respond)\((\d{3})\b", text)}
        answered |= {int(code) for code in re.findall(r"\bstatus: int = (\d{3})\b", text)}
    assert {401, 404, 409, 422, 429, 500, 503, 504} <= answered  # the scan sees every kind of raise
    cfg = load_app_config(ROOT / "configs/server_tiny.yaml", [f"model_cache={tmp_path}", f"run_dir={tmp_path / 'run'}"],
                          ServerConfig)
    with TestClient(build_app(TrainingService(cfg, cfg.model))) as client:
        paths = client.get("/openapi.json").json()["paths"]
    operations = {f"{method.upper()} {path}": operation for path, methods in paths.items()
                  if path.startswith("/api/v1/") for method, operation in methods.items()}
    assert len(operations) >= 20
    undocumented = {name: sorted(answered - {int(code) for code in operation["responses"] if code.isdigit()})
                    for name, operation in operations.items()}
    assert not {name: codes for name, codes in undocumented.items() if codes}


def test_batches_align_loss_inputs_and_name_bad_fields():
    datum = Datum.model_validate({"model_input": {"chunks": [{"tokens": [5, 6]}, {"tokens": [7, 8]}]},
                                  "loss_fn_inputs": {"logprobs": [0, 0, -0.5], "advantages": [0, 0, 2.0],
                                                     "labels": [6, 7, 8]}})
    batch = build_batch([datum], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8]]
    assert batch.response_mask.tolist() == [[0, 0, 1]] and batch.advantages.tolist() == [2.0]
    bad = Datum.model_validate({"model_input": {"input_ids": [5, 6, 7]},
                                "loss_fn_inputs": {"logprobs": [0.0], "advantages": [0.0, 1.0]}})
    with pytest.raises(ServiceError) as error:
        build_batch([datum, bad], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True)
    assert error.value.status == 422
    assert error.value.detail[0]["loc"] == ["body", "data", 1, "loss_fn_inputs", "logprobs"]
    assert "len(input_ids) - 1 = 2" in error.value.detail[0]["msg"]
    varying = Datum.model_validate({"model_input": {"input_ids": [5, 6, 7]},
                                    "loss_fn_inputs": {"logprobs": [0, 0], "advantages": [1.0, 2.0]}})
    with pytest.raises(ServiceError, match="one value on the trained positions"):
        build_batch([varying], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True)


def test_kept_sets_of_a_top_k_sample_reach_the_training_batch_and_bad_ones_name_their_position():
    # A top_k/top_p sample's log-probs are of its truncated distribution: the datum carries the kept sets, and the
    # trainer renormalises over them (TrainBatch.kept_token_ids, [B, T-1, K], -1 padded: -1 alone is the full vocabulary).
    datum = Datum.model_validate({"model_input": {"input_ids": [5, 6, 7, 8]}, "loss_fn_inputs": {
        "logprobs": [0, -0.1, -0.2], "advantages": [0, 1.0, 1.0], "kept_token_ids": [[], [7, 9, 3], [8]]}})
    plain = Datum.model_validate({"model_input": {"input_ids": [5, 6, 7, 8, 9]},
                                  "loss_fn_inputs": {"logprobs": [0, 0, -0.1, -0.2], "advantages": [0, 0, 1.0, 1.0]}})
    batch = build_batch([datum, plain], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True)
    assert batch.kept_token_ids.dtype == torch.int32 and batch.kept_token_ids.tolist() == [
        [[-1, -1, -1], [7, 9, 3], [8, -1, -1], [-1, -1, -1]], [[-1, -1, -1]] * 4]
    chunks = concat_batches([build_batch([plain], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True),
                             build_batch([datum], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True)], 0)
    assert chunks.kept_token_ids.tolist() == [[[-1, -1, -1]] * 4, [[-1, -1, -1], [7, 9, 3], [8, -1, -1], [-1, -1, -1]]]
    assert build_batch([plain], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True).kept_token_ids is None

    def refusal(kept: list) -> dict:
        bad = Datum.model_validate({"model_input": {"input_ids": [5, 6, 7, 8]}, "loss_fn_inputs": {
            "logprobs": [0, -0.1, -0.2], "advantages": [0, 1.0, 1.0], "kept_token_ids": kept}})
        with pytest.raises(ServiceError) as error:
            build_batch([plain, bad], pad_id=0, vocab_size=100, max_len=16, needs_rl_inputs=True)
        assert error.value.status == 422
        return error.value.detail[0]

    misaligned = refusal([[], [6, 9], [8]])
    assert misaligned["loc"] == ["body", "data", 1, "loss_fn_inputs", "kept_token_ids", 1]
    assert "does not hold input_ids[2]=7, the token sampled from it" in misaligned["msg"]
    assert "len(input_ids) - 1 = 3" in refusal([[7], [8]])["msg"]
    assert "outside the vocabulary [0, 100)" in refusal([[], [7, 100], [8]])["msg"]
    assert "at most 64 kept tokens" in refusal([[], list(range(65)), [8]])["msg"]


def test_one_temperature_per_request_and_a_datum_at_another_is_refused_by_name():
    # The trainer scores a batch at one temperature: a datum's own (a sample's), else trainer.temperature.
    def datum(temperature: float | None) -> Datum:
        inputs = {"logprobs": [0, -0.1], "advantages": [0, 1.0]}
        return Datum.model_validate({"model_input": {"input_ids": [5, 6, 7]}, "loss_fn_inputs": {
            **inputs, **({} if temperature is None else {"temperature": temperature})}})

    assert batch_temperature([datum(0.7), datum(0.7)], 1.0) == 0.7
    assert batch_temperature([datum(None), datum(1.0)], 1.0) == 1.0
    with pytest.raises(ServiceError) as error:
        batch_temperature([datum(0.7), datum(0.7), datum(None)], 1.0)
    assert error.value.status == 422
    assert error.value.detail[0]["loc"] == ["body", "data", 2, "loss_fn_inputs", "temperature"]
    assert "must equal data[0]'s 0.7 (trainer.temperature=1.0 where none is given)" in error.value.detail[0]["msg"]
    with pytest.raises(ValueError, match="greater than 0"):
        datum(0.0)


def test_a_lora_session_on_a_server_with_activation_checkpointing_is_refused_naming_it(tmp_path):
    # actors.lora.init_adapters finds adapters by parameter name, which a checkpointed block's wrapper changes.
    from apps.server.runtime import TrainingService
    from apps.server.schemas import CreateSessionRequest
    from apps.server.config import ServerConfig
    from apps.app_config import load_app_config

    tiny = str(ensure_tiny_checkpoint(tmp_path / "tiny-qwen3"))
    cfg = load_app_config(ROOT / "configs" / "server_tiny.yaml", ["trainer.activation_checkpoint=full"], ServerConfig)
    request = CreateSessionRequest.model_validate({"lora": {"rank": 4}})
    with pytest.raises(ServiceError) as error:
        asyncio.run(TrainingService(cfg, tiny).create_session(request))
    assert error.value.status == 422 and error.value.detail[0]["loc"] == ["body", "lora"]
    assert "trainer.activation_checkpoint='none' (it is 'full')" in error.value.detail[0]["msg"]


def test_the_first_warm_start_says_what_it_does_and_where_it_caches_and_later_starts_reuse_it(tmp_path, capsys):
    tiny = str(ensure_tiny_checkpoint(tmp_path / "tiny-qwen3"))
    budget = WarmStartConfig(target_accuracy=1.0, batch_size=4, max_steps=4, eval_every=2, eval_prompts=8)
    capsys.readouterr()
    path, accuracy = model_to_serve(tiny, str(tmp_path), budget, seed=0)
    first = capsys.readouterr().out.splitlines()
    assert Path(path).parent == (tmp_path / "warm_start").resolve() and (Path(path) / "warm_start.json").is_file()
    assert first[0] == (f"warm start: none cached for this model, seed and settings; training one (cached in {path} "
                        "for later starts)")
    assert first[1] == ("warm start: supervised steps of 4 examples until greedy accuracy on 8 prompts reaches 100%, "
                        "checked every 2 steps (at most 4 steps); a time estimate follows each check")
    bars = [line for line in first if line.startswith("warm start [")]  # one progress bar line per check
    assert [line.split(" | ")[1] for line in bars] == ["step 2/4", "step 4/4"]
    assert all(re.search(r"\| \d+s, (~\d+s left|at most \d+s left|done)", line) for line in bars), bars
    assert re.fullmatch(rf"warm start: 4 steps in \d+s, greedy accuracy [\d.]+%; saved {re.escape(path)} "
                        r"\(reused on later starts\)", first[-1])

    again = model_to_serve(tiny, str(tmp_path), budget, seed=0)
    assert again == (path, accuracy)
    assert capsys.readouterr().out.splitlines() == [
        f"warm start: reusing {path} (accuracy {accuracy:.1%}, cached by model, seed and settings)"]

    model_to_serve(tiny, str(tmp_path), budget, seed=1)  # other settings: trained anew, timed by the first
    estimate = capsys.readouterr().out.splitlines()[1]
    assert re.search(rf"earlier warm starts in {re.escape(str((tmp_path / 'warm_start').resolve()))} took \d+-\d+s$",
                     estimate)


# --- the running server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("server")
    command = [sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml", f"http.port={free_port()}",
               f"run_dir={run_dir}", f"http.api_key={API_KEY}", "sessions.max_sessions=2",
               "sessions.sequence_gap_timeout_s=3", *SHORT_WARM_START]
    proc, base_url = start_http_app(command, run_dir / "server.log", ROOT)
    # The server spawns its generator last at start (sessions' trainers come later).
    yield {"url": base_url, "proc": proc, "run_dir": run_dir, "generator_pid": newest_job_process(proc.pid)}
    code = stop_http_app(proc)
    output = (run_dir / "server.log").read_text()
    assert code == 128 + signal.SIGTERM, output[-4000:]  # forge.lifecycle: stopped by a signal
    assert "forge training service stopped" in output


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def service(server):
    with ServiceClient(server["url"], API_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def training(service):
    client = service.create_training_client(metadata={"test": "server"})
    yield client
    try:
        client.unload().result()
    except ForgeAPIError as error:  # already unloaded (test_the_client_rl_loop_example_runs_against_the_server)
        assert error.status_code == 404


def _rl_datum(prompt_tokens: list[int], sample, advantage: float) -> ClientDatum:
    p = len(prompt_tokens) - 1
    return ClientDatum(ModelInput.from_ints(prompt_tokens + sample.tokens),
                       {"logprobs": [0.0] * p + sample.logprobs, "advantages": [0.0] * p + [advantage] * len(sample.tokens)})


@pytest.fixture(scope="module")
def data(service):
    out = service.create_sampling_client().sample_many(["12+34=", "7+8=", "50+50="], SamplingParams(max_tokens=4),
                                                       num_samples=2).result()
    rows = []
    for prompt_tokens, samples in zip(out.prompt_tokens, out.samples):
        rows += [_rl_datum(prompt_tokens, samples[0], 1.0), _rl_datum(prompt_tokens, samples[1], -1.0)]
    return rows


def test_health_info_and_openapi(http, server):
    health = httpx.get(f"{server['url']}/health").json()  # open without a key
    assert health["status"] == "ok" and health["generator_replicas_healthy"] == 1
    assert http.get("/api/v1/health").json()["status"] == "ok"
    info = http.get("/api/v1/get_server_info").json()
    assert info["vocab_size"] > 0 and "grpo" in info["loss_fns"] and info["warm_start_accuracy"] >= 0
    assert "warm start" in (server["run_dir"] / "server.log").read_text()  # it said what it was doing
    paths = set(http.get("/openapi.json").json()["paths"])
    for path in ["/health", "/api/v1/create_session", "/api/v1/create_model", "/api/v1/unload_model",
                 "/api/v1/session_heartbeat", "/api/v1/forward_backward", "/api/v1/forward", "/api/v1/optim_step",
                 "/api/v1/save_state", "/api/v1/load_state", "/api/v1/save_weights_for_sampler",
                 "/api/v1/sync_inference_weights", "/api/v1/sample", "/api/v1/checkpoints",
                 "/api/v1/checkpoints/{checkpoint_id}", "/api/v1/sessions", "/api/v1/sessions/{session_id}"]:
        assert path in paths


def test_missing_or_wrong_key_is_401(server):
    missing = httpx.post(f"{server['url']}/api/v1/create_session", json={})
    assert missing.status_code == 401 and "missing API key" in missing.json()["detail"]
    wrong = httpx.get(f"{server['url']}/api/v1/checkpoints", headers={"X-API-Key": "not-the-key"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"


def test_malformed_bodies_are_422_with_field_errors(http, training):
    sid = training.session_id
    no_data = http.post("/api/v1/forward_backward", json={"model_id": sid})
    assert no_data.status_code == 422 and no_data.json()["detail"][0]["loc"] == ["body", "data"]
    typo = http.post("/api/v1/optim_step", json={"model_id": sid, "adam_params": {"learning_rate": -1}})
    assert typo.status_code == 422 and typo.json()["detail"][0]["loc"] == ["body", "adam_params", "learning_rate"]
    unknown = http.post("/api/v1/optim_step", json={"model_id": sid, "adam": {}})
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["body", "adam"]
    datum = {"model_input": {"input_ids": [5, 6, 7]}, "loss_fn_inputs": {"logprobs": [0, 0], "advantages": [0, 1]}}
    loss = http.post("/api/v1/forward_backward", json={"model_id": sid, "data": [datum], "loss_fn": "ppo2"})
    assert loss.status_code == 422 and "must be one of grpo" in loss.json()["detail"][0]["msg"]
    param = http.post("/api/v1/forward_backward", json={"session_id": sid, "data": [datum],
                                                         "loss_fn_config": {"clip": 0.1}})
    assert param.status_code == 422 and param.json()["detail"][0]["loc"] == ["body", "loss_fn_params", "clip"]
    sample = http.post("/api/v1/sample", json={"prompt": "1+1=", "sampling_params": {"top_p": 0}})
    assert sample.status_code == 422 and sample.json()["detail"][0]["loc"] == ["body", "sampling_params"]
    assert "SamplingParams.top_p=0.0: must be in (0, 1]" in sample.json()["detail"][0]["msg"]  # rl.sampling's check
    vocab = http.post("/api/v1/sample", json={"prompt": [10 ** 6]})
    assert vocab.status_code == 422 and "token ids must be in" in vocab.json()["detail"][0]["msg"]
    base = http.post("/api/v1/create_session", json={"base_model": "Qwen/Qwen3-8B"})
    assert base.status_code == 422 and base.json()["detail"][0]["loc"] == ["body", "base_model"]


def test_unknown_session_and_checkpoint_are_404(http):
    missing = http.post("/api/v1/optim_step", json={"model_id": "s-nope"})
    assert missing.status_code == 404 and "session 's-nope' not found" in missing.json()["detail"]
    assert http.get("/api/v1/checkpoints/nope").status_code == 404
    assert http.delete("/api/v1/checkpoints/nope").status_code == 404
    assert http.post("/api/v1/create_session", json={"from_checkpoint": "nope"}).status_code == 404


def test_training_steps_change_the_policy_and_reach_the_sampler(service, training, data):
    steps_before = training.get_info().result().step
    before = training.forward(data).result()
    assert len(before.loss_fn_outputs) == len(data)
    assert len(before.loss_fn_outputs[0].logprobs) == len(data[0].model_input.input_ids) - 1
    # Submitted without waiting: the server runs them in call order (seq_id).
    # With a rollout correction (tis_cap) the loss needs pi_old: the weights since the last optim_step.
    fb = training.forward_backward(data, "grpo", {"clip_eps": 0.2, "tis_cap": 2.0})
    step = training.optim_step(AdamParams(learning_rate=1e-2))
    sync = training.sync_inference_weights()
    fb, step, sync = fb.result(), step.result(), sync.result()
    assert fb.num_datums == len(data) and fb.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert fb.loss_fn_outputs[0].logprobs == pytest.approx(before.loss_fn_outputs[0].logprobs, abs=1e-4)
    assert step.accumulated_batches == 1 and step.step == steps_before + 1 and step.learning_rate == 1e-2
    after = training.forward(data).result()
    assert after.loss_fn_outputs[0].logprobs != before.loss_fn_outputs[0].logprobs
    assert sync.generator_versions == [sync.policy_version] and sync.policy_version >= 1
    sample = service.create_sampling_client().sample("12+34=", SamplingParams(max_tokens=3)).result()
    assert sample.policy_version == sync.policy_version
    assert set(sample.samples[0][0].policy_versions) == {sync.policy_version}
    assert service.health().result().policy_version == sync.policy_version


def test_a_sample_at_another_temperature_is_scored_at_it(service, training):
    # Right after a sync the generators serve this session's weights. The trainer's temperature is 1.0
    # (configs/server_tiny.yaml); these samples' log-probs are at 0.7, and the datums say so.
    params = SamplingParams(max_tokens=4, temperature=0.7)
    out = service.create_sampling_client().sample_many(["12+34=", "7+8="], params, num_samples=2).result()
    pairs = [(prompt, s) for prompt, samples in zip(out.prompt_tokens, out.samples) for s in samples if s.tokens]
    assert pairs and {s.temperature for _, s in pairs} == {0.7}

    def largest_difference(data: list[ClientDatum]) -> float:
        scored = training.forward(data).result().loss_fn_outputs
        return max(abs(x - y) for o, (prompt, s) in zip(scored, pairs)
                   for x, y in zip(o.logprobs[len(prompt) - 1:], s.logprobs))

    assert largest_difference([ClientDatum.from_sample(prompt, s, 1.0) for prompt, s in pairs]) < 1e-4
    # Without the temperature the trainer scores at its own: not the distribution the tokens were drawn from.
    assert largest_difference([ClientDatum(ModelInput.from_ints(prompt + s.tokens)) for prompt, s in pairs]) > 1e-3


def test_requests_run_in_seq_id_order_whatever_order_they_arrive_in(http, service, training, data):
    info = http.get(f"/api/v1/sessions/{training.session_id}").json()
    first = info["next_seq_id"]
    body = {"model_id": training.session_id, "data": [d.to_json() for d in data], "loss_fn": "grpo"}
    results = {}

    def send(name, path, payload):
        results[name] = http.post(path, json=payload)

    # The optimizer step (seq first+1) is sent first and must wait for the forward_backward (seq first).
    step = threading.Thread(target=send, args=("step", "/api/v1/optim_step",
                                               {"model_id": training.session_id, "seq_id": first + 1}))
    step.start()
    time.sleep(0.5)
    assert "step" not in results
    send("fb", "/api/v1/forward_backward", {**body, "seq_id": first})
    step.join(60)
    assert results["fb"].status_code == 200 and results["fb"].json()["seq_id"] == first
    assert results["step"].status_code == 200 and results["step"].json()["accumulated_batches"] == 1
    again = http.post("/api/v1/optim_step", json={"model_id": training.session_id, "seq_id": first})
    assert again.status_code == 409 and "has already run" in again.json()["detail"]
    # A request refused with 422 gives up its seq_id: the next one runs (200), not failed by the gap timeout (409).
    refused = http.post("/api/v1/forward_backward", json={**body, "seq_id": first + 2, "loss_fn_params": {"clip": 1}})
    assert refused.status_code == 422
    after = http.post("/api/v1/optim_step", json={"model_id": training.session_id, "seq_id": first + 3})
    assert after.status_code == 200, after.text
    late = http.post("/api/v1/optim_step", json={"model_id": training.session_id, "seq_id": first + 2})
    assert late.status_code == 409 and "was refused (422: loss_fn_params.clip" in late.json()["detail"]
    # A gap that is never filled: the request waiting on it fails after sessions.sequence_gap_timeout_s (3 s here)
    # with an error that says so, and the late request is refused.
    gap = http.post("/api/v1/optim_step", json={"model_id": training.session_id, "seq_id": first + 5})
    assert gap.status_code == 409
    assert (f"waited 3s (sessions.sequence_gap_timeout_s) for seq_id={first + 4}, which never arrived"
            in gap.json()["detail"])
    late = http.post("/api/v1/optim_step", json={"model_id": training.session_id, "seq_id": first + 4})
    assert late.status_code == 409 and "skipped" in late.json()["detail"]
    # A client for the session continues its numbering.
    resumed = service.training_client(training.session_id)
    assert resumed.optim_step().result().seq_id == first + 6
    training._seq = resumed._seq  # the module's client goes on from there too


def test_a_batch_sent_in_chunks_runs_as_one(training, data):
    whole = training.forward(data, "grpo").result()
    training.max_chunk_datums = 2
    try:
        chunked = training.forward(data, "grpo").result()
        fb = training.forward_backward(data, "grpo").result()
    finally:
        training.max_chunk_datums = 256
    assert chunked.num_datums == fb.num_datums == len(data)
    assert chunked.loss == pytest.approx(whole.loss, abs=1e-6) and fb.loss == pytest.approx(whole.loss, abs=1e-6)
    training.optim_step(AdamParams(learning_rate=1e-9)).result()  # consume the accumulated gradients


def test_checkpoints_save_load_list_delete(http, service, training, data, server):
    rest = service.create_rest_client()
    before = training.forward(data).result()
    full = training.save_state("ck-full").result().checkpoint
    light = training.save_state("ck-weights", with_optimizer=False).result().checkpoint
    export = training.save_weights_for_sampler("hf-export").result().checkpoint
    assert (full.checkpoint_type, full.with_optimizer, light.with_optimizer) == ("state", True, False)
    assert export.checkpoint_type == "sampler"
    assert {"config.json", "model.safetensors"} <= {p.name for p in Path(export.path).iterdir()}
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints().result().checkpoints}
    assert {"ck-full", "ck-weights", "hf-export"} <= set(listed)
    assert rest.get_checkpoint("ck-full").result().path == str(server["run_dir"] / "checkpoints" / "ck-full")

    training.forward_backward(data).result()
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert training.forward(data).result().loss_fn_outputs[0].logprobs != before.loss_fn_outputs[0].logprobs
    loaded = training.load_state_with_optimizer("ck-full").result()
    assert loaded.checkpoint_id == "ck-full" and loaded.with_optimizer
    restored = training.forward(data).result().loss_fn_outputs[0].logprobs
    assert restored == pytest.approx(before.loss_fn_outputs[0].logprobs, abs=1e-5)
    training.load_state("ck-weights").result()
    with pytest.raises(ForgeAPIError) as error:
        training.load_state_with_optimizer("ck-weights").result()
    assert error.value.status_code == 422 and "without the optimizer" in str(error.value)
    with pytest.raises(ForgeAPIError) as error:
        training.load_state("hf-export").result()
    assert error.value.status_code == 422
    bad_name = http.post("/api/v1/save_state", json={"model_id": training.session_id, "path": "../escape"})
    assert bad_name.status_code == 422
    # A checkpoint broken on disk is the server's failure, not the request's: 500 with the cause.
    broken = Path(training.save_state("ck-broken").result().checkpoint.path)
    for file in broken.rglob("*"):
        if file.is_file() and file.name != "forge_checkpoint.json":
            file.write_bytes(b"not a checkpoint")
    with pytest.raises(ForgeAPIError) as error:
        training.load_state("ck-broken").result()
    assert error.value.status_code == 500 and "server-side failure" in str(error.value)
    assert "load_state raised" in str(error.value)
    assert rest.delete_checkpoint("ck-broken").result().deleted

    assert rest.delete_checkpoint("ck-weights").result().deleted
    with pytest.raises(ForgeAPIError) as error:
        rest.get_checkpoint("ck-weights").result()
    assert error.value.status_code == 404


def test_second_session_from_a_checkpoint_then_session_limit_and_idle_timeout(http, service, training, data):
    training.forward_backward(data).result()  # a checkpoint with optimizer state in it
    training.optim_step(AdamParams(learning_rate=1e-3)).result()
    training.save_state("ck-second-session").result()
    other = service.create_training_client_from_state_with_optimizer("ck-second-session", idle_timeout_s=8)
    full = http.post("/api/v1/create_session", json={})
    assert full.status_code == 429 and "max_sessions=2" in full.json()["detail"]
    assert other.info.loaded_from == "ck-second-session" and other.session_id != training.session_id
    beat = other.heartbeat().result()
    assert 0 < beat.expires_in_s <= 8
    same = other.forward(data).result().loss_fn_outputs[0].logprobs
    reference = training.forward(data).result().loss_fn_outputs[0].logprobs  # training's weights: the checkpoint's
    assert same == pytest.approx(reference, abs=1e-5)
    rest = service.create_rest_client()
    assert {s.session_id for s in rest.list_sessions().result().sessions} == {training.session_id, other.session_id}
    # No request, no heartbeat (listing sessions touches none): unloaded after idle_timeout_s by the server's reaper.
    deadline = time.monotonic() + 180
    while other.session_id in {s.session_id for s in rest.list_sessions().result().sessions}:
        assert time.monotonic() < deadline, "the idle session was not unloaded within 180 s"
        time.sleep(1)
    with pytest.raises(ForgeAPIError) as error:
        other.forward(data).result()
    assert error.value.status_code == 404 and "idle_timeout_s" in str(error.value)


def test_create_model_alias_and_unload_model(http):
    created = http.post("/api/v1/create_model", json={"base_model": "tiny", "idle_timeout_s": 60})
    assert created.status_code == 200, created.text
    sid = created.json()["session_id"]
    assert http.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
    assert http.post("/api/v1/unload_model", json={"model_id": sid}).json() == {"session_id": sid, "unloaded": True}
    gone = http.post("/api/v1/session_heartbeat", json={"model_id": sid})
    assert gone.status_code == 404 and "unloaded by the client" in gone.json()["detail"]


def test_the_client_rl_loop_example_runs_against_the_server(server, training):
    training.unload().result()  # frees a session slot for the example's own session
    from apps.examples.client_rl_loop import LoopConfig, run

    lines = []
    result = run(LoopConfig(base_url=server["url"], api_key=API_KEY, steps=2, prompts_per_step=8, group_size=4,
                            minibatches=2, eval_prompts=50), log=lines.append)
    # What it returns is what it printed: accuracy before and after, and one line per step whose policy version
    # grows (each step's sync published new weights).
    start, end = result["accuracy_start"], result["accuracy_end"]
    assert lines[0].endswith(f": held-out greedy accuracy before: {start:.1%}")
    assert lines[-1].startswith(f"held-out greedy accuracy: {start:.1%} -> {end:.1%} ({end - start:+.1%}) after 2 steps")
    steps = [re.fullmatch(r"step (\d)/2: reward ([\d.]+) loss \S+ policy version (\d+) \(\d+s\)", line)
             for line in lines[1:-1]]
    assert all(steps) and [int(m[1]) for m in steps] == [1, 2], lines
    assert [float(m[2]) for m in steps] == pytest.approx(result["rewards"], abs=1e-3)
    assert int(steps[0][3]) < int(steps[1][3])
    health = httpx.get(f"{server['url']}/health").json()
    assert health["sessions"] == 0  # the example unloaded its session


def test_environment_variables_configure_the_client(server, http, monkeypatch):
    monkeypatch.setenv("FORGE_BASE_URL", server["url"])
    monkeypatch.delenv("FORGE_API_KEY", raising=False)
    with ServiceClient() as keyless:  # the URL from the environment, no key: refused by this server
        assert keyless.base_url == server["url"].rstrip("/")
        with pytest.raises(ForgeAPIError) as error:
            keyless.create_rest_client().list_checkpoints().result()
        assert error.value.status_code == 401
    monkeypatch.setenv("FORGE_API_KEY", API_KEY)
    with ServiceClient() as client:
        listed = client.create_rest_client().list_checkpoints().result().checkpoints
    expected = http.get("/api/v1/checkpoints").json()["checkpoints"]
    assert [c.checkpoint_id for c in listed] == [c["checkpoint_id"] for c in expected]


def test_the_serving_docs_client_snippet_runs_against_the_server(server, monkeypatch):
    monkeypatch.setenv("FORGE_BASE_URL", server["url"])
    monkeypatch.setenv("FORGE_API_KEY", API_KEY)
    [snippet] = python_blocks("serving.md")[:1]
    done = run_block(snippet)
    assert "step-1" in done["listed"] and done["saved"].checkpoint.checkpoint_id == "step-1"
    assert done["version"] >= 1 and len(done["data"]) == 8


def test_no_healthy_generator_replica_is_503_naming_its_failure_and_the_server_goes_on(server, http):
    # The module server's last test: it leaves the server without a generator.
    sample = {"prompt": "1+1=", "sampling_params": {"max_tokens": 2}}

    def serves() -> None:  # a restarted replica answers
        assert http.post("/api/v1/sample", json=sample).status_code == 200

    kill_the_generator_for_good(server["proc"].pid, server["run_dir"] / "server.log", server["generator_pid"], serves)
    refused = http.post("/api/v1/sample", json=sample)
    assert refused.status_code == 503, refused.text
    assert refused.json()["detail"].startswith("service generator: no healthy replica left (replica 0: ")
    assert http.get("/api/v1/health").json()["generator_replicas_healthy"] == 0
    assert http.get("/api/v1/get_server_info").status_code == 200


def test_bad_config_fails_before_any_process_starts():
    result = subprocess.run([sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml",
                             "sessions.max_sesions=3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "sessions.max_sesions=3: unknown key. Did you mean 'sessions.max_sessions'?" in result.stderr
    assert "provisioned mesh" not in result.stdout + result.stderr
    bad_key = subprocess.run([sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml",
                              "http.api_key=short"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad_key.returncode == 2 and "http.api_key='short': must be None or at least 8 characters" in bad_key.stderr
