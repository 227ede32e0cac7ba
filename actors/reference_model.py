"""The reference model: a frozen copy of the initial policy that scores sequences for the KL penalty, or, with
another checkpoint, a distillation teacher scoring the student's samples (losses/distill.py, apps/grpo: `teacher`).

A plain class; the reference actor wraps it. It is built like the trainer's model (actors/model_builder.py: same
checkpoint, same torchtitan model, FSDP2 across ranks when there are several), then frozen, and scores
sequences with the trainer's log-prob code (actors/logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.logprobs import check_input_ids, score_rows, token_logprobs, topk_logprobs
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

    @torch.no_grad()
    def topk_logprobs(self, input_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For right-padded sequences [B, T], at each position: log pi_ref(input_ids[:, 1:]) [B, T-1], the K =
        min(k, vocabulary) most likely next tokens [B, T-1, K] and their log-probs with the log of the rest of the
        mass last [B, T-1, K+1] (actors.logprobs.topk_logprobs), on CPU, from one forward pass per chunk of rows."""
        check_input_ids(input_ids, self.model_args)
        width = min(k, self.model_args.vocab_size)

        def score(rows: torch.Tensor) -> torch.Tensor:  # the three packed as floats, for score_rows' one tensor
            logits = self.model(rows[:, :-1])
            ids, logprobs = topk_logprobs(logits, width, self.config.temperature)
            sampled = token_logprobs(logits, rows[:, 1:], self.config.temperature)
            return torch.cat([sampled.unsqueeze(-1), ids.float(), logprobs], dim=-1)

        packed = score_rows(score, input_ids.to(self.device), self.config.chunk_rows, self.dp)
        return packed[..., 0], packed[..., 1 : width + 1].long(), packed[..., width + 1 :]


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

    @endpoint
    async def topk_logprobs(self, episodes: EpisodeBatch, pad_id: int, k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         torch.Tensor]:
        """The episodes' `ref_logprobs`, `ref_topk_ids` and `ref_topk_logprobs` (the teacher's top-k at each
        completion token's position: losses.distill's kl="reverse" / "forward"), flat like `episodes.completion_ids`."""
        if episodes.kept_token_ids is not None:
            raise ValueError("ReferenceActor.topk_logprobs: the episodes were sampled with top-k / top-p "
                             "(kept_token_ids set); the teacher's top-k compares full-vocabulary distributions: sample with "
                             "rollout.top_p=1 and no top_k")
        batch = TrainBatch.from_episodes(episodes, pad_id)
        logprobs, ids, topk = self.model.topk_logprobs(batch.input_ids, k)
        index = episodes.response_index()
        return logprobs[index].float(), ids[index].to(torch.int32), topk[index].float()
