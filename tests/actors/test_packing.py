"""Packed rows in the trainer (rl.types.TrainBatch.document_ids, actors.model_builder.DocumentMask): a packed
batch gives the loss, the gradients and the log-probs of the same examples one per row, and leaves the model as
built for every other batch."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from actors.model_builder import SDPAttention
from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from apps.sft.data import Example, train_batch
from losses.nll import nll

PAD = 0
CHECKPOINTS = {"qwen3": "checkpoint", "llama3": "llama_checkpoint"}  # tests/actors/conftest.py


def examples(count: int, seed: int) -> list[Example]:
    """Prompts then learned completions, of lengths 3 to 14, so rows pack two to four examples."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt, completion = rng.randint(1, 8), rng.randint(2, 6)
        ids = tuple(rng.randint(3, 98) for _ in range(prompt + completion))
        out.append(Example(ids, (False,) * prompt + (True,) * completion))
    return out


def trainer(path: Path, family: str, **overrides) -> TitanTrainer:
    return TitanTrainer(TrainerConfig(model_path=str(path), family=family, loss="losses.nll:nll",
                                      temperature=1.0, **overrides))


def loss_and_gradients(trainer: TitanTrainer, batch) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.optimizers.zero_grad()
    out, _, _ = trainer.accumulate_gradients(batch, nll, {})
    grads = {name: p.grad for name, p in trainer.model.named_parameters()}
    return out.loss.item(), {n: (g.full_tensor() if isinstance(g, DTensor) else g.clone()) for n, g in grads.items()}


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {}),
    ("qwen3", {"micro_batch_size": 2}),  # several micro-batches: the forward recomputed micro-batch by micro-batch
    ("qwen3", {"activation_checkpoint": "full"}),  # the backward pass recomputes each layer's forward
    ("llama3", {}),
])
def test_packed_batch_gives_the_unpacked_loss_and_gradients(family: str, overrides: dict,
                                                            request: pytest.FixtureRequest) -> None:
    model = trainer(request.getfixturevalue(CHECKPOINTS[family]), family, **overrides)
    batch = examples(12, seed=1)
    packed = train_batch(batch, PAD, pack_to=32)
    assert packed.num_sequences < len(batch) and int(packed.document_ids.max()) >= 2  # rows hold several examples
    loss, grads = loss_and_gradients(model, train_batch(batch, PAD))
    packed_loss, packed_grads = loss_and_gradients(model, packed)
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    for name in grads:
        torch.testing.assert_close(packed_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_document_masking_the_packed_loss_differs(checkpoint: Path) -> None:
    """What the test above guards against: the same packed rows under plain causal attention see earlier examples."""
    model = trainer(checkpoint, "qwen3")
    batch = examples(12, seed=1)
    packed = train_batch(batch, PAD, pack_to=32)
    packed.document_ids = None
    assert loss_and_gradients(model, packed)[0] != pytest.approx(loss_and_gradients(model, train_batch(batch, PAD))[0],
                                                                 rel=1e-3)


def test_packed_logprobs_are_the_unpacked_ones_at_every_learned_token(checkpoint: Path) -> None:
    """The held-out loss's scoring: the learned tokens' log-probs, wherever the example sits."""
    model = trainer(checkpoint, "qwen3", micro_batch_size=2)
    batch = examples(10, seed=2)
    unpacked, packed = train_batch(batch, PAD), train_batch(batch, PAD, pack_to=24, ranks=2)
    assert packed.num_sequences % 2 == 0
    learned = model.logprobs(unpacked)[unpacked.response_mask > 0]
    packed_learned = model.logprobs(packed)[packed.response_mask > 0]
    torch.testing.assert_close(packed_learned.sort().values, learned.sort().values, rtol=0, atol=2e-5)
    assert nll(model.logprobs(packed), packed).loss.item() == pytest.approx(nll(model.logprobs(unpacked),
                                                                                unpacked).loss.item(), rel=1e-5)


def test_the_model_attends_causally_again_after_a_packed_batch(checkpoint: Path) -> None:
    """GRPO's batches (no document ids) run the model exactly as built, before and after packed ones."""
    model = trainer(checkpoint, "qwen3")
    unpacked = train_batch(examples(6, seed=3), PAD)
    before = model.logprobs(unpacked)
    model.train_step(train_batch(examples(6, seed=4), PAD, pack_to=32))  # a step changes the weights: compare after
    model.logprobs(train_batch(examples(6, seed=4), PAD, pack_to=32))
    # The mask goes with each forward pass (its attention_masks): nothing in the model is swapped or left behind.
    attention = [m for m in model.model.modules() if hasattr(m, "inner_attention")]
    assert attention and all(isinstance(m.inner_attention, SDPAttention) for m in attention)
    assert not torch.equal(model.logprobs(unpacked), before)  # sanity: the packed step trained the model


def _fsdp_worker(rank: int, world_size: int, port: int, path: str, out_dir: str) -> None:
    """One FSDP rank: the loss and full gradients of the same examples packed and unpacked, a micro-batch of one row
    per pass (recomputed for the backward)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = TitanTrainer(TrainerConfig(model_path=path, loss="losses.nll:nll", temperature=1.0,
                                           micro_batch_size=1), rank=rank, world_size=world_size)
        batch = examples(12, seed=1)
        result = {"unpacked": loss_and_gradients(model, train_batch(batch, PAD)),
                  "packed": loss_and_gradients(model, train_batch(batch, PAD, pack_to=32, ranks=world_size))}
        torch.save(result, Path(out_dir) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp_two_ranks_packed_give_the_unpacked_loss_and_gradients(checkpoint: Path, tmp_path: Path) -> None:
    from tests.actors.test_trainer import run_ranks  # not at the top: this file also runs as a rank's script

    result = run_ranks(__file__, checkpoint, tmp_path)[0]
    (loss, grads), (packed_loss, packed_grads) = result["unpacked"], result["packed"]
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    for name in grads:
        torch.testing.assert_close(packed_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


if __name__ == "__main__":  # one rank of the FSDP test, started by run_ranks
    _fsdp_worker(*map(int, sys.argv[1:4]), *sys.argv[4:])
