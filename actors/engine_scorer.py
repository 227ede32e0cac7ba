"""A distillation teacher served by a generator engine (hf or vLLM) instead of TorchTitan: any architecture the
engine loads (a teacher of another family than the student's, a vLLM engine with its own tensor parallelism), its
weights fixed. It answers the reference actor's endpoint, `logprobs(episodes, pad_id)`, so the GRPO app scores
with either unchanged. Each episode is scored teacher-forced over the full vocabulary at the trainer's temperature
(`Engine.score`; vLLM's prompt log-probs are raw-logit ones, so a vLLM teacher needs temperature 1), which is why
apps.grpo asks for `rollout.top_p: 1` with such a teacher (no kept-set truncation to replay).
"""

from __future__ import annotations

import asyncio

import torch

from actors.engines import Engine, start_engine
from actors.generator_config import GeneratorConfig
from forge.actor import ForgeActor, endpoint
from rl.types import EpisodeBatch


async def score_episodes(engine: Engine, episodes: EpisodeBatch, temperature: float = 1.0) -> torch.Tensor:
    """log pi(completion | prompt) at `temperature` of every episode's completion tokens, flat like
    `episodes.completion_ids` (float32). The calls go out together: vLLM batches them; hf takes them in turn."""
    scored = await asyncio.gather(*(asyncio.to_thread(engine.score, e.prompt_ids, e.completion_ids, temperature)
                                    for e in episodes.unpack()))
    return torch.tensor([logprob for logprobs, _ in scored for logprob in logprobs], dtype=torch.float32)


class EngineScorer(ForgeActor):
    """One engine on one process (vLLM's tensor-parallel workers are its own), scoring episodes."""

    def __init__(self, config: GeneratorConfig | dict, temperature: float = 1.0) -> None:
        self.config = config if isinstance(config, GeneratorConfig) else GeneratorConfig(**config)
        self.temperature = temperature  # the trainer's: the teacher's log-probs are compared with the student's

    @endpoint
    async def setup(self) -> None:
        self.engine = await start_engine(self.config)

    @endpoint
    async def logprobs(self, episodes: EpisodeBatch, pad_id: int) -> torch.Tensor:
        """The teacher's log-probs of the episodes' completion tokens (`pad_id`: the reference actor's signature;
        an engine scores each sequence unpadded)."""
        return await score_episodes(self.engine, episodes, self.temperature)

    @endpoint
    async def teardown(self) -> None:
        if self.config.engine == "vllm":  # vLLM's engine core is a process of its own: stopped here
            await asyncio.to_thread(self.engine.close)
