"""LoRA: the trainer's adapters on the torchtitan model (frozen base, adapter-only optimizer, FSDP parity,
checkpoints), the peft export, adapter-only versions in the hf engine, and the config's checks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from actors.engines.hf import HFEngine
from actors.lora_config import LORA_TARGETS
from actors.titan_trainer import TitanTrainer
from actors.trainer_config import TrainerConfig
from rl.tiny_model import build_tiny_checkpoint
from tests.blocked_imports import import_with_blocked

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import assert_same_weights, hf_logprobs, make_batch, recording, run_ranks, \
    torchtitan_0_2_name, trainer_config  # noqa: E402

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def lora_config(path: Path, **overrides) -> TrainerConfig:
    return trainer_config(path, lora=dict(LORA), **overrides)


def named(trainer: TitanTrainer, adapters: bool) -> dict[str, torch.Tensor]:
    """Full copies of the adapter (or base) parameters, torchtitan names; a collective under FSDP."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in trainer.model.named_parameters() if p.requires_grad == adapters}


# ---------------------------------------------------------------------------------------------------
# The trainer


def test_only_the_adapters_train_and_hold_optimizer_state(checkpoint: Path) -> None:
    trainer = TitanTrainer(lora_config(checkpoint))
    base_before, adapters_before = named(trainer, False), named(trainer, True)
    # Three targets in each of 2 layers and lm_head, A and B each; B starts at zero (the model starts at the base).
    assert len(adapters_before) == 14 and all(".lora_" in n for n in adapters_before)
    assert all(not t.any() for n, t in adapters_before.items() if ".lora_B." in n)
    for seed in (8, 9):
        trainer.train_step(make_batch(seed))
    assert_same_weights(named(trainer, False), base_before, atol=0)
    changed = [n for n, t in named(trainer, True).items() if not torch.equal(t, adapters_before[n])]
    assert len(changed) == 14
    (optimizer,) = trainer.optimizers.optimizers
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert len(optimizer.state) == 14


def test_a_trainer_without_lora_imports_no_peft() -> None:
    # peft is imported where adapters are injected: every trainer process without LoRA starts without it.
    result = import_with_blocked(["actors.trainer", "actors.titan_trainer"], ["peft"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_untrained_adapters_give_the_base_models_logprobs(checkpoint: Path) -> None:
    batch = make_batch(10)
    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    trainer = TitanTrainer(lora_config(checkpoint))
    torch.testing.assert_close(trainer.logprobs(batch), hf_logprobs(base, batch.input_ids), rtol=0, atol=1e-5)


def test_peft_export_loads_with_peft_and_gives_the_trainers_logits(checkpoint: Path, tmp_path: Path) -> None:
    trainer = TitanTrainer(lora_config(checkpoint, lr=1e-2))
    for seed in (8, 9):
        trainer.train_step(make_batch(seed))
    path = Path(trainer.export_hf(tmp_path / "adapter"))
    saved = load_file(path / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved and len(saved) == 14
    assert "base_model.model.lm_head.lora_B.weight" in saved
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(LORA["target_modules"]))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), path).eval()
    batch = make_batch(10)
    expected = trainer.logprobs(batch)
    torch.testing.assert_close(hf_logprobs(peft_model, batch.input_ids), expected, rtol=0, atol=1e-5)
    # The adapter moved the model: the base alone is measurably different.
    base = hf_logprobs(AutoModelForCausalLM.from_pretrained(checkpoint), batch.input_ids)
    assert (base - expected).abs().max() > 1e-3


