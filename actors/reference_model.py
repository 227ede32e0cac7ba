"""The reference model: a frozen copy of the initial policy that scores sequences for the KL penalty, or, with
another checkpoint, a distillation teacher scoring the student's samples (losses/distill.py, apps/grpo: `teacher`).

A plain class; the reference actor wraps it. It is built like the trainer's model (actors/model_builder.py: same
checkpoint, same torchtitan model, FSDP2 across ranks when there are several), then frozen, and scores
sequences with the trainer's log-prob code (actors/logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.logprobs import check_input_ids, score_rows, token_logprobs
from actors.model_config import ModelConfig, is_int, require_field
from forge.actor import ForgeActor, endpoint
from forge.distributed import DataParallel, init_from_environment, local_device
from rl.types import EpisodeBatch, TrainBatch


@dataclass
class ReferenceConfig(ModelConfig):
    """The policy's initial checkpoint (`model_path`, or `init_checkpoint`), or a teacher's, in `dtype` for parameters
    and compute alike: frozen weights need no float32 master copy."""

    chunk_rows: int = 4  # sequences per forward pass: peak memory is one [chunk_rows, T, vocab] logits tensor

    def __post_init__(self) -> None:
        super().__post_init__()
        require_field(self, "chunk_rows", is_int(self.chunk_rows) and self.chunk_rows >= 1, "an int >= 1")


class ReferenceModel:
    """Per-token log-probs of given sequences under the frozen initial policy.

    With world_size > 1 (torch.distributed initialized by the caller) every rank passes the same
    sequences, scores its own data-parallel slice and returns the whole batch's log-probs.
    """

    def __init__(self, config: ReferenceConfig, *, rank: int = 0, world_size: int = 1) -> None:
        # Imported here, in the model's processes: torchtitan and peft would add seconds to every controller's start.
        from actors.model_builder import ModelSettings, build_model, parallel_dims, resolve_model_path

        self.config = config
        self.device = local_device(config.device)
        dims = parallel_dims(world_size)
        self.model, self.model_args, _ = build_model(
            resolve_model_path(config.model_path), config.family, device=self.device,
            param_dtype=getattr(torch, config.dtype), parallel_dims=dims,
            settings=ModelSettings(dtype=config.dtype), init_checkpoint=config.init_checkpoint)
        self.model.requires_grad_(False)
        self.model.eval()
        self.dp = DataParallel.of(dims)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, kept_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """log pi_ref(input_ids[:, 1:]) for right-padded sequences [B, T]: [B, T-1] float32 on CPU.

        Rows go through the model `chunk_rows` at a time and each chunk's logits are reduced to one
        log-prob per position before the next, so memory grows with B x T, not B x T x vocab.
        With `kept_token_ids` ([B, T-1, K], top-k / top-p rollouts) the reference is truncated to the same kept
        sets as the policy the trainer scores, so the KL term compares like with like (0 while they are equal).
        """
        check_input_ids(input_ids, self.model_args)

        def score(rows: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
            return token_logprobs(self.model(rows[:, :-1]), rows[:, 1:], self.config.temperature, kept)

        kept = None if kept_token_ids is None else kept_token_ids.to(self.device)
        return score_rows(score, input_ids.to(self.device), self.config.chunk_rows, self.dp, kept)


class ReferenceActor(ForgeActor):
    """The reference model on a proc mesh; `logprobs` runs on every rank and returns the whole batch's."""

    def __init__(self, config: ReferenceConfig | dict) -> None:
        self.config = config if isinstance(config, ReferenceConfig) else ReferenceConfig(**config)

    @endpoint
    async def setup(self) -> None:
        rank, world_size = init_from_environment(self.config.device)
        self.model = ReferenceModel(self.config, rank=rank, world_size=world_size)

    @endpoint
    async def logprobs(self, episodes: EpisodeBatch, pad_id: int) -> torch.Tensor:
        """log pi_ref of the episodes' completion tokens, flat like `episodes.completion_ids` (its `ref_logprobs`)."""
        batch = TrainBatch.from_episodes(episodes, pad_id)
        logprobs = self.model.logprobs(batch.input_ids, batch.kept_token_ids)
        return logprobs[episodes.response_index()].float().cpu()
