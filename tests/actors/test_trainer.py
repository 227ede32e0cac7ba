"""Tests for the trainer (actors.titan_trainer, actors.trainer_config, actors.checkpoint): HF parity, exact
gradient accumulation, FSDP parity, checkpoints, export, learning, bad input."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.checkpoint import CHECKSUMS_FILE, is_model_key
from actors.logprobs import bucket_logprobs, token_entropy, topk_logprobs
from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from rl.tiny_model import build_tiny_checkpoint
from rl.types import TrainBatch

PROMPT_LEN = 4


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tied"), seed=1, tie_word_embeddings=True)


def make_batch(seed: int, *, rows: int = 4, length: int = 12, vocab: int = 99) -> TrainBatch:
    """Right-padded sequences with responses of different lengths, so a token mean and a sequence mean differ."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, length), generator=gen)
    response_mask = torch.zeros(rows, length - 1)
    for row in range(rows):
        end = length - 1 - 2 * (row % 3)  # responses of 7, 5 and 3 tokens
        response_mask[row, PROMPT_LEN - 1 : end] = 1
        input_ids[row, end + 1 :] = 0  # padding after the response
    return TrainBatch(
        input_ids=input_ids,
        response_mask=response_mask,
        behaviour_logprobs=torch.full((rows, length - 1), -4.0),
        policy_versions=torch.where(response_mask > 0, 0, -1).long(),
        advantages=torch.linspace(1.0, -1.0, rows),
        rewards=torch.linspace(1.0, 0.0, rows),
    )


def trainer_config(path: Path, **overrides) -> TrainerConfig:
    # Adam's first update is lr * g / (|g| + eps): with the default eps=1e-8 a gradient element near 1e-8
    # turns float rounding (a different summation order) into weight differences of ~1e-5.
    return TrainerConfig(**{"model_path": str(path), "lr": 1e-3, "eps": 1e-6, "loss": "dapo", **overrides})


def gradients(trainer: TitanTrainer) -> dict[str, torch.Tensor]:
    """The gradients of the last step (clipped), full tensors in torchtitan names; a collective under FSDP."""
    grads = {name: p.grad for name, p in trainer.model.named_parameters()}
    return {name: g.full_tensor() if isinstance(g, DTensor) else g.clone() for name, g in grads.items()}


def hf_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1]
    return logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


# ---------------------------------------------------------------------------------------------------
# Log-probs: the torchtitan model reproduces transformers through the state-dict adapter


@pytest.mark.parametrize("family, fixture", [("qwen3", "checkpoint"), ("qwen3", "tied_checkpoint"),
                                              ("llama3", "llama_checkpoint")])