def test_resume_restores_adapters_and_optimizer_exactly(checkpoint: Path, tmp_path: Path) -> None:
    trainer = TitanTrainer(lora_config(checkpoint))
    trainer.train_step(make_batch(8))
    saved = trainer.save_checkpoint(tmp_path / "ckpt")
    second = trainer.train_step(make_batch(9))
    after_second = named(trainer, True)
    resumed = TitanTrainer(lora_config(checkpoint))
    resumed.load_checkpoint(saved)
    assert resumed.policy_version == 1
    again = resumed.train_step(make_batch(9))
    assert again["loss"] == second["loss"]
    assert_same_weights(named(resumed, True), after_second, atol=0)
    # Only the adapters are saved: the base is the source checkpoint.
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(saved).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if not k.startswith(("optimizer", "lr_scheduler", "train_state", "lora."))]
    assert model_keys and all(".lora_" in k for k in model_keys)


def test_adapters_of_forge_on_torchtitan_0_2_resume(checkpoint: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from actors.checkpoint import save
    from actors.lora import adapter_state
    from actors.titan_trainer import AdapterSettings

    trainer = TitanTrainer(lora_config(checkpoint))
    trainer.train_step(make_batch(8))
    # What forge on torchtitan 0.2.0 saved: adapters and optimizer state under the old module names.
    adapters = {torchtitan_0_2_name(k): v for k, v in adapter_state(get_model_state_dict(trainer.model)).items()}
    optimizer = {torchtitan_0_2_name(k): v for k, v in trainer.optimizers.state_dict().items()}
    saved = save({**adapters, "optimizer": optimizer, "lr_scheduler": trainer.lr_schedulers.schedulers[0].state_dict(),
                  "train_state": trainer.train_state.state_dict(),
                  "lora": AdapterSettings(trainer.config.lora).state_dict()}, tmp_path / "old", rank=0, world_size=1)
    keys = FileSystemReader(saved).read_metadata().state_dict_metadata.keys()
    assert {"layers.0.attention.wq.lora_A.default.weight", "output.lora_B.default.weight"} <= set(keys)
    second = trainer.train_step(make_batch(9))
    resumed = TitanTrainer(lora_config(checkpoint))
    resumed.load_checkpoint(saved)
    assert resumed.train_step(make_batch(9))["loss"] == second["loss"]
    assert_same_weights(named(resumed, True), named(trainer, True), atol=0)


def test_resume_with_other_lora_settings_is_refused_naming_them(checkpoint: Path, tmp_path: Path) -> None:
    # Other alpha: every update rescaled; a dropped target: its trained adapter silently left behind.
    trainer = TitanTrainer(lora_config(checkpoint))
    trainer.train_step(make_batch(8))
    saved = trainer.save_checkpoint(tmp_path / "ckpt")
    for change, says in [
        ({"alpha": 16.0}, r"alpha=8\.0 there, 16\.0 here"),
        ({"target_modules": ["q_proj", "v_proj", "lm_head"]},
         r"target_modules='down_proj,lm_head,q_proj,v_proj' there, 'lm_head,q_proj,v_proj' here"),
        ({"rank": 8}, r"rank=4 there, 8 here"),
    ]:
        other = TitanTrainer(trainer_config(checkpoint, lora={**LORA, **change}))
        with pytest.raises(RuntimeError, match=r"trainer\.lora differs from the settings the checkpoint's adapters "
                                               r"were trained with \(" + says):
            other.load_checkpoint(saved)
    TitanTrainer(trainer_config(checkpoint, lora={**LORA, "dropout": 0.1})).load_checkpoint(saved)  # no shape


# ---------------------------------------------------------------------------------------------------
# FSDP2 over two CPU processes against one process


def _fsdp_worker(rank: int, world_size: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        trainer = TitanTrainer(lora_config(Path(path), micro_batch_size=1), rank=rank, world_size=world_size)
        initial = named(trainer, True)
        metrics = [trainer.train_step(make_batch(seed)) for seed in (8, 9)]
        published = trainer.hf_state_dict()
        result = dict(initial=initial, metrics=metrics, adapters=named(trainer, True), published=published,
                      sharded=all(isinstance(p, DTensor) for p in trainer.model.parameters()))
        saved = trainer.save_checkpoint(Path(out_dir) / "ckpt")
        result["third"] = trainer.train_step(make_batch(11))
        trainer.load_checkpoint(saved)
        result["resumed_third"] = trainer.train_step(make_batch(11))
        result["resumed_third_version"] = trainer.policy_version
        torch.save(result, Path(out_dir) / f"result{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(__file__, checkpoint, tmp_path_factory.mktemp("fsdp_lora"))  # each rank: the bottom of this file


def test_fsdp_two_ranks_give_one_ranks_losses_and_adapters(fsdp_results: list[dict], checkpoint: Path) -> None:
    rank0, rank1 = fsdp_results
    assert rank0["sharded"] and rank1["published"] == {}
    single = TitanTrainer(lora_config(checkpoint, micro_batch_size=4))
    assert_same_weights(rank0["initial"], named(single, True), atol=0)  # the same initial adapters
    for got, seed in zip(rank0["metrics"], (8, 9)):
        expected = single.train_step(make_batch(seed))
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    assert_same_weights(rank0["adapters"], named(single, True), atol=2e-5)
    assert_same_weights(rank0["published"], single.hf_state_dict(), atol=2e-5)


def test_fsdp_resume_continues_exactly(fsdp_results: list[dict]) -> None:
    rank0 = fsdp_results[0]
    assert rank0["resumed_third"]["loss"] == rank0["third"]["loss"]
    assert rank0["resumed_third_version"] == 3


# ---------------------------------------------------------------------------------------------------
# Dropout: on the gradient pass only; every score is the policy itself


def dropout_trainer(checkpoint: Path, **overrides) -> TitanTrainer:
    """A LoRA trainer with dropout 0.1 whose adapters are not zero (B = 0 would hide the dropout on A's input)."""
    trainer = TitanTrainer(trainer_config(checkpoint, lora={**LORA, "dropout": 0.1}, **overrides))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return trainer


def no_dropout_logprobs(trainer: TitanTrainer, batch) -> torch.Tensor:
    """The policy's log-probs with dropout off (eval mode), set here rather than by the trainer under test."""
    trainer.model.eval()
    try:
        return trainer.logprobs(batch)
    finally:
        trainer.model.train()


@pytest.mark.parametrize("minibatches", [1, 2])
def test_with_dropout_pi_old_is_the_policy_without_dropout(checkpoint: Path, minibatches: int) -> None:
    batch = make_batch(20)
    trainer = dropout_trainer(checkpoint, loss="grpo", minibatches=minibatches, micro_batch_size=2,
                              loss_params={"clip_eps": 0.2, "tis_cap": 2.0})
    expected = no_dropout_logprobs(trainer, batch)
    assert (expected - no_dropout_logprobs(TitanTrainer(trainer_config(checkpoint)), batch)).abs().max() > 1e-2
    calls = recording(trainer).calls
    trainer.train_step(batch)
    pi_old = torch.cat([call["old_logprobs"] for call in calls])
    torch.testing.assert_close(pi_old, expected, rtol=0, atol=1e-6)
    # The gradient pass does draw dropout masks: its log-probs are not the policy's.
    assert (calls[0]["logprobs"] - expected[: len(calls[0]["logprobs"])]).abs().max() > 1e-3


def test_with_dropout_scores_are_the_policy_and_repeat_exactly(checkpoint: Path) -> None:
    trainer = dropout_trainer(checkpoint)
    batch = make_batch(21)
    expected = no_dropout_logprobs(trainer, batch)
    assert torch.equal(trainer.logprobs(batch), expected) and torch.equal(trainer.logprobs(batch), expected)
    prompt, tokens = [5, 6, 7], [8, 9, 10, 11]
    trainer.model.eval()
    canary = trainer.score_tokens(prompt, tokens)  # the weight-sync canary's trainer side, without dropout
    trainer.model.train()
    assert trainer.score_tokens(prompt, tokens) == canary and trainer.score_tokens(prompt, tokens) == canary
    assert trainer.model.training  # back in train mode for the gradient pass


def test_with_dropout_micro_batch_recomputation_draws_the_same_masks(checkpoint: Path) -> None:
    # Exact accumulation: the gradient is that of the loss on the log-probs it reports, although those were computed
    # without grad and every micro-batch is computed again for its backward pass.
    batch = make_batch(22)
    trainer = dropout_trainer(checkpoint, micro_batch_size=1)
    start = torch.get_rng_state()
    trainer.optimizers.zero_grad()
    def adapter_grads() -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    _, logprobs, _ = trainer.accumulate_gradients(batch, trainer.loss_fn, {})
    accumulated = adapter_grads()

    torch.set_rng_state(start)  # by hand: the same micro-batches, in the same order, each kept for its backward
    trainer.optimizers.zero_grad()
    parts = [trainer._forward(batch.slice(r, r + 1).input_ids, with_entropy=False)[0] for r in range(4)]
    by_hand = torch.cat(parts)
    trainer.loss_fn(by_hand, batch).loss.backward()
    torch.testing.assert_close(logprobs, by_hand.detach(), rtol=0, atol=0)
    # Summing four micro-batch gradients rounds differently from one backward pass, and by how much depends on the
    # CPU's kernels (1.5e-8 with AVX2, over 1e-7 with AVX-512 on CI); masks drawn anew differ by >= 4.6e-3 per tensor.
    assert_same_weights(accumulated, adapter_grads(), atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Adapter-only versions in the hf engine


def test_published_adapter_merged_by_the_engine_gives_the_trainers_logprobs(checkpoint: Path) -> None:
    trainer = TitanTrainer(lora_config(checkpoint, lr=1e-2))
    engine = HFEngine(checkpoint)
    trainer.train_step(make_batch(8))
    published = trainer.hf_state_dict()
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in published)
    engine.load_weights(published, 1)
    prompt, tokens = [5, 6, 7], [8, 9, 10, 11]
    expected = trainer.score_tokens(prompt, tokens)
    got, version = engine.score(prompt, tokens)
    assert version == 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5)


def test_hundred_adapter_swaps_leave_exactly_a_fresh_merge(checkpoint: Path) -> None:
    engine, fresh = HFEngine(checkpoint), HFEngine(checkpoint)
    base = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)

    def adapter(modules: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for module in modules:
            out_dim, in_dim = base[f"{module}.weight"].shape
            out[f"{module}.lora_A.weight"] = torch.randn(4, in_dim, generator=gen)
            out[f"{module}.lora_B.weight"] = torch.randn(out_dim, 4, generator=gen)
        return out

    q, v = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"
    for version in range(1, 101):
        engine.stage_weights(adapter([q, v] if version % 3 else [q]), version)  # v leaves and comes back
    last = adapter([q])
    engine.load_weights(last, 101)
    fresh.load_weights(last, 1)
    after, merged = engine.model.state_dict(), fresh.model.state_dict()
    for name in base:
        assert torch.equal(after[name], merged[name]), name
    assert torch.equal(after[f"{v}.weight"], base[f"{v}.weight"])  # not adapted in the last version: the base
    assert not torch.equal(after[f"{q}.weight"], base[f"{q}.weight"])


def test_engine_refuses_an_adapter_that_does_not_fit(checkpoint: Path) -> None:
    engine = HFEngine(checkpoint)
    q = "model.layers.0.self_attn.q_proj"
    out_dim, in_dim = engine.model.state_dict()[f"{q}.weight"].shape
    with pytest.raises(ValueError, match=r"q_proj: lora_A \(4, 7\) and lora_B .* do not make"):
        engine.load_weights({f"{q}.lora_A.weight": torch.zeros(4, 7), f"{q}.lora_B.weight": torch.zeros(out_dim, 4)}, 1)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.nope: not a linear layer"):
        engine.load_weights({"model.layers.0.self_attn.nope.lora_A.weight": torch.zeros(4, in_dim),
                             "model.layers.0.self_attn.nope.lora_B.weight": torch.zeros(4, 4)}, 1)
    with pytest.raises(ValueError, match="has lora_A without lora_B"):
        engine.load_weights({f"{q}.lora_A.weight": torch.zeros(4, in_dim)}, 1)
    assert engine.policy_version == 0


# ---------------------------------------------------------------------------------------------------
# The config


@pytest.mark.parametrize("lora, match", [
    ({"rank": 0}, r"LoRAConfig.rank=0: must be an int >= 1"),
    ({"alpha": -1}, r"LoRAConfig.alpha=-1: must be a number > 0"),
    ({"dropout": 1.0}, r"LoRAConfig.dropout=1.0: must be a number in \[0, 1\)"),
    ({"target_modules": []}, r"LoRAConfig.target_modules=\[\]: must be a non-empty list"),
    ({"target_modules": ["q_proj", "wq"]},
     r"TrainerConfig.lora.target_modules=\['q_proj', 'wq'\]: \['wq'\] is not a module of a qwen3 model; allowed: "
     r"\['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', 'lm_head'\]"),
    ({"rank": 4096}, r"TrainerConfig.lora.rank=4096: must be <= the model's hidden_size 128"),
])
def test_bad_lora_config_names_the_field_value_and_allowed(checkpoint: Path, lora: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainerConfig(model_path=str(checkpoint), lora=lora)


def test_lora_dropout_with_activation_checkpointing_is_refused(checkpoint: Path) -> None:
    # torchtitan's checkpointed blocks recompute without their random state: other masks in the backward pass.
    with pytest.raises(ValueError, match=r"TrainerConfig.activation_checkpoint='full': must be 'none' with "
                                         r"lora.dropout=0.1 \(torchtitan's activation checkpointing recomputes dropout "
                                         r"with new masks\), or set lora.dropout=0"):
        TrainerConfig(model_path=str(checkpoint), lora={"dropout": 0.1}, activation_checkpoint="full")
    TrainerConfig(model_path=str(checkpoint), lora={"dropout": 0.0}, activation_checkpoint="full")


def test_lora_on_a_tied_lm_head_is_refused(tmp_path: Path) -> None:
    tied = build_tiny_checkpoint(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="'lm_head' is tied to the input embedding"):
        TrainerConfig(model_path=str(tied), lora={"target_modules": ["q_proj", "lm_head"]})


def test_lora_is_refused_with_tensor_parallelism_or_llama(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_degree=2 must be 1"):
        TrainerConfig(model_path=str(checkpoint), lora={}, tensor_parallel_degree=2)
    with pytest.raises(ValueError, match="family='llama3' is not supported"):
        TrainerConfig(model_path=str(checkpoint), family="llama3", lora={})


def test_every_allowed_target_is_a_linear_layer_of_the_hf_model() -> None:
    # The names peft would target on transformers' Qwen3: what the check allows is what exists.
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linear == set(LORA_TARGETS["qwen3"])


if __name__ == "__main__":
    _fsdp_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])


def test_adapters_start_from_their_seed_under_activation_checkpointing(checkpoint: Path) -> None:
    """On several ranks activation checkpointing wraps the blocks before the adapters are initialised: the
    wrapper's names must still reach the adapters (they stayed at zero, so A = B = 0 never trained)."""
    from actors.lora import CHECKPOINT_WRAPPER_PREFIX, init_adapters
    from actors.model_builder import apply_activation_checkpointing

    trainer = TitanTrainer(lora_config(checkpoint))
    initial = named(trainer, True)
    apply_activation_checkpointing(trainer.model, "full")
    with torch.no_grad():
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.zero_()
    init_adapters(trainer.model, seed=0)
    again = {name.replace(CHECKPOINT_WRAPPER_PREFIX, ""): t for name, t in named(trainer, True).items()}
    assert any(CHECKPOINT_WRAPPER_PREFIX in name for name in named(trainer, True))  # the blocks are wrapped
    assert_same_weights(again, initial, atol=0)
