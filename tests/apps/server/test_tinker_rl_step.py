"""One step of the RL loop as Tinker's docs write it (apps/examples/tinker_rl_loop.py), in this process on the tiny
model: the LoRA trainer and the adapter sampler the server uses, and the SDK's own types and wire encoders between
them. It checks what the loop relies on: the sampler's log-probs are the trainer's on the same tokens at the same
weights (N inputs, N targets: no off-by-one), importance_sampling's gradient is Tinker's -sum_t r_t A_t on the
sampled tokens only, a positive advantage raises the sequence's log-prob and a negative one lowers it, and the next
sampler samples the new weights (not stale ones), and optim_step applies every AdamParams field the SDK sends."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_sample_response

from actors.lora_config import LORA_TARGETS, LoRAConfig
from actors.trainer_config import TrainerConfig
from apps.examples.tinker_rl_loop import group_data
from apps.server.tinker.batches import tinker_batch
from apps.server.lora_trainer import AdapterSampler, SharedBaseLoRATrainer
from apps.server.tinker.wire import WireSequence, decode_forward_backward, encode_sample_response
from losses.tinker import importance_sampling
from rl.tiny_model import build_tiny_checkpoint
from rl.types import SamplingParams

MODEL = "ts-test:train:0"
PROMPT = "12+34="


class Loop:
    """The server's parts for one LoRA model, driven as the Tinker routes drive them."""

    def __init__(self, root) -> None:
        from transformers import AutoTokenizer

        self.checkpoint = build_tiny_checkpoint(root / "tiny", seed=0)
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        self.trainer = SharedBaseLoRATrainer(TrainerConfig(model_path=str(self.checkpoint)))
        # What create_lora_training_client(rank=8) asks for: every linear layer of the blocks and lm_head (untied).
        self.trainer.add_session(MODEL, LoRAConfig(rank=8, target_modules=list(LORA_TARGETS["qwen3"])), 0)
        self.sampler = AdapterSampler(self.trainer.base_hf_state(), str(self.checkpoint), seed=0)
        self.root, self.saves = root, 0

    def save_weights_for_sampler(self) -> str:
        """The adapter as save_weights_for_sampler exports it (a fresh folder each time, as the service names it)."""
        self.saves += 1
        return self.trainer.run(MODEL, "export_hf", str(self.root / f"sampler-{self.saves}"))

    def sample(self, adapter: str, prompt: list[int], n: int, seed: int = 0) -> list[types.SampledSequence]:
        """The sequences as the SDK reads them from the server's answer to asample."""
        out = self.sampler.generate(adapter, [prompt], SamplingParams(n=n, max_tokens=4, temperature=1.0, seed=seed))[0]
        body = encode_sample_response([WireSequence(c.token_ids, c.logprobs, c.finish_reason == "stop") for c in out],
                                      None)
        return deserialize_sample_response(body).sequences

    def batch(self, data: list[types.Datum], loss: str = "importance_sampling"):
        """The datums as the SDK encodes them and forward_backward's route decodes them into the trainer's batch."""
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss), model_id=MODEL, seq_id=1)
        wire = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString(), None)
        return tinker_batch(wire.data, loss, pad_id=self.tokenizer.pad_token_id, vocab_size=len(self.tokenizer),
                            max_len=64)

    def logprobs(self, batch) -> torch.Tensor:
        return self.trainer.run(MODEL, "forward_only", batch, None, {}, 1.0)["logprobs"]

    def step(self, batch, learning_rate: float) -> dict:
        """forward_backward(importance_sampling) then optim_step with Tinker's AdamParams defaults otherwise."""
        out = self.trainer.run(MODEL, "forward_backward", batch, "losses.tinker:importance_sampling", {}, 1.0)
        adam = types.AdamParams(learning_rate=learning_rate)
        self.trainer.run(MODEL, "optim_step", adam.learning_rate, (adam.beta1, adam.beta2), adam.eps,
                         adam.weight_decay, math.inf)
        return out


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    loop = Loop(tmp_path_factory.mktemp("tinker-rl-step"))
    # A few supervised steps first, so that the adapter is not zero (B starts at 0) and a misapplied adapter shows.
    prompt = loop.tokenizer.encode(PROMPT)
    answer = loop.tokenizer.encode("46") + [loop.tokenizer.eos_token_id]
    tokens = prompt + answer
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})
    for _ in range(3):
        loop.trainer.run(MODEL, "forward_backward", loop.batch([datum], "cross_entropy"), "losses.tinker:cross_entropy",
                         {}, 1.0)
        loop.trainer.run(MODEL, "optim_step", 1e-2, (0.9, 0.95), 1e-12, 0.0, math.inf)
    return loop


def _sequences_with_rewards(loop: Loop, adapter: str, prompt: list[int]):
    """Eight samples, the first rewarded: distinct first two, so that the rewarded one is not also penalized."""
    for seed in range(20):
        sequences = loop.sample(adapter, prompt, 8, seed)
        if list(sequences[0].tokens) != list(sequences[1].tokens):
            return sequences, [1.0] + [0.0] * 7
    raise AssertionError("no two distinct samples in 20 draws")