def test_logprobs_equal_transformers(family: str, fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    batch = make_batch(0)
    trainer = TitanTrainer(trainer_config(path, family=family, micro_batch_size=3))
    expected = hf_logprobs(AutoModelForCausalLM.from_pretrained(path), batch.input_ids)
    torch.testing.assert_close(trainer.logprobs(batch), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, fixture", [("qwen3", "checkpoint"), ("llama3", "llama_checkpoint")])
def test_hf_state_dict_has_the_checkpoints_names_and_values(family: str, fixture: str,
                                                            request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    trainer = TitanTrainer(trainer_config(path, family=family))
    expected = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert_same_weights(trainer.hf_state_dict(), dict(expected), atol=0)


# ---------------------------------------------------------------------------------------------------
# One step


def test_micro_batches_give_the_full_batch_step(checkpoint: Path) -> None:
    # DAPO averages over all response tokens of the batch: weighting micro-batches by rows would be wrong.
    batch = make_batch(1)
    whole = TitanTrainer(trainer_config(checkpoint, micro_batch_size=4))
    split = TitanTrainer(trainer_config(checkpoint, micro_batch_size=1))
    before = whole.hf_state_dict()
    whole_metrics, split_metrics = whole.train_step(batch), split.train_step(batch)
    assert whole_metrics["loss"] == pytest.approx(split_metrics["loss"], abs=1e-6)
    assert whole_metrics["grad_norm"] == pytest.approx(split_metrics["grad_norm"], rel=1e-5)
    # Four micro-batches sum their gradients in another order than one pass: 3e-8 apart here (AVX2); the same
    # rounding went over 1e-7 on CI's AVX-512 host in tests/actors/test_lora.py.
    assert_same_weights(gradients(whole), gradients(split), atol=1e-6)
    assert_same_weights(whole.hf_state_dict(), split.hf_state_dict(), atol=1e-6)
    assert not torch.equal(before["lm_head.weight"], whole.hf_state_dict()["lm_head.weight"])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_applies_on_one_rank_and_changes_no_number(checkpoint: Path, mode: str) -> None:
    # torchtitan applies it inside parallelize_fn, which one rank skips: the setting was silently ignored there.
    batch = make_batch(1)
    plain, checkpointed = TitanTrainer(trainer_config(checkpoint)), TitanTrainer(
        trainer_config(checkpoint, activation_checkpoint=mode))
    calls = []  # a checkpointed block runs again in the backward pass, recomputing what it did not keep
    second_block = checkpointed.model.layers["1"]
    getattr(second_block, "_checkpoint_wrapped_module", second_block).register_forward_hook(lambda *_: calls.append(1))
    plain_metrics, checkpointed_metrics = plain.train_step(batch), checkpointed.train_step(batch)
    assert len(calls) == 2  # "selective" checkpoints every second block
    assert checkpointed_metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
    assert_same_weights(plain.hf_state_dict(), checkpointed.hf_state_dict(), atol=1e-6)


def test_minibatches_are_successive_optimizer_steps_in_one_version(checkpoint: Path) -> None:
    # Two slices of rows, two Adam steps (the second off-policy), but one published policy version.
    batch = make_batch(4)
    sliced = TitanTrainer(trainer_config(checkpoint, loss="grpo", minibatches=2))
    by_hand = TitanTrainer(trainer_config(checkpoint, loss="grpo"))
    metrics = sliced.train_step(batch)
    halves = [by_hand.train_step(batch.slice(0, 2)), by_hand.train_step(batch.slice(2, 4))]
    assert_same_weights(sliced.hf_state_dict(), by_hand.hf_state_dict(), atol=1e-6)
    assert sliced.policy_version == sliced.step == 1
    assert metrics["loss"] == pytest.approx((halves[0]["loss"] + halves[1]["loss"]) / 2, abs=1e-6)
    with pytest.raises(ValueError, match=r"batch of 3 sequences: must be a multiple of TrainerConfig.minibatches=2"):
        sliced.train_step(batch.slice(0, 3))
    assert sliced.step == 1


def test_step_metrics_and_policy_version(checkpoint: Path) -> None:
    batch = make_batch(2)
    trainer = TitanTrainer(trainer_config(checkpoint, warmup_steps=2, max_grad_norm=1e-3, micro_batch_size=2))
    logits = AutoModelForCausalLM.from_pretrained(checkpoint)(batch.input_ids).logits[:, :-1].detach()
    mask = batch.response_mask
    expected_entropy = (token_entropy(logits) * mask).sum() / mask.sum()

    steps, versions = [], []
    for _ in range(3):
        steps.append(trainer.train_step(batch))
        versions.append(trainer.policy_version)

    assert [m["lr"] for m in steps] == pytest.approx([5e-4, 1e-3, 1e-3])  # linear warmup over 2 steps
    assert steps[0]["entropy"] == pytest.approx(expected_entropy.item(), abs=1e-5)
    assert versions == [1, 2, 3] and trainer.step == 3
    assert "policy_version" not in steps[0]  # the version is the trainer's typed state, not a metric
    assert {"loss", "grad_norm", "tokens_per_second", "clip_fraction", "is_weight_mean"} <= steps[0].keys()
    # The norm is reported before clipping; the gradient the optimizer used was clipped to max_grad_norm.
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()]))
    assert steps[-1]["grad_norm"] > 1e-2 and clipped.item() == pytest.approx(1e-3, rel=1e-4)


def test_grpo_raises_positive_and_lowers_negative_advantage_tokens(checkpoint: Path) -> None:
    batch = make_batch(3)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", lr=3e-3, micro_batch_size=2))
    batch.behaviour_logprobs = trainer.logprobs(batch)  # on-policy samples
    mask = batch.response_mask

    def sequence_logprobs() -> torch.Tensor:
        return (trainer.logprobs(batch) * mask).sum(-1)

    before = sequence_logprobs()
    for _ in range(4):
        trainer.train_step(batch)
    change = sequence_logprobs() - before
    assert (change[batch.advantages > 0] > 0.05).all(), change
    assert (change[batch.advantages < 0] < -0.05).all(), change


# ---------------------------------------------------------------------------------------------------
# pi_old: the trainer's own log-probs before a batch's first optimizer step


