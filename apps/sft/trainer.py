"""The SFT trainer: apps.grpo's trainer actor, plus the held-out loss (a forward pass without gradients)."""

from __future__ import annotations

from actors.trainer import TrainerActor
from forge.actor import endpoint
from losses.nll import nll
from rl.types import TrainBatch


class SFTTrainerActor(TrainerActor):
    """TrainerActor (train_step, checkpoints, export_hf, publishing) with `held_out_loss`."""

    @endpoint
    async def held_out_loss(self, batch: TrainBatch) -> float:
        """The nll of the batch's learned tokens at the current weights, no gradients (every rank scores its rows)."""

        def score() -> float:
            return nll(self.trainer.logprobs(batch, temperature=1.0), batch).loss.item()

        return await self._compute(score)
