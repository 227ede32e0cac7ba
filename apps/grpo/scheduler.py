"""The GRPO job's asynchronous scheduler: rollouts fill the replay buffer while the trainer drains it.

Two loops run concurrently on the controller's event loop (`RolloutScheduler.run`):

    fill:   reserve room in the buffer -> generate and score groups (the job's `generate`) -> add them to the buffer
    train:  next batch from the buffer -> train step (the trainer fetches the batch) -> publish the new version

The buffer decides how much rollout work may be under way (`ReplayBuffer.reserve`: nothing is generated that would be
too old to train when it arrives), so `fill` starts groups only as far as it grants room, within
`max_groups_in_flight`. Each loop wakes the other when it may have changed what the other waits for: a delivery may
complete a batch, a sampled batch or a new version may make room.

The controller moves handles, versions, texts and counts; tensors go actor to actor. A single-turn job's episodes stay
on the generator replicas until the buffer takes the ones the controller selected (`generate` hands the scheduler
`KeptEpisodes`: rows, rewards and advantages), the buffer has the scorer (the reference model or the teacher) score
what it adds, and the trainer's ranks fetch the sampled batch from the buffer actor (`TrainerActor.train_from`): a
batch is never pickled through the controller, nor (single-turn) the episodes it is made of.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from actors.replay_buffer import Added, HandedBatch
from actors.trainer import TrainStepResult
from forge.actor import rank0
from rl.types import EpisodeBatch, KeptEpisodes

Generate = Callable[[int, int], Awaitable[EpisodeBatch | KeptEpisodes | None]]


@dataclass(frozen=True)
class TrainedStep:
    """One training step, as the train loop hands it to the job: what was trained, what it made, and its timing."""

    batch: HandedBatch  # the buffer's summary of the batch (its tensors went from the buffer to the trainer)
    result: TrainStepResult  # the new policy version (being published) and the step's metrics
    trained_on: int  # the policy version the batch was sampled for
    waited_s: float  # from the step's start until the buffer held a batch
    started: float  # time.perf_counter() at the step's start
    cpu_started: float  # the controller's time.process_time() then


class RolloutScheduler:
    """Drives a job's buffer, trainer and rollouts: `run(generate, steps, on_step)`.

    `buffer`: a ReplayBufferActor; `trainer`: a TrainerActor mesh; `scorer`: the actor that scores every episode's
    reference log-probs (None without one); `group_size`: episodes per prompt group; `max_groups_in_flight`: groups
    being generated at most; `on_lost`: told of episodes the buffer could not take from the generator replica that
    kept them (it died in between), for the job to count them as failed generations."""

    def __init__(self, buffer: Any, trainer: Any, scorer: Any | None, *, pad_id: int, group_size: int,
                 max_groups_in_flight: int, teacher_top_k: int = 0,
                 on_lost: Callable[[Added], None] | None = None) -> None:
        self.buffer, self.trainer, self.scorer, self.on_lost = buffer, trainer, scorer, on_lost
        self.pad_id, self.group_size = pad_id, group_size
        self.teacher_top_k = teacher_top_k  # > 0: the scorer hands over its top-k too (teacher.top_k)
        self.max_groups_in_flight, self.groups_in_flight = max_groups_in_flight, 0
        self.version = self.last_version = 0  # the newest published policy version; the job's last batch's version
        self.stopped = False
        # Each has one waiter, which clears it before it looks: whatever happens after that sets it again.
        self._room, self._arrived = asyncio.Event(), asyncio.Event()

    def published(self, version: int, steps_left: int) -> None:
        """Policy `version` is published: groups start with it from now on; `steps_left`: the batches the job still
        trains (nothing is generated that only a later batch could train)."""
        self.version, self.last_version = version, version + steps_left - 1
        self._room.set()

    def stop(self) -> None:
        """Both loops end: `fill` at once, `train` once the step in progress is done."""
        self.stopped = True
        self._room.set()
        self._arrived.set()

    async def run(self, generate: Generate, steps: int, on_step: Callable[[TrainedStep], Awaitable[None]]) -> None:
        """Train `steps` batches (`train`) while `fill(generate)` fills the buffer; a `generate` that fails ends both with
        its error. `fill` ends first only when stopped: the training step in progress then finishes."""
        if steps <= 0 or self.stopped:  # nothing to train (a job resumed at its end), or stopped during the start-up
            self.stop()
            return
        rollouts = asyncio.ensure_future(self.fill(generate))
        training = asyncio.ensure_future(self.train(steps, on_step))
        try:
            done, _ = await asyncio.wait([training, rollouts], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            await training
        finally:
            self.stop()
            for task in [training, rollouts]:
                task.cancel()
            await asyncio.gather(training, rollouts, return_exceptions=True)

    # --- fill: reserve -> generate and score -> add ----------------------------------------------------------------
    async def fill(self, generate: Generate) -> None:
        """Until `stop`: whenever the buffer grants room for prompt groups with the newest version, within
        `max_groups_in_flight`, start one rollout of the groups granted. A rollout that fails ends this with its
        error."""
        running: set[asyncio.Future] = set()
        try:
            while not self.stopped:
                self._room.clear()
                for task in [t for t in running if t.done()]:
                    running.discard(task)
                    task.result()
                wanted, version = self.max_groups_in_flight - self.groups_in_flight, self.version
                granted = wanted and await self.buffer.reserve.call_one(version, wanted, self.group_size,
                                                                        self.last_version)
                if granted:
                    self.groups_in_flight += granted
                    task = asyncio.ensure_future(self.rollout(generate, granted, version))
                    task.add_done_callback(lambda _: self._room.set())
                    running.add(task)
                else:
                    await self._room.wait()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def rollout(self, generate: Generate, groups: int, version: int) -> None:
        """`groups` granted groups: generated with `version` or newer and scored (`generate`: their episodes, fewer or
        None when groups or episodes were dropped on the way), then added to the buffer in one call, which settles
        their reservation (the room of what was dropped is released), takes kept episodes from their generator
        replicas and has the scorer score them."""
        episodes = await generate(groups, version)
        added: Added = await self.buffer.add.call_one(episodes, reserved=groups * self.group_size, scorer=self.scorer,
                                                      pad_id=self.pad_id, top_k=self.teacher_top_k)
        if added.lost_episodes and self.on_lost is not None:
            self.on_lost(added)
        self.groups_in_flight -= groups
        self._arrived.set()
        self._room.set()

    # --- train: next batch -> train step -> publish ----------------------------------------------------------------
    async def train(self, steps: int, on_step: Callable[[TrainedStep], Awaitable[None]]) -> None:
        """Train up to `steps` batches, each on the newest version, handing each step to `on_step` (the job's logging,
        evaluation and checkpoints) before the next; ends early once stopped."""
        for step in range(steps):
            if self.stopped:
                return
            started, cpu_started = time.perf_counter(), time.process_time()
            batch = await self.next_batch()
            if batch is None:
                return
            waited_s = time.perf_counter() - started
            # The trainer's ranks fetch the batch from the buffer; the step starts publishing the next version.
            result: TrainStepResult = rank0(await self.trainer.train_from.call(self.buffer, batch.policy_version))
            self.published(result.version, steps_left=steps - step - 1)  # groups start with it from now on
            await on_step(TrainedStep(batch, result, batch.policy_version, waited_s, started, cpu_started))

    async def next_batch(self) -> HandedBatch | None:
        """Have the buffer sample the next batch for the newest version, once it holds one; None once stopped."""
        while not self.stopped:
            self._arrived.clear()
            batch = await self.buffer.next_batch.call_one(self.version, self.pad_id)
            self._room.set()  # a batch handed out, or stale episodes evicted: rollouts may have room
            if batch is not None:
                return batch
            await self._arrived.wait()
        return None