class RecordingLoss:
    """The configured loss, recording what the trainer passes it and what it returns, call by call."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn, self.calls = loss_fn, []

    def __call__(self, logprobs, batch, **kwargs):
        out = self.loss_fn(logprobs, batch, **kwargs)
        self.calls.append(dict(logprobs=logprobs.detach().clone(), old_logprobs=kwargs.get("old_logprobs"),
                               loss=out.loss.item(), metrics=out.metrics))
        return out


def recording(trainer: TitanTrainer) -> RecordingLoss:
    trainer.loss_fn = RecordingLoss(trainer.loss_fn)
    return trainer.loss_fn


def reference_tis_grpo(logprobs, old, batch, *, clip_eps: float, tis_cap: float) -> float:
    """GRPO with truncated IS in float64, written from its equation (not with losses.terms)."""
    logprobs, old, behaviour = logprobs.double(), old.double(), batch.behaviour_logprobs.double()
    mask, advantages = batch.response_mask.double(), batch.advantages.double()[:, None]
    ratio, weight = (logprobs - old).exp(), (old - behaviour).exp().clamp(max=tis_cap)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    return (-(weight * surrogate * mask).sum(-1) / mask.sum(-1)).mean().item()


def test_pi_old_makes_the_clip_bind_after_the_first_minibatch(checkpoint: Path) -> None:
    # The defect: without pi_old the ratio pi / pi_old was 1 on every minibatch, so the clip never bound.
    batch = make_batch(13, rows=8)
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", lr=3e-2, minibatches=4,
                                          loss_params={"clip_eps": 0.2, "tis_cap": 2.0}))
    batch.behaviour_logprobs = trainer.logprobs(batch)
    calls = recording(trainer).calls
    metrics = trainer.train_step(batch)
    first, *later = [call["metrics"] for call in calls]
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["clip_fraction"] == 0.0
    assert all(m["clip_fraction"] > 0 for m in later), [m["clip_fraction"] for m in later]
    assert metrics["clip_fraction"] > 0


def test_tis_loss_matches_float64_reference_with_pi_old_computed_independently(checkpoint: Path) -> None:
    batch = make_batch(14, rows=8)
    batch.behaviour_logprobs = batch.behaviour_logprobs + torch.linspace(-1.0, 1.0, 11)  # stale samples
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint).double()
    pi_old = hf_logprobs(hf_model, batch.input_ids).float()  # transformers in float64, before any step
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", lr=1e-2, minibatches=2, micro_batch_size=3,
                                          loss_params={"clip_eps": 0.2, "tis_cap": 1.5}))
    calls = recording(trainer).calls
    trainer.train_step(batch)
    for k, call in enumerate(calls):
        rows = batch.slice(4 * k, 4 * k + 4)
        torch.testing.assert_close(call["old_logprobs"], pi_old[4 * k : 4 * k + 4], rtol=0, atol=1e-5)
        expected = reference_tis_grpo(call["logprobs"], pi_old[4 * k : 4 * k + 4], rows, clip_eps=0.2, tis_cap=1.5)
        assert call["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-7), k
    # The second minibatch is scored after the first step: pi has moved away from pi_old.
    assert not torch.allclose(calls[1]["logprobs"], calls[1]["old_logprobs"], atol=1e-4)


def test_pi_old_is_scored_only_for_the_slices_after_the_first(checkpoint: Path) -> None:
    # The first slice's training forward precedes every optimizer step: its log-probs are pi_old, with no extra pass.
    batch = make_batch(19, rows=8)
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", minibatches=4, loss_params={"tis_cap": 2.0}))
    expected = trainer.logprobs(batch)  # pi_old of every row, before any step
    batch.behaviour_logprobs = expected.clone()
    batch.behaviour_logprobs[2:] -= 0.5  # the first slice sampled by pi_old itself, the later ones not
    scored_rows, score = [], trainer._score
    trainer._score = lambda input_ids, *args, **kwargs: scored_rows.append(len(input_ids)) or score(input_ids, *args,
                                                                                                    **kwargs)
    calls = recording(trainer).calls
    metrics = trainer.train_step(batch)
    assert scored_rows == [6]  # rows 2-7: slices 1-3
    pi_old = torch.cat([call["old_logprobs"] for call in calls])
    torch.testing.assert_close(pi_old, expected, rtol=0, atol=1e-6)
    # The mismatch metrics cover the whole batch, not only the first slice (where pi_old and the sampler agree).
    assert metrics["mismatch/all/abs_logp_diff"] > 0.2, metrics["mismatch/all/abs_logp_diff"]


def test_with_one_minibatch_pi_old_is_pi_exactly(checkpoint: Path) -> None:
    batch = make_batch(15)
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", micro_batch_size=2,
                                          loss_params={"tis_cap": 2.0, "token_mask_band": [0.0, 1e9]}))
    expected = trainer.logprobs(batch)
    calls = recording(trainer).calls
    trainer.train_step(batch)
    (call,) = calls
    assert torch.equal(call["old_logprobs"], call["logprobs"]) and torch.equal(call["old_logprobs"], expected)
    assert call["metrics"]["ratio_min"] == call["metrics"]["ratio_max"] == 1.0


def test_without_a_correction_no_pi_old_is_computed_or_passed(checkpoint: Path) -> None:
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", minibatches=2))
    scored = []
    trainer._score = lambda input_ids: scored.append(input_ids)  # the extra forward pass
    calls = recording(trainer).calls
    trainer.train_step(make_batch(16))
    assert scored == [] and [call["old_logprobs"] for call in calls] == [None, None]


def test_mismatch_metrics_by_version_lag_every_step(checkpoint: Path) -> None:
    batch = make_batch(17)
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", minibatches=2, loss_params={"tis_cap": 2.0}))
    trainer.train_step(make_batch(18))
    trainer.train_step(make_batch(19))  # the trainer is at policy version 2
    mask = batch.response_mask > 0
    batch.policy_versions = torch.where(mask, torch.tensor([2, 1, 0, 2])[:, None], -1)  # lags 0, 1, 2, 0 by row
    pi_old = trainer.logprobs(batch)
    metrics = trainer.train_step(batch)
    for lag, rows in ((0, [0, 3]), (1, [1]), (2, [2])):
        diff = (pi_old - batch.behaviour_logprobs)[rows][mask[rows]].double()
        assert metrics[f"mismatch/lag{lag}/abs_logp_diff"] == pytest.approx(diff.abs().mean().item(), rel=1e-5)
        assert metrics[f"mismatch/lag{lag}/kl_k3"] == pytest.approx((diff.exp() - 1 - diff).mean().item(), rel=1e-5)
        assert metrics[f"mismatch/lag{lag}/token_share"] == pytest.approx(mask[rows].sum().item() / mask.sum().item())
    rho = (pi_old - batch.behaviour_logprobs)[mask].double().exp()
    assert metrics["mismatch/all/chi2"] == pytest.approx(((rho - 1) ** 2).mean().item(), rel=1e-5)
    assert metrics["mismatch/all/out_of_band"] == ((rho < 0.5) | (rho > 5)).double().mean().item()
    assert metrics["mismatch/all/tis_truncated"] == (rho > 2.0).double().mean().item()
    assert metrics["mismatch/all/masked"] == 0.0 and "mismatch/lag3/kl_k3" not in metrics


# ---------------------------------------------------------------------------------------------------
# Checkpoints and export


def test_resume_gives_the_uninterrupted_run(checkpoint: Path, tmp_path: Path) -> None:
    first, second = make_batch(4), make_batch(5)
    config = trainer_config(checkpoint, warmup_steps=3, weight_decay=0.1, micro_batch_size=2)
    uninterrupted = TitanTrainer(config)
    uninterrupted.train_step(first)
    saved = uninterrupted.save_checkpoint(tmp_path / "ckpt")
    expected = uninterrupted.train_step(second)

    resumed = TitanTrainer(config)
    resumed.load_checkpoint(saved)
    assert (resumed.step, resumed.policy_version) == (1, 1)
    metrics = resumed.train_step(second)
    assert metrics["loss"] == expected["loss"] and metrics["lr"] == expected["lr"]
    assert_same_weights(resumed.hf_state_dict(), uninterrupted.hf_state_dict(), atol=0)


def test_a_checkpoint_saved_before_the_first_step_changes_no_step(checkpoint: Path, tmp_path: Path) -> None:
    # torchtitan 0.3.0 creates missing optimizer state for a checkpoint with a zero-lr step: Adam's first step.
    config = trainer_config(checkpoint, weight_decay=0.1)
    saved, unsaved = TitanTrainer(config), TitanTrainer(config)
    path = saved.save_checkpoint(tmp_path / "ckpt")
    saved.train_step(make_batch(4))
    unsaved.train_step(make_batch(4))
    assert_same_weights(saved.hf_state_dict(), unsaved.hf_state_dict(), atol=0)
    resumed = TitanTrainer(config)
    resumed.load_checkpoint(path)
    resumed.train_step(make_batch(4))
    assert_same_weights(resumed.hf_state_dict(), unsaved.hf_state_dict(), atol=0)


def torchtitan_0_2_name(key: str) -> str:
    """A torchtitan 0.3.0 key under the name torchtitan 0.2.0 gave it (written out here, not with actors.checkpoint's
    map): the unembedding was `output`, and q, k and v sat directly under `attention`."""
    key = key.replace("attention.qkv_linear.", "attention.")
    return "output." + key.removeprefix("lm_head.") if key.startswith("lm_head.") else key.replace(".lm_head.",
                                                                                                     ".output.")


def save_as_torchtitan_0_2(trainer: TitanTrainer, path: Path) -> str:
    """The checkpoint forge on torchtitan 0.2.0 wrote for the trainer's state: model and optimizer keys under the old
    module names, and the LR schedule as its whole LambdaLR state dict (0.2.0's container saved its first
    scheduler's)."""
    from actors.checkpoint import save

    model = {torchtitan_0_2_name(k): v for k, v in get_model_state_dict(trainer.model).items()}
    optimizer = {torchtitan_0_2_name(k): v for k, v in trainer.optimizers.state_dict().items()}
    states = {**model, "optimizer": optimizer, "lr_scheduler": trainer.lr_schedulers.schedulers[0].state_dict(),
              "train_state": trainer.train_state.state_dict()}
    return save(states, path, rank=0, world_size=1)


def test_a_checkpoint_of_forge_on_torchtitan_0_2_resumes(checkpoint: Path, tmp_path: Path) -> None:
    from apps.eval.weights import check_fits, load_weights

    first, second = make_batch(4), make_batch(5)
    config = trainer_config(checkpoint, warmup_steps=3, weight_decay=0.1, micro_batch_size=2)
    uninterrupted = TitanTrainer(config)
    uninterrupted.train_step(first)
    saved = save_as_torchtitan_0_2(uninterrupted, tmp_path / "old")
    keys = FileSystemReader(saved).read_metadata().state_dict_metadata.keys()
    assert {"output.weight", "layers.0.attention.wq.weight", "optimizer.state.output.weight.exp_avg",
            "optimizer.state.layers.1.attention.wv.weight.exp_avg_sq", "lr_scheduler.base_lrs"} <= set(keys)
    assert not any("lm_head" in key or "qkv_linear" in key for key in keys)
    at_save = uninterrupted.hf_state_dict()
    expected = uninterrupted.train_step(second)

    resumed = TitanTrainer(config)
    resumed.load_checkpoint(saved)
    assert (resumed.step, resumed.policy_version) == (1, 1)
    metrics = resumed.train_step(second)  # the same Adam moments, step count and LR schedule as the saved run
    assert metrics["loss"] == expected["loss"] and metrics["lr"] == expected["lr"]
    assert_same_weights(resumed.hf_state_dict(), uninterrupted.hf_state_dict(), atol=0)
    # As an init_checkpoint (weights only), and in apps.eval (HF names on the base model).
    started = TitanTrainer(trainer_config(checkpoint, init_checkpoint=saved))
    assert_same_weights(started.hf_state_dict(), at_save, atol=0)
    check_fits(saved, str(checkpoint))
    assert_same_weights(load_weights(saved, str(checkpoint)), at_save, atol=0)


def test_a_checkpoints_model_keys_are_the_models_and_the_rest_trainer_parts(checkpoint: Path, tmp_path: Path) -> None:
    # apps.eval reads a checkpoint's model alone by is_model_key: a stateful part saved under another name would be
    # taken for weights there (and here, on load).
    trainer = TitanTrainer(trainer_config(checkpoint))
    trainer.train_step(make_batch(4))
    saved = trainer.save_checkpoint(tmp_path / "ckpt")
    keys = FileSystemReader(saved).read_metadata().state_dict_metadata.keys()
    assert {key for key in keys if is_model_key(key)} == set(get_model_state_dict(trainer.model))
    assert {key.split(".")[0] for key in keys if not is_model_key(key)} == {"optimizer", "lr_scheduler", "train_state"}


def test_init_checkpoint_takes_only_the_weights(checkpoint: Path, tmp_path: Path) -> None:
    trained = TitanTrainer(trainer_config(checkpoint))
    trained.train_step(make_batch(4))
    saved = trained.save_checkpoint(tmp_path / "ckpt")
    started = TitanTrainer(trainer_config(checkpoint, init_checkpoint=saved))
    assert_same_weights(started.hf_state_dict(), trained.hf_state_dict(), atol=0)
    assert (started.step, started.policy_version) == (0, 0)


def test_corrupt_or_incomplete_checkpoint_is_a_clear_error(checkpoint: Path, tmp_path: Path) -> None:
    trainer = TitanTrainer(trainer_config(checkpoint))
    saved = Path(trainer.save_checkpoint(tmp_path / "good"))
    (shard,) = saved.glob("*.distcp")

    truncated = shutil.copytree(saved, tmp_path / "truncated")
    os.truncate(truncated / shard.name, shard.stat().st_size // 2)
    with pytest.raises(RuntimeError, match=r"truncated.*corrupt.*distcp"):
        trainer.load_checkpoint(truncated)

    flipped = shutil.copytree(saved, tmp_path / "flipped")
    with open(flipped / shard.name, "r+b") as f:  # inside the tensor data, where DCP itself checks nothing
        f.seek(shard.stat().st_size // 2)
        f.write(b"\x7f" * 16)
    with pytest.raises(RuntimeError, match="flipped is corrupt"):
        trainer.load_checkpoint(flipped)

    interrupted = shutil.copytree(saved, tmp_path / "interrupted")
    (interrupted / CHECKSUMS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="interrupted is not a complete checkpoint"):
        trainer.load_checkpoint(interrupted)


def test_export_hf_loads_in_transformers_with_identical_logits(checkpoint: Path, tmp_path: Path) -> None:
    batch = make_batch(7)
    trainer = TitanTrainer(trainer_config(checkpoint))
    trainer.train_step(batch)
    exported = trainer.export_hf(tmp_path / "export")

    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(model(batch.input_ids).logits, trainer.model(batch.input_ids), rtol=0, atol=1e-5)
    source = AutoTokenizer.from_pretrained(checkpoint)
    assert AutoTokenizer.from_pretrained(exported)("1+2=3").input_ids == source("1+2=3").input_ids


# ---------------------------------------------------------------------------------------------------
# FSDP2 over two CPU processes against one process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def corrected_config(path: Path) -> TrainerConfig:
    """Two minibatches with truncated IS and an IcePop band: pi_old is scored before the first step."""
    return trainer_config(path, micro_batch_size=1, minibatches=2,
                          loss_params={"tis_cap": 2.0, "token_mask_band": [0.05, 2.0]})


def _fsdp_worker(rank: int, world_size: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        config = trainer_config(Path(path), micro_batch_size=1)  # two micro-batches per rank
        trainer = TitanTrainer(config, rank=rank, world_size=world_size)
        first = trainer.train_step(make_batch(8))
        after_first = trainer.hf_state_dict()  # the full weights on rank 0 only
        after_first_bf16 = trainer.hf_state_dict(torch.bfloat16)
        first_grads = gradients(trainer)
        logprobs = trainer.logprobs(make_batch(10))
        shards = trainer.hf_state_dict_shards()
        full = {n: t.full_tensor() for n, t in shards.items()}  # DTensor's own gather, on every rank
        saved = trainer.save_checkpoint(Path(out_dir) / "ckpt")
        second = trainer.train_step(make_batch(9))
        after_second, second_version = trainer.hf_state_dict(), trainer.policy_version
        trainer.load_checkpoint(saved)
        resumed = trainer.train_step(make_batch(9))
        after_resumed, resumed_version = trainer.hf_state_dict(), trainer.policy_version
        corrected = TitanTrainer(corrected_config(Path(path)), rank=rank, world_size=world_size)
        corrected_metrics = corrected.train_step(make_batch(8))
        result = dict(first=first, second=second, resumed=resumed, first_grads=first_grads, after_first=after_first,
                      after_first_bf16=after_first_bf16, after_second=after_second, after_resumed=after_resumed,
                      second_version=second_version, resumed_version=resumed_version,
                      shards_are_sharded=all(isinstance(t, DTensor) for t in shards.values()), full=full,
                      logprobs=logprobs, corrected=corrected_metrics, after_corrected=corrected.hf_state_dict())
        torch.save(result, Path(out_dir) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(script: str, checkpoint: Path, out_dir: Path, world_size: int = 2) -> list[dict]:
    """Run `script` as `world_size` processes (argv: rank, world size, port, checkpoint, out_dir) and return what
    each saved as out_dir/result<rank>.pt. A script, not a function: torchmonarch installs a top-level `tests`
    package that hides this one, so a spawned process could not unpickle a function defined here."""
    port = _free_port()
    logs = [out_dir / f"rank{rank}.log" for rank in range(world_size)]
    procs = [subprocess.Popen([sys.executable, script, str(rank), str(world_size), str(port), str(checkpoint),
                               str(out_dir)], stdout=log.open("w"), stderr=subprocess.STDOUT)
             for rank, log in enumerate(logs)]
    try:
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
    return [torch.load(out_dir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


@pytest.fixture(scope="module")
def fsdp_results(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(__file__, checkpoint, tmp_path_factory.mktemp("fsdp"))  # each rank: the bottom of this file


def test_fsdp_two_ranks_match_one_rank(fsdp_results: list[dict], checkpoint: Path) -> None:
    fsdp_result = fsdp_results[0]
    single = TitanTrainer(trainer_config(checkpoint, micro_batch_size=4))
    expected = single.train_step(make_batch(8))
    assert fsdp_result["first"]["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert fsdp_result["first"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert fsdp_result["first"]["entropy"] == pytest.approx(expected["entropy"], abs=1e-6)
    assert_same_weights(fsdp_result["first_grads"], gradients(single), atol=1e-7)
    # Adam's first update is lr * g / (|g| + eps): where |g| << eps it multiplies the gradients' summation-order
    # rounding (within 1e-7, above) by up to lr / eps = 1e3. Seen: 2 of 8192 elements at 1.7e-6 on one CPU, none
    # over 1e-6 on another. 1e-5 is 1% of one step (lr); a wrong shard or reduction moves weights by ~lr.
    assert_same_weights(fsdp_result["after_first"], single.hf_state_dict(), atol=1e-5)
    torch.testing.assert_close(fsdp_result["logprobs"], single.logprobs(make_batch(10)), rtol=0, atol=1e-5)


def test_fsdp_pi_old_and_mismatch_metrics_match_one_rank(fsdp_results: list[dict], checkpoint: Path) -> None:
    # Every rank passes the same batch; pi_old is gathered across ranks, sliced per minibatch like the batch.
    single = TitanTrainer(corrected_config(checkpoint))
    expected = single.train_step(make_batch(8))
    corrected = fsdp_results[0]["corrected"]
    assert corrected.keys() == expected.keys() and any(key.startswith("mismatch/lag0/") for key in expected)
    for key in expected:
        if key not in ("tokens_per_second", "publish_s"):
            assert corrected[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    # Two Adam steps (eps=1e-6): summation-order differences in near-zero gradient elements grow past the
    # one-step test's 1e-6; a wrong pi_old slice would move the second step by the learning rate (1e-3).
    after = single.hf_state_dict()
    worst = max((fsdp_results[0]["after_corrected"][n] - after[n]).abs().max().item() for n in after)
    assert worst < 2e-5, worst


def test_fsdp_shards_are_dtensors_of_the_full_weights(fsdp_results: list[dict]) -> None:
    assert all(result["shards_are_sharded"] for result in fsdp_results)
    assert_same_weights(fsdp_results[0]["full"], fsdp_results[0]["after_first"], atol=0)


def test_fsdp_full_weights_are_gathered_to_rank_0_only(fsdp_results: list[dict]) -> None:
    rank0, rank1 = fsdp_results
    assert rank1["after_first"] == {} and rank1["after_first_bf16"] == {}
    # Cast shard by shard before gathering: the same values as casting the full weights.
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in rank0["after_first"].items()}
    assert {t.dtype for t in rank0["after_first_bf16"].values()} == {torch.bfloat16}
    assert_same_weights(rank0["after_first_bf16"], expected, atol=0)


def test_fsdp_resume_gives_the_uninterrupted_step(fsdp_results: list[dict]) -> None:
    fsdp_result = fsdp_results[0]
    assert fsdp_result["resumed"]["loss"] == fsdp_result["second"]["loss"]
    assert fsdp_result["resumed_version"] == fsdp_result["second_version"] == 2
    assert_same_weights(fsdp_result["after_resumed"], fsdp_result["after_second"], atol=0)


# ---------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("overrides, field, allowed", [
    ({"lr": 0.0}, "lr", "a number > 0"),
    ({"betas": (0.9, 1.0)}, "betas", "two numbers in [0, 1)"),
    ({"micro_batch_size": 0}, "micro_batch_size", "an int >= 1"),
    ({"minibatches": 0}, "minibatches", "an int >= 1"),
    ({"family": "gpt2"}, "family", "one of qwen3, llama3"),
    ({"dtype": "float8"}, "dtype", "one of float32, bfloat16"),
    ({"warmup_steps": 11}, "warmup_steps", "an int in [0, max_steps=10]"),
    ({"lr_decay": "step"}, "lr_decay", "one of constant, linear, cosine"),
    ({"model_path": "/no/such/folder"}, "model_path", "a Hugging Face checkpoint folder with config.json"),
    ({"publish_dtype": "int8"}, "publish_dtype", "None (the trainer's dtype) or one of float32, bfloat16, float16"),
])
def test_config_errors_name_the_field_value_and_allowed(checkpoint: Path, overrides: dict, field: str,
                                                        allowed: str) -> None:
    kwargs = {"model_path": str(checkpoint), "max_steps": 10, **overrides}
    value = kwargs.get(field)
    expected = re.escape(f"TrainerConfig.{field}={value!r}: must be {allowed}")
    with pytest.raises(ValueError, match=expected):
        TrainerConfig(**kwargs)


def test_publish_dtype_defaults_to_the_trainers_dtype(checkpoint: Path) -> None:
    assert TrainerConfig(model_path=str(checkpoint), dtype="bfloat16").publish_dtype == "bfloat16"


def test_unknown_loss_or_loss_param_is_rejected(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="loss='nope'"):
        TrainerConfig(model_path=str(checkpoint), loss="nope")
    with pytest.raises(ValueError, match=r"\['clip_epsilon'\] not taken by loss 'grpo'.*clip_eps"):
        TrainerConfig(model_path=str(checkpoint), loss="grpo", loss_params={"clip_epsilon": 0.2})


def test_tied_embeddings_are_refused_under_fsdp(tied_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="tie_word_embeddings=True with world_size=2"):
        TitanTrainer(trainer_config(tied_checkpoint), rank=0, world_size=2)


def test_batch_outside_the_vocabulary_or_context_is_rejected(checkpoint: Path) -> None:
    trainer = TitanTrainer(trainer_config(checkpoint))
    batch = make_batch(11)
    batch.input_ids[0, 5] = 99
    with pytest.raises(ValueError, match=r"token ids in \[0, 99\]; must be in \[0, 99\)"):
        trainer.train_step(batch)
    with pytest.raises(ValueError, match="2 <= T <= 256"):
        trainer.logprobs(make_batch(12, length=257))
    assert trainer.step == 0


if __name__ == "__main__":  # one rank of the FSDP tests, started by the fsdp_result fixture
    _fsdp_worker(*map(int, sys.argv[1:4]), *sys.argv[4:])


def test_trainer_logprobs_replay_the_generators_kept_sets(checkpoint: Path) -> None:
    """Top-p / top-k rollouts of the hf engine at the trainer's weights: the log-probs the trainer scores and
    trains on renormalise over each token's kept set, so they equal the behaviour log-probs within 1e-5."""
    from actors.engines.hf import HFEngine
    from rl.types import Episode, SamplingParams

    engine = HFEngine(checkpoint, seed=0)
    trainer = TitanTrainer(trainer_config(checkpoint, temperature=0.7, micro_batch_size=5))
    for top_k, top_p in ((0, 0.8), (5, 1.0)):
        params = SamplingParams(n=4, max_tokens=10, temperature=0.7, top_k=top_k, top_p=top_p, seed=3)
        completions = [c for group in engine.generate(["1+2=", "12+34=", "99+1="], params) for c in group]
        batch = TrainBatch.from_episodes(
            [Episode.from_completion(c, episode_id=i, group_id=0, reward=0.0) for i, c in enumerate(completions)],
            pad_id=engine.pad_token_id)
        on_response = batch.response_mask.bool()
        expected = batch.behaviour_logprobs[on_response]
        torch.testing.assert_close(trainer.logprobs(batch)[on_response], expected, rtol=0, atol=1e-5)
        _, trained, _ = trainer.accumulate_gradients(batch, trainer.loss_fn, trainer.config.loss_params)
        torch.testing.assert_close(trained[on_response], expected, rtol=0, atol=1e-5)
        # Over the full vocabulary the trainer would measure another policy.
        batch.kept_token_ids = None
        assert bool((trainer.logprobs(batch)[on_response] < expected - 1e-3).all())


def test_mismatch_metrics_ignore_the_drift_of_earlier_minibatches(checkpoint: Path) -> None:
    # Behaviour log-probs from the trainer's own weights: no mismatch, however far the minibatches move the weights.
    trainer = TitanTrainer(trainer_config(checkpoint, loss="grpo", lr=3e-2, minibatches=2))
    batch = make_batch(20)
    batch.behaviour_logprobs = trainer.logprobs(batch)
    batch.policy_versions = torch.where(batch.response_mask > 0, 0, -1).long()
    metrics = trainer.train_step(batch)
    assert metrics["mismatch/all/abs_logp_diff"] < 1e-5
    assert (trainer.logprobs(batch) - batch.behaviour_logprobs).abs().max() > 1e-3  # the weights did move


def test_distill_vocabulary_kl_gets_the_students_logprobs_at_the_teachers_topk_in_one_pass_or_per_micro_batch(
        checkpoint: Path) -> None:
    # The loss takes `topk_logprobs`: the trainer scores the teacher's top-k ids and the rest of the vocabulary at
    # each position and back-propagates the loss's gradient through them, in one pass or recomputed per micro-batch.
    batch = make_batch(3)
    teacher = torch.randn(*batch.response_mask.shape, 99, generator=torch.Generator().manual_seed(5)).mul(3)
    batch.ref_topk_ids, batch.ref_topk_logprobs = topk_logprobs(teacher, 8)
    config = {"loss": "distill", "loss_params": {"kl": "reverse"}, "temperature": 0.7}
    whole = TitanTrainer(trainer_config(checkpoint, micro_batch_size=4, **config))
    split = TitanTrainer(trainer_config(checkpoint, micro_batch_size=1, **config))
    whole_metrics, split_metrics = whole.train_step(batch), split.train_step(batch)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)(batch.input_ids).logits[:, :-1]
    student = bucket_logprobs((logits / 0.7).log_softmax(-1), batch.ref_topk_ids)
    kl = (student.exp() * (student - batch.ref_topk_logprobs.double())).sum(-1)
    expected = ((kl * batch.response_mask).sum() / batch.response_mask.sum()).item()
    assert whole_metrics["loss"] == pytest.approx(expected, rel=1e-5) and expected > 0.5
    assert whole_metrics["reverse_kl"] == pytest.approx(expected, rel=1e-5)
    assert split_metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert_same_weights(gradients(whole), gradients(split), atol=1e-6)
    assert whole_metrics["grad_norm"] > 0.01
