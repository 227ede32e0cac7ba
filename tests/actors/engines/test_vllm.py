"""The vLLM engine against the same contract as the hf engine (needs CUDA and the `vllm` extra).

These tests skip on a machine without CUDA; they have not yet run on a GPU (see actors/engines/vllm.py).
"""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge.tiny_model import build_tiny_checkpoint
from forge.types import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra (pip install -e '.[vllm]')"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def engine(checkpoint):
    from actors.engines.vllm import VLLMEngine

    return VLLMEngine(checkpoint, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)


def _teacher_forced_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + token_ids], device="cuda")
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    return logprobs.gather(-1, targets[:, None])[:, 0][len(prompt_ids) - 1 :].tolist()


def test_behaviour_logprobs_equal_a_teacher_forced_forward(engine, checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    groups = engine.generate(["12+34=", "7+8="], SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=0))
    assert [len(group) for group in groups] == [4, 4]
    for group in groups:
        for completion in group:
            assert len(completion.logprobs) == len(completion.token_ids) == len(completion.policy_versions)
            expected = _teacher_forced_logprobs(model, completion.prompt_ids, completion.token_ids)
            assert completion.logprobs == pytest.approx(expected, abs=1e-3)


def test_weights_swap_between_batches_and_tokens_carry_the_version(engine, checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    weights = {name: tensor + 0.01 for name, tensor in model.state_dict().items()}
    engine.stage_weights(weights, version=3)
    assert engine.policy_version == 0  # staged, not applied until the next batch starts
    (group,) = engine.generate(["1+2="], SamplingParams(n=2, max_tokens=3))
    assert engine.policy_version == 3
    assert all(set(c.policy_versions) == {3} for c in group)
    engine.load_weights(model.state_dict(), version=4)
    (group,) = engine.generate(["1+2="], SamplingParams(n=1, max_tokens=3, temperature=0.0))
    assert set(group[0].policy_versions) == {4}


def test_refuses_temperatures_whose_logprobs_it_cannot_report(engine):
    with pytest.raises(ValueError, match=r"temperature=0.7: the vllm engine supports 1.0"):
        engine.generate(["1+2="], SamplingParams(max_tokens=2, temperature=0.7))
