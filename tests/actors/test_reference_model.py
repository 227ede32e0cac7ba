"""Tests for actors.reference_model: chunked log-probs equal the whole-batch ones and transformers'; frozen."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.reference_model import ReferenceConfig, ReferenceModel
from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from rl.tiny_model import build_tiny_checkpoint
from rl.types import TrainBatch

VOCAB = 99


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def sequences(rows: int = 5, length: int = 14) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))


def hf_logprobs(path: Path, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(path)(input_ids).logits[:, :-1] / temperature
    return logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def test_chunked_logprobs_equal_whole_batch_and_transformers(checkpoint: Path) -> None:
    input_ids = sequences()
    chunked = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), chunk_rows=2)).logprobs(input_ids)
    whole = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), chunk_rows=5)).logprobs(input_ids)
    assert chunked.shape == (5, 13) and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked, hf_logprobs(checkpoint, input_ids), rtol=0, atol=1e-5)


def test_logits_exist_only_one_chunk_of_rows_at_a_time(checkpoint: Path) -> None:
    reference = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), chunk_rows=2))
    logits_shapes = []
    reference.model.lm_head.register_forward_hook(lambda module, args, out: logits_shapes.append(tuple(out.shape)))
    reference.logprobs(sequences(rows=5, length=14))
    assert logits_shapes == [(2, 13, VOCAB), (2, 13, VOCAB), (1, 13, VOCAB)]


def test_reference_is_frozen_and_returns_no_graph(checkpoint: Path) -> None:
    reference = ReferenceModel(ReferenceConfig(model_path=str(checkpoint)))
    assert not any(p.requires_grad for p in reference.model.parameters())
    with torch.enable_grad():
        logprobs = reference.logprobs(sequences())
    assert not logprobs.requires_grad and logprobs.grad_fn is None


def test_reference_equals_the_trainers_initial_policy(checkpoint: Path) -> None:
    input_ids = sequences(rows=4)
    zeros = torch.zeros(4, input_ids.shape[1] - 1)
    batch = TrainBatch(input_ids=input_ids, response_mask=zeros, behaviour_logprobs=zeros,
                       policy_versions=zeros.long(), advantages=torch.zeros(4), rewards=torch.zeros(4))
    trainer = TitanTrainer(TrainerConfig(model_path=str(checkpoint), temperature=0.7))
    reference = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), temperature=0.7))
    expected = hf_logprobs(checkpoint, input_ids, temperature=0.7)
    torch.testing.assert_close(reference.logprobs(input_ids), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(trainer.logprobs(batch), expected, rtol=0, atol=1e-5)


def test_reference_replays_the_kept_sets_of_truncated_sampling(checkpoint: Path) -> None:
    """Chunk by chunk, positions with a kept set are renormalised over it (like the trainer), others are not."""
    input_ids = sequences()
    kept = torch.full((5, 13, 3), -1, dtype=torch.int32)
    kept[:, 6:, 0] = input_ids[:, 7:]  # the target, and two other tokens
    kept[:, 6:, 1:] = torch.tensor([1, 2], dtype=torch.int32)
    reference = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), chunk_rows=2, temperature=0.7))
    replayed = reference.logprobs(input_ids, kept)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(checkpoint)(input_ids).logits[:, :-1].double() / 0.7
    kept_logits = torch.stack([logits.gather(-1, input_ids[:, 1:, None])[..., 0], logits[..., 1], logits[..., 2]], -1)
    expected = hf_logprobs(checkpoint, input_ids, temperature=0.7).double()
    expected[:, 6:] = (kept_logits[..., 0] - kept_logits.logsumexp(-1))[:, 6:]
    torch.testing.assert_close(replayed.double(), expected, rtol=0, atol=1e-5)


def test_bfloat16_reference_stores_bfloat16_weights(checkpoint: Path) -> None:
    input_ids = sequences()
    reference = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), dtype="bfloat16"))
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    logprobs = reference.logprobs(input_ids)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, hf_logprobs(checkpoint, input_ids), rtol=0, atol=0.1)


@pytest.mark.parametrize("overrides, field, allowed", [
    ({"chunk_rows": 0}, "chunk_rows", "an int >= 1"),
    ({"temperature": 0.0}, "temperature", "a number > 0"),
    ({"device": "tpu"}, "device", "one of cpu, cuda"),
])
def test_config_errors_name_the_field(checkpoint: Path, overrides: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"ReferenceConfig.{field}={overrides[field]!r}: must be {allowed}")):
        ReferenceConfig(model_path=str(checkpoint), **overrides)


def test_sequences_outside_the_vocabulary_are_rejected(checkpoint: Path) -> None:
    reference = ReferenceModel(ReferenceConfig(model_path=str(checkpoint)))
    with pytest.raises(ValueError, match=rf"must be in \[0, {VOCAB}\)"):
        reference.logprobs(torch.full((2, 5), VOCAB))


@pytest.mark.parametrize(("k", "temperature"), [(5, 0.7), (VOCAB + 10, 1.0)])
def test_topk_logprobs_are_the_teachers_most_likely_tokens_and_the_rest_of_its_mass(checkpoint: Path, k: int,
                                                                                    temperature: float) -> None:
    input_ids = sequences()
    reference = ReferenceModel(ReferenceConfig(model_path=str(checkpoint), chunk_rows=2, temperature=temperature))
    sampled, ids, buckets = reference.topk_logprobs(input_ids, k)
    width = min(k, VOCAB)
    assert ids.shape == (5, 13, width) and buckets.shape == (5, 13, width + 1)
    torch.testing.assert_close(sampled, reference.logprobs(input_ids), rtol=0, atol=1e-6)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(checkpoint)(input_ids).logits[:, :-1] / temperature
    full = logits.double().log_softmax(-1)
    expected = full.topk(width, dim=-1)
    torch.testing.assert_close(buckets[..., :-1].double(), expected.values, rtol=0, atol=1e-5)
    assert torch.equal(full.gather(-1, ids).double(), full.gather(-1, expected.indices))  # ties aside, the same tokens
    if width < VOCAB:
        rest = torch.log1p(-expected.values.exp().sum(-1))
        torch.testing.assert_close(buckets[..., -1].double(), rest, rtol=0, atol=1e-5)
    else:  # nothing is left: the floor, finite
        assert (buckets[..., -1] == torch.finfo(torch.float32).min).all()
