"""The reference model: a frozen copy of the initial policy that scores sequences for the KL penalty.

A plain class; the reference actor wraps it. It is built by the trainer's `build_model` (same checkpoint,
same torchtitan model, FSDP2 across ranks when there are several), then frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims

from forge.actor import ForgeActor, endpoint
from forge.distributed import init_from_environment
from forge.types import Episode, TrainBatch
from actors.trainer import (
    build_job_config,
    build_model,
    check_input_ids,
    check_model_fields,
    data_parallel_rank,
    data_parallel_rows,
    device_for,
    gather_rows,
    require_field,
    resolve_model_path,
    token_logprobs,
)


@dataclass
class ReferenceConfig:
    model_path: str  # the policy's initial checkpoint (HF folder or hub id)
    family: str = "qwen3"
    init_checkpoint: str | None = None  # a torchtitan/DCP checkpoint to take the weights from instead
    dtype: str = "float32"  # parameter and compute dtype: frozen weights need no float32 master copy
    device: str = "cpu"
    temperature: float = 1.0  # the generator's sampling temperature, as in TrainerConfig
    chunk_rows: int = 4  # sequences per forward pass: peak memory is one [chunk_rows, T, vocab] logits tensor

    def __post_init__(self) -> None:
        check_model_fields(self)
        rows = self.chunk_rows
        require_field(self, "chunk_rows", isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1,
                      "an int >= 1")


class ReferenceModel:
    """Per-token log-probs of given sequences under the frozen initial policy.

    With world_size > 1 (torch.distributed initialized by the caller) every rank passes the same
    sequences, scores its own data-parallel slice and returns the whole batch's log-probs.
    """

    def __init__(self, config: ReferenceConfig, *, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.device = device_for(config.device)
        parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                     world_size=world_size)
        model_path = resolve_model_path(config.model_path)
        job = build_job_config(dtype=config.dtype)
        self.model, self.model_args, _ = build_model(
            model_path, config.family, device=self.device, param_dtype=TORCH_DTYPE_MAP[config.dtype],
            parallel_dims=parallel_dims, job_config=job, init_checkpoint=config.init_checkpoint)
        self.model.requires_grad_(False)
        self.model.eval()
        self.dp_degree, self.dp_rank, self.dp_group = data_parallel_rank(parallel_dims)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """log pi_ref(input_ids[:, 1:]) for right-padded sequences [B, T]: [B, T-1] float32 on CPU.

        Rows go through the model `chunk_rows` at a time and each chunk's logits are reduced to one
        log-prob per position before the next, so memory grows with B x T, not B x T x vocab.
        """
        check_input_ids(input_ids, self.model_args)
        input_ids = input_ids.to(self.device)
        start, stop = data_parallel_rows(input_ids.shape[0], self.dp_degree, self.dp_rank)
        chunks = []
        for s in range(start, stop, self.config.chunk_rows):
            rows = input_ids[s : min(s + self.config.chunk_rows, stop)]
            logits = self.model(rows[:, :-1])
            chunks.append(token_logprobs(logits, rows[:, 1:], self.config.temperature))
            del logits  # free this chunk's [rows, T, vocab] before the next forward pass
        return gather_rows(torch.cat(chunks), self.dp_degree, self.dp_group).cpu()



class ReferenceActor(ForgeActor):
    """The reference model on a proc mesh; `logprobs` runs on every rank and returns the whole batch's."""

    def __init__(self, config: ReferenceConfig | dict) -> None:
        self.config = config if isinstance(config, ReferenceConfig) else ReferenceConfig(**config)

    @endpoint
    async def setup(self) -> None:
        rank, world_size = init_from_environment(self.config.device)
        self.model = ReferenceModel(self.config, rank=rank, world_size=world_size)

    @endpoint
    async def logprobs(self, episodes: list[Episode], pad_id: int) -> list[list[float]]:
        """log pi_ref of each episode's completion tokens."""
        batch = TrainBatch.from_episodes(episodes, pad_id)
        logprobs = self.model.logprobs(batch.input_ids)
        out = []
        for row, e in enumerate(episodes):
            start = len(e.prompt_ids) - 1
            out.append(logprobs[row, start : start + len(e.completion_ids)].tolist())
        return out
