"""The training service's LoRA sessions: adapters over one shared base, through the client SDK (apps.server.client).

The shared trainer is first tested in this process (no Monarch): several adapters over one model, sessions
isolated down to their pending gradients, the sampler on the trainer's own base tensors. Then one server
(`python -m apps.server`, a subprocess) is started for the module and driven only through `apps.server.client`.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from actors.lora_config import LoRAConfig
from actors.trainer_config import TrainerConfig
from apps.server.batches import build_batch
from apps.server.lora_trainer import AdapterSampler, SharedBaseLoRATrainer
from apps.server.schemas import Datum
from apps.server.client import AdamParams, Datum as ClientDatum, ForgeAPIError, ModelInput, SamplingParams, ServiceClient
from forge.provisioner import free_port
from rl.tiny_model import build_tiny_checkpoint
from tests.docs.snippets import python_blocks, run_block
from tests.support import start_http_app, stop_http_app

ROOT = Path(__file__).resolve().parents[3]
API_KEY = "test-key-lora"
pytestmark = [pytest.mark.monarch, pytest.mark.timeout(600)]


# --- the shared trainer in this process -------------------------------------------------------------------
def _batch(seed: int, rows: int = 4, length: int = 10):
    gen = torch.Generator().manual_seed(seed)
    data = []
    for i in range(rows):
        ids = torch.randint(2, 99, (length,), generator=gen).tolist()
        advantage = 1.0 if i % 2 else -1.0
        data.append(Datum.model_validate({"model_input": {"input_ids": ids}, "loss_fn_inputs": {
            "logprobs": [0.0] * 3 + [-1.0] * (length - 4), "advantages": [0.0] * 3 + [advantage] * (length - 4)}}))
    return build_batch(data, pad_id=0, vocab_size=99, max_len=256, needs_rl_inputs=True)


def _adapter_tensors(trainer: SharedBaseLoRATrainer, session_id: str) -> dict[str, torch.Tensor]:
    name = trainer.sessions[session_id].name
    return {k: p.detach().clone() for k, p in trainer.model.named_parameters() if f".{name}." in k}


def test_adapters_over_one_base_keep_to_their_sessions_and_the_sampler_reuses_the_base(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", seed=0)
    trainer = SharedBaseLoRATrainer(TrainerConfig(model_path=str(checkpoint)))
    base = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    added = trainer.add_session("s-a", LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]), 0)
    trainer.add_session("s-b", LoRAConfig(rank=8, target_modules=["q_proj", "down_proj"]), 1)
    # One base: the adapters add their own parameters only (A: 2 layers x (q: 4x128 + 128x4, v: 4x128 + 64x4)).
    assert added["adapter_parameters"] == 2 * (4 * 128 + 128 * 4 + 4 * 128 + 64 * 4)
    batch = _batch(0)

    def step(session_id: str) -> dict:
        trainer.run(session_id, "forward_backward", batch, "grpo", {})
        return trainer.run(session_id, "optim_step", 5e-2, (0.9, 0.999), 1e-8, 0.0, None)

    step("s-b")
    b_logprobs = trainer.run("s-b", "forward_only", batch, None, {})["logprobs"]
    trainer.run("s-a", "forward_backward", batch, "grpo", {})  # A's gradients wait for A's optim_step
    a_before = _adapter_tensors(trainer, "s-a")
    step("s-b")  # B's step with A's gradients pending: A's adapter does not move, its gradients stay
    assert all(torch.equal(a_before[k], v) for k, v in _adapter_tensors(trainer, "s-a").items())
    b_after = trainer.run("s-b", "forward_only", batch, None, {})["logprobs"]
    assert not torch.equal(b_after, b_logprobs)
    assert step("s-a")["accumulated_batches"] == 2  # its pending batch and this one
    assert trainer.run("s-b", "forward_only", batch, None, {})["logprobs"].equal(b_after)  # A's steps: B unchanged
    for name, value in trainer.model.named_parameters():  # the base never trains
        if ".lora_" not in name:
            assert torch.equal(value, base[name.replace(".base_layer.", ".")]), name

    sampler = AdapterSampler(trainer.base_hf_state(), str(checkpoint))
    trainer_storage = {p.data_ptr() for k, p in trainer.model.named_parameters() if ".lora_" not in k}
    assert {p.data_ptr() for p in sampler.model.parameters()} <= trainer_storage  # no second copy of the base

    trainer.remove_session("s-b")
    assert not [k for k in dict(trainer.model.named_parameters()) if ".s_s_b." in k]
    assert list(trainer.sessions) == ["s-a"]


def test_a_dropout_sessions_scores_are_its_policy_every_time(tmp_path):
    # Dropout acts on the gradient pass only: `forward` and the pi_old of a rollout correction are the policy itself.
    trainer = SharedBaseLoRATrainer(TrainerConfig(model_path=str(build_tiny_checkpoint(tmp_path / "tiny", seed=0))))
    trainer.add_session("s-d", LoRAConfig(rank=4, dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]), 0)
    batch = _batch(2)
    trainer.run("s-d", "forward_backward", batch, "grpo", {})
    trainer.run("s-d", "optim_step", 5e-2, (0.9, 0.999), 1e-8, 0.0, None)  # B leaves 0: dropout now matters
    first = trainer.run("s-d", "forward_only", batch, None, {})["logprobs"]
    assert torch.equal(trainer.run("s-d", "forward_only", batch, None, {})["logprobs"], first)
    batch.behaviour_logprobs = first.clone()  # sampled by this very policy: every correction weight is 1
    out = trainer.run("s-d", "forward_backward", batch, "grpo", {"tis_cap": 2.0})
    assert out["metrics"]["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)


def test_forward_with_a_rollout_correction_gives_the_losss_value(tmp_path):
    # The correction needs pi_old, which forward_backward passes and forward did not: a 500 for a valid request.
    trainer = SharedBaseLoRATrainer(TrainerConfig(model_path=str(build_tiny_checkpoint(tmp_path / "tiny", seed=0))))
    trainer.add_session("s-c", LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]), 0)
    batch = _batch(3)
    batch.behaviour_logprobs = trainer.run("s-c", "forward_only", batch, None, {})["logprobs"]
    scored = trainer.run("s-c", "forward_only", batch, "grpo", {"tis_cap": 2.0})
    trained = trainer.run("s-c", "forward_backward", batch, "grpo", {"tis_cap": 2.0})
    assert scored["loss"] == pytest.approx(trained["loss"], abs=1e-6)
    assert scored["metrics"]["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)


# --- the server, through apps.server.client ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("server-lora")
    command = [sys.executable, "-m", "apps.server", "--config", "configs/server_tiny.yaml", f"http.port={free_port()}",
               f"run_dir={run_dir}", f"http.api_key={API_KEY}", "sessions.max_sessions=1",
               "sessions.max_lora_sessions=3", "warm_start.max_steps=20"]
    proc, base_url = start_http_app(command, run_dir / "server.log", ROOT)
    yield {"url": base_url, "run_dir": run_dir}
    code = stop_http_app(proc)
    assert code == 128 + signal.SIGTERM, (run_dir / "server.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def service(server):
    with ServiceClient(server["url"], API_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def sessions(service):
    a = service.create_lora_training_client(rank=4, target_modules=["q_proj", "v_proj"], seed=1)
    b = service.create_lora_training_client("tiny", 8)
    yield a, b
    for client in (a, b):
        client.unload().result()


@pytest.fixture(scope="module")
def data(service):
    out = service.create_sampling_client().sample_many(["12+34=", "7+8="], SamplingParams(max_tokens=4),
                                                       num_samples=2).result()
    rows = []
    for prompt, samples in zip(out.prompt_tokens, out.samples):
        p = len(prompt) - 1
        for sample, advantage in zip(samples, (1.0, -1.0)):
            rows.append(ClientDatum(ModelInput.from_ints(prompt + sample.tokens), {
                "logprobs": [0.0] * p + sample.logprobs, "advantages": [0.0] * p + [advantage] * len(sample.tokens)}))
    return rows


def _logprobs(client, data) -> list[list[float]]:
    return [o.logprobs for o in client.forward(data).result().loss_fn_outputs]


def _train(client, data, steps: int, lr: float = 5e-2) -> None:
    for _ in range(steps):
        client.forward_backward(data, "grpo")
        client.optim_step(AdamParams(learning_rate=lr)).result()


def test_lora_sessions_share_one_trainer_process_and_never_see_each_other(service, sessions, data):
    a, b = sessions
    assert a.info.lora == {"rank": 4, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    assert b.info.lora["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]
    trainers = [name for name in service.get_memory().result().processes if "trainer" in name]
    assert len(trainers) == 1 and trainers[0].startswith("lora-trainer"), trainers  # one process for both

    base = _logprobs(a, data)
    assert _logprobs(b, data) == base  # both adapters start at B = 0: the base model
    _train(b, data, 1)
    b_trained = _logprobs(b, data)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    b_sampler = b.save_weights_and_get_sampling_client("lora-b-1")
    b_samples = b_sampler.sample("12+34=", greedy).result()
    _train(a, data, 3)
    assert max(abs(x - y) for r, s in zip(_logprobs(a, data), base) for x, y in zip(r, s)) > 1e-2
    assert _logprobs(b, data) == b_trained  # A's training never touched B's adapter or the shared base
    assert b_sampler.sample("12+34=", greedy).result().samples == b_samples.samples


def test_a_saved_adapter_samples_with_exactly_that_adapter(service, sessions, data):
    a, b = sessions
    sampler = a.save_weights_and_get_sampling_client("lora-a")
    saved = service.create_rest_client().get_checkpoint("lora-a").result()
    assert saved.checkpoint_type == "sampler" and saved.lora == a.info.lora
    assert {p.name for p in Path(saved.path).iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    out = service.create_sampling_client(model_path=saved.path).sample("12+34=", SamplingParams(max_tokens=6),
                                                                       num_samples=4).result()
    assert out.model_path == "lora-a"
    prompt = out.prompt_tokens[0]
    rows = [ClientDatum(ModelInput.from_ints(prompt + s.tokens)) for s in out.samples[0] if s.tokens]
    sampled = [s.logprobs for s in out.samples[0] if s.tokens]
    a_scores = [lp[len(prompt) - 1:] for lp in _logprobs(a, rows)]
    b_scores = [lp[len(prompt) - 1:] for lp in _logprobs(b, rows)]
    assert max(abs(x - y) for r, s in zip(a_scores, sampled) for x, y in zip(r, s)) < 1e-4  # A's policy exactly
    assert max(abs(x - y) for r, s in zip(b_scores, sampled) for x, y in zip(r, s)) > 1e-3  # not B's
    assert sampler.sample("12+34=", SamplingParams(max_tokens=6, temperature=0.0)).result().model_path == "lora-a"


def test_a_top_k_sample_carries_its_kept_sets_and_trains_on_the_distribution_it_was_drawn_from(service, sessions):
    a, _ = sessions
    a.save_weights_for_sampler("lora-a-top-k").result()
    params = SamplingParams(max_tokens=6, top_k=5, top_p=0.9)
    out = service.create_sampling_client(model_path="lora-a-top-k").sample("12+34=", params, num_samples=4).result()
    prompt, samples = out.prompt_tokens[0], [s for s in out.samples[0] if s.tokens]
    assert samples and all(len(s.kept_token_ids) == len(s.tokens) for s in samples)
    assert all(token in kept and len(kept) <= 5 for s in samples for token, kept in zip(s.tokens, s.kept_token_ids))

    def largest_difference(data) -> float:
        scored = [lp[len(prompt) - 1:] for lp in _logprobs(a, data)]
        return max(abs(x - y) for row, s in zip(scored, samples) for x, y in zip(row, s.logprobs))

    assert largest_difference([ClientDatum.from_sample(prompt, s, 1.0) for s in samples]) < 1e-4
    # Without the kept sets the trainer scores the full distribution: not the one the tokens were drawn from.
    assert largest_difference([ClientDatum(ModelInput.from_ints(prompt + s.tokens)) for s in samples]) > 1e-3


def test_a_sample_at_another_temperature_trains_at_it(service, data):
    # The trainer's temperature is 1.0 (configs/server_tiny.yaml); the adapter's samples are drawn at 0.7.
    session = service.create_lora_training_client(rank=4, target_modules=["q_proj", "v_proj"], seed=3)
    try:
        _train(session, data, 1)  # B leaves 0: the adapter is not the base
        sampler = session.save_weights_and_get_sampling_client("lora-t07")
        params = SamplingParams(max_tokens=6, temperature=0.7)
        out = sampler.sample_many(["12+34=", "7+8="], params, num_samples=2).result()
        pairs = [(prompt, s) for prompt, samples in zip(out.prompt_tokens, out.samples) for s in samples if s.tokens]
        assert pairs and {s.temperature for _, s in pairs} == {0.7}
        datums = [ClientDatum.from_sample(prompt, s, 1.0) for prompt, s in pairs]

        def largest_difference(scored: list[list[float]]) -> float:
            return max(abs(x - y) for row, (prompt, s) in zip(scored, pairs)
                       for x, y in zip(row[len(prompt) - 1:], s.logprobs))

        assert largest_difference(_logprobs(session, datums)) < 1e-4
        # forward_backward scores them at 0.7 too: every rollout-correction weight pi / behaviour is 1.
        trained = session.forward_backward(datums, "grpo", {"tis_cap": 2.0}).result()
        assert largest_difference([o.logprobs for o in trained.loss_fn_outputs]) < 1e-4
        assert trained.metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        plain = [ClientDatum(ModelInput.from_ints(prompt + s.tokens)) for prompt, s in pairs]
        assert largest_difference(_logprobs(session, plain)) > 1e-3  # at the trainer's 1.0: another distribution
    finally:
        session.unload().result()


def test_a_dropout_session_forwards_its_policy_every_time(service, data):
    session = service.create_lora_training_client(rank=4, dropout=0.1, target_modules=["q_proj", "v_proj"])
    try:
        _train(session, data, 1)  # B leaves 0: dropout now changes what a forward pass with it computes
        first = _logprobs(session, data)
        assert _logprobs(session, data) == first
    finally:
        session.unload().result()


def test_save_state_and_load_state_hold_the_adapter_and_its_optimizer(service, sessions, data):
    a, b = sessions
    a.save_state("lora-a-state").result()
    saved = _logprobs(a, data)
    _train(a, data, 1)
    after_one_step = _logprobs(a, data)
    assert a.load_state_with_optimizer("lora-a-state").result().step == 3
    assert _logprobs(a, data) == saved
    _train(a, data, 1)  # the restored Adam moments give exactly the same step again
    assert _logprobs(a, data) == after_one_step

    copy = service.create_training_client_from_state_with_optimizer("lora-a-state")
    try:
        assert copy.info.lora == a.info.lora and copy.info.step == 3
        assert _logprobs(copy, data) == saved
    finally:
        copy.unload().result()
    with pytest.raises(ForgeAPIError) as error:  # B's adapter has another rank and other targets
        b.load_state("lora-a-state").result()
    assert error.value.status_code == 422 and error.value.detail[0]["loc"] == ["body", "path"]
    assert "rank 4" in error.value.detail[0]["msg"] and "rank 16" not in error.value.detail[0]["msg"]


@pytest.mark.parametrize("kwargs, loc, says", [
    ({"rank": 0}, ["body", "lora", "rank"], "greater than or equal to 1"),
    ({"rank": 1024}, ["body", "lora", "rank"], "must be <= the model's hidden_size 128"),
    ({"target_modules": ["q_prj"]}, ["body", "lora", "target_modules"], "allowed: ['q_proj'"),
    ({"base_model": "Qwen/Qwen3-8B"}, ["body", "base_model"], "this server trains only"),
])
def test_a_bad_lora_session_is_a_422_naming_the_field(service, kwargs, loc, says):
    with pytest.raises(ForgeAPIError) as error:
        service.create_lora_training_client(**kwargs)
    assert error.value.status_code == 422
    assert error.value.detail[0]["loc"] == loc and says in error.value.detail[0]["msg"], error.value.detail


def test_requests_a_lora_session_cannot_make_are_4xx_naming_the_field(service, sessions):
    a, _ = sessions
    with pytest.raises(ForgeAPIError) as error:  # its adapter never goes to the shared generators
        a.sync_inference_weights().result()
    assert error.value.status_code == 422 and error.value.detail[0]["loc"] == ["body", "model_id"]
    with pytest.raises(ForgeAPIError) as error:
        service.create_sampling_client(model_path="no-such-adapter").sample("1+1=").result()
    assert error.value.status_code == 404 and error.value.detail[0]["loc"] == ["body", "model_path"]
    a.save_state("lora-a-for-sampling").result()  # at once: the refused seq_id was given up, no gap to wait on
    with pytest.raises(ForgeAPIError) as error:
        service.create_sampling_client(model_path="lora-a-for-sampling").sample("1+1=").result()
    assert error.value.status_code == 422 and "save_weights_for_sampler" in error.value.detail[0]["msg"]
    third = service.create_lora_training_client(rank=2)
    try:
        with pytest.raises(ForgeAPIError) as error:
            service.create_lora_training_client(rank=2)
        assert error.value.status_code == 429 and "max_lora_sessions=3" in str(error.value.detail)
    finally:
        third.unload().result()


def test_the_serving_docs_lora_snippet_runs_against_the_server(server, monkeypatch):
    monkeypatch.setenv("FORGE_BASE_URL", server["url"])
    monkeypatch.setenv("FORGE_API_KEY", API_KEY)
    [snippet] = [block for block in python_blocks("serving.md") if "create_lora_training_client(" in block
                  and "import tinker" not in block]
    done = run_block(snippet)
    assert done["saved"].checkpoint.lora["rank"] == 8 and isinstance(done["text"], str)
    assert done["adapter"].model_path == "my-adapter-1"