def test_the_samplers_log_probs_are_the_trainers_on_the_loops_datum_at_the_same_weights(loop):
    prompt = loop.tokenizer.encode(PROMPT)
    sequences, rewards = _sequences_with_rewards(loop, loop.save_weights_for_sampler(), prompt)
    data = group_data(prompt, sequences, rewards)
    batch = loop.batch(data)
    trained = loop.logprobs(batch)
    n_prompt = len(prompt) - 1
    for row, (datum, sequence) in enumerate(zip(data, sequences)):
        n = len(sequence.tokens)
        # Target t of the datum is token t + 1 of prompt + completion: the sampled tokens sit at n_prompt...
        assert batch.input_ids[row, n_prompt + 1: n_prompt + 1 + n].tolist() == list(sequence.tokens)
        # ... and there the trainer's log-probs are the sampler's (fp32 both: to 1e-4).
        np.testing.assert_allclose(trained[row, n_prompt: n_prompt + n].numpy(), sequence.logprobs, atol=1e-4)
        # The advantage is on those positions and nowhere else, so the ratio of every trained token starts at 1.
        advantages = batch.token_advantages[row]
        assert advantages[n_prompt: n_prompt + n].tolist() == [pytest.approx(rewards[row] - 1 / 8)] * n
        assert not advantages[:n_prompt].any() and not advantages[n_prompt + n:].any()


def test_importance_samplings_gradient_is_tinkers_minus_ratio_times_advantage(loop):
    prompt = loop.tokenizer.encode(PROMPT)
    sequences, rewards = _sequences_with_rewards(loop, loop.save_weights_for_sampler(), prompt)
    batch = loop.batch(group_data(prompt, sequences, rewards))
    shifted = loop.logprobs(batch) + 0.1 * torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    logprobs = shifted.clone().requires_grad_()
    out = importance_sampling(logprobs, batch)
    out.loss.backward()
    ratio = torch.exp(shifted - batch.behaviour_logprobs)
    trained = batch.token_advantages != 0
    # L = -sum_t r_t A_t: dL/dlogp_t = -r_t A_t on the sampled tokens, 0 on the prompt and the padding.
    torch.testing.assert_close(logprobs.grad, torch.where(trained, -ratio * batch.token_advantages, 0.0))
    assert out.loss.item() == pytest.approx(-(ratio * batch.token_advantages)[trained].sum().item(), rel=1e-5)


def test_one_step_raises_the_rewarded_sequence_and_the_next_sampler_samples_the_new_weights(loop):
    prompt = loop.tokenizer.encode(PROMPT)
    before_adapter = loop.save_weights_for_sampler()
    sequences, rewards = _sequences_with_rewards(loop, before_adapter, prompt)
    data = group_data(prompt, sequences, rewards)
    batch = loop.batch(data)
    n_prompt = len(prompt) - 1

    def sequence_logprob(logprobs: torch.Tensor, row: int) -> float:
        return float(logprobs[row, n_prompt: n_prompt + len(sequences[row].tokens)].sum())

    before = loop.logprobs(batch)
    out = loop.step(batch, 1e-3)
    assert out["loss"] == pytest.approx(-float((batch.token_advantages).sum()), rel=1e-4)  # every ratio is 1
    after = loop.logprobs(batch)
    # The rewarded sequence (A = 7/8) is likelier, and the penalized ones (A = -1/8) together are less likely.
    assert sequence_logprob(after, 0) > sequence_logprob(before, 0) + 0.05
    penalized = [sequence_logprob(after, r) - sequence_logprob(before, r) for r in range(1, 8)
                 if list(sequences[r].tokens) != list(sequences[0].tokens)]
    assert sum(penalized) < 0
    # save_weights_and_get_sampling_client: the new sampler scores with the stepped weights, not the old ones.
    new_adapter = loop.save_weights_for_sampler()
    for adapter, expected in ((new_adapter, after), (before_adapter, before)):
        loop.sampler.peft.set_adapter(loop.sampler._adapter(adapter))
        scored, _ = loop.sampler.engine.score(prompt, list(sequences[0].tokens))
        assert sum(scored) == pytest.approx(sequence_logprob(expected, 0), abs=1e-3)


def test_optim_step_applies_the_requests_adam_params_as_torch_adamw(loop):
    """Every AdamParams field the SDK sends reaches the session's optimizer: three optim_steps on given gradients
    move the adapter exactly as torch.optim.AdamW with those values (and the gradient clipped at grad_clip_norm), and
    the stepped parameters are the adapter on every target create_lora_training_client asks for, lm_head included."""
    session = "ts-test:train:adam"
    loop.trainer.add_session(session, LoRAConfig(rank=8, target_modules=list(LORA_TARGETS["qwen3"])), 1)
    try:
        params = [p for o in loop.trainer.sessions[session].optimizers.optimizers for g in o.param_groups
                  for p in g["params"]]
        stepped = {n.split(".lora_")[0].split(".")[-1] for n, p in loop.trainer.model.named_parameters()
                   if any(p is q for q in params)}
        assert stepped == {"wq", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head"}  # torchtitan's names of the 8 targets
        reference = [p.detach().clone().requires_grad_() for p in params]
        adam = types.AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.95, eps=1e-12, weight_decay=0.1,
                                grad_clip_norm=0.5)
        expected = torch.optim.AdamW(reference, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                     weight_decay=adam.weight_decay)
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            for p, r in zip(params, reference):
                p.grad = torch.randn(p.shape, generator=generator)
                r.grad = p.grad.clone()
            torch.nn.utils.clip_grad_norm_(reference, adam.grad_clip_norm)
            out = loop.trainer.run(session, "optim_step", adam.learning_rate, (adam.beta1, adam.beta2), adam.eps,
                                   adam.weight_decay, adam.grad_clip_norm)
            expected.step()
            assert out["lr"] == adam.learning_rate
            for p, r in zip(params, reference):
                torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-7)
    finally:
        loop.trainer.remove_session(session)
