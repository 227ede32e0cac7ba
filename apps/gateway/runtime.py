"""The gateway's state and operations: the generator service that answers chats, the session store, the
replay buffer every ended session exports to, and the training loop that runs whenever a batch is buffered.
The trainer publishes each new policy version; the generators pick it up in the background (no restart)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from actors.generator import Generator
from actors.replay_buffer import ReplayBufferActor
from actors.trainer import TrainerActor
from apps.gateway.chat import PromptEncoder, completion_response
from apps.gateway.config import GatewayConfig
from apps.gateway.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    EndSessionResponse,
    ExportedEpisode,
    GatewayHealth,
    GatewayStats,
    SetRewardRequest,
    SetRewardResponse,
    StartSessionRequest,
    StartSessionResponse,
)
from apps.gateway.sessions import Interaction, RLSession, SessionStore, set_reward, trajectory_episodes
from apps.http.errors import ServiceError, field_error
from apps.http.model import tokenizer_info
from apps.http.actor_calls import endpoint_failure
from forge.actor import EndpointError, rank0
from forge.service import NoHealthyReplicaError
from rl.types import EpisodeBatch, SamplingParams
from forge.weights.startup import start_weight_store

logger = logging.getLogger(__name__)
WEIGHTS = "policy"



class Gateway:
    def __init__(self, cfg: GatewayConfig, model_path: str) -> None:
        self.cfg = cfg
        self.model_path = model_path
        info = tokenizer_info(model_path)
        self.pad_id = info.pad_id
        self.encoder = PromptEncoder(info.tokenizer, cfg.chat.format, info.max_model_len)
        self.sessions = SessionStore()
        self.version = 0
        self.train_steps = 0
        self.counts: Counter[str] = Counter()
        self.ended: Counter[str] = Counter()
        self.held = 0  # episodes in the replay buffer (refreshed after every add and sample)
        self.buffer_stats: dict[str, int] = {}
        self.last_train_metrics: dict[str, float] = {}
        self._episode_ids = itertools.count()
        self._groups = itertools.count()
        self._exported = asyncio.Event()
        self._export_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self.generators: Any = None

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        await start_weight_store()
        trainer_cfg = replace(cfg.trainer, model_path=self.model_path)
        generator_cfg = replace(cfg.generator, model=self.model_path, weight_namespace=WEIGHTS)
        # One after the other: on a small busy host, spawning every mesh at once has starved Monarch's
        # start-up messages past their deadline.
        self.buffer = await ReplayBufferActor.options(mesh_name="replay_buffer").as_actor(cfg.replay_buffer)
        self.trainer = await TrainerActor.options(mesh_name="trainer").as_actor(trainer_cfg, weight_namespace=WEIGHTS)
        self.generators = await Generator.options(num_replicas=cfg.generator_replicas,
                                                  mesh_name="generator").as_service(generator_cfg)
        self.version = int(rank0(await self.trainer.publish_weights.call()))
        await self.generators.update_weights.fanout(self.version)
        self._tasks = [asyncio.ensure_future(self._reap())]
        if cfg.rl.train:
            self._tasks.append(asyncio.ensure_future(self._train_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in list(self.sessions.by_id.values()):
            with contextlib.suppress(Exception):
                await self.end(session, "server shutdown")

    async def watch(self) -> None:
        """Returns (or raises) when a background task (the reaper, the training loop) ends: the gateway stops."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()

    # -- capacity ------------------------------------------------------------------------------------
    @property
    def used_capacity(self) -> int:
        return len(self.sessions) + self.held

    def _check_capacity(self) -> None:
        if self.used_capacity >= self.cfg.capacity:
            raise ServiceError(429, f"no capacity: {len(self.sessions)} open sessions + {self.held} buffered episodes "
                                    f"reach the staleness bound replay_buffer.batch_size x (max_policy_age + 1) = "
                                    f"{self.cfg.capacity}; retry after a training step")

    # -- sessions ------------------------------------------------------------------------------------
    async def start_session(self, request: StartSessionRequest) -> StartSessionResponse:
        rl = self.cfg.rl
        timeout = request.timeout_seconds or rl.session_timeout_s
        if timeout > rl.max_session_timeout_s:
            raise field_error(["timeout_seconds"], timeout, f"must be <= rl.max_session_timeout_s={rl.max_session_timeout_s}")
        previous = self.sessions.check_new(request.task_id, request.api_key, request.refresh)
        if previous is not None:
            await self.end(previous, "refreshed")
        self._check_capacity()
        session = self.sessions.start(request.task_id, request.api_key, timeout)
        self.counts["sessions_started"] += 1
        return StartSessionResponse(session_id=session.session_id, api_key=session.api_key, policy_version=self.version,
                                    ended_session=previous.session_id if previous else None)

    def session(self, api_key: str) -> RLSession:
        session = self.sessions.lookup(api_key)
        session.touch()
        return session

    async def end(self, session: RLSession, reason: str, *, return_episodes: bool = False) -> EndSessionResponse:
        """Remove the session (its key stops working) and export its trajectory to the replay buffer: one episode
        per conversation (apps/gateway/sessions.py)."""
        self.sessions.remove(session)
        self.ended[reason] += 1
        async with self._export_lock:
            episodes, skipped, breaks = trajectory_episodes(session, discount=self.cfg.rl.turn_discount,
                                                            group_id=next(self._groups), first_episode_id=0)
            for episode in episodes:
                episode.episode_id = next(self._episode_ids)
            self.counts["skipped_interactions"] += skipped
            self.counts["history_breaks"] += breaks
            if episodes:
                try:
                    self.held = (await self._buffer_call(self.buffer.add.call_one(EpisodeBatch.pack(episodes)))).held
                except Exception:
                    self.counts["export_failures"] += len(episodes)
                    logger.exception("session %s: export to the replay buffer failed", session.session_id)
                    raise
                self.counts["exported_trajectories"] += 1
                self.counts["exported_episodes"] += len(episodes)
                self._exported.set()
        return EndSessionResponse(session_id=session.session_id, interactions=len(session.interactions),
                                  exported_episodes=len(episodes), history_breaks=breaks, reason=reason,
                                  episodes=[ExportedEpisode.of(e) for e in episodes] if return_episodes else None)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for session in self.sessions.expired():
                with contextlib.suppress(Exception):
                    await self.end(session, "timeout")

    def reward(self, session: RLSession, request: SetRewardRequest) -> SetRewardResponse:
        target = set_reward(session, request.reward, request.interaction_id)
        return SetRewardResponse(session_id=session.session_id, interaction_id=target.interaction_id,
                                 reward=request.reward)

    # -- chat ----------------------------------------------------------------------------------------
    async def chat(self, session: RLSession, request: ChatCompletionRequest) -> ChatCompletionResponse:
        chat = self.cfg.chat
        max_tokens = request.max_completion_tokens or request.max_tokens or chat.default_max_tokens
        if max_tokens > chat.max_tokens_limit:
            raise field_error(["max_tokens"], max_tokens, f"must be <= {chat.max_tokens_limit} (chat.max_tokens_limit)")
        train_temperature = self.cfg.trainer.temperature
        temperature = train_temperature if request.temperature is None else request.temperature
        prompt_ids = self.encoder.encode(request.messages, session.context)
        params = SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature,
                                top_p=1.0 if request.top_p is None else request.top_p, seed=request.seed)
        session.busy += 1
        try:
            (completion,) = await asyncio.wait_for(self.generators.generate.route(prompt_ids, params),
                                                   self.cfg.rl.call_timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(504, f"generation did not finish within rl.call_timeout_s={self.cfg.rl.call_timeout_s}s") from None
        except EndpointError as e:
            raise endpoint_failure(e) from None
        except NoHealthyReplicaError as e:
            raise ServiceError(502, str(e)) from None
        finally:
            session.busy -= 1
            session.touch()
        # Log-probs are comparable with the trainer's only at its temperature (and without top-p filtering).
        trainable = temperature == train_temperature and params.top_p == 1.0
        interaction = Interaction(f"chatcmpl-{secrets.token_hex(12)}", list(completion.prompt_ids),
                                  list(completion.token_ids), list(completion.logprobs),
                                  list(completion.policy_versions), trainable,
                                  kept_token_ids=completion.kept_token_ids)
        session.interactions.append(interaction)
        session.context = self.encoder.context(request.messages, completion)
        self.counts["interactions"] += 1
        return completion_response(completion, interaction_id=interaction.interaction_id, session_id=session.session_id,
                                   model=request.model, trainable=trainable, with_logprobs=request.logprobs,
                                   encoder=self.encoder)

    # -- training ------------------------------------------------------------------------------------
    async def _buffer_call(self, call: Any) -> Any:
        try:
            return await asyncio.wait_for(call, self.cfg.rl.call_timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(504, f"the replay buffer did not answer within rl.call_timeout_s="
                                    f"{self.cfg.rl.call_timeout_s}s") from None

    async def _train_loop(self) -> None:
        while True:
            handed = await self._buffer_call(self.buffer.next_batch.call_one(self.version, self.pad_id))
            if handed is None:
                self.buffer_stats = await self._buffer_call(self.buffer.stats.call_one())
                self.held = self.buffer_stats["held"]
                self._exported.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._exported.wait(), 1.0)
                continue
            self.buffer_stats = handed.stats
            self.held = self.buffer_stats["held"]
            # The gateway's advantages are relative to the whole batch, set here: it takes the batch itself.
            batch = await self._buffer_call(self.buffer.batch.call_one(self.version))
            batch.advantages = batch_relative_advantages(batch.rewards)
            started = time.perf_counter()
            result = rank0(await asyncio.wait_for(self.trainer.train_step.call(batch), self.cfg.rl.train_timeout_s))
            self.version = result.version
            self.train_steps += 1
            self.counts["trained_episodes"] += batch.num_sequences
            self.last_train_metrics = {**{k: float(v) for k, v in result.metrics.items()},
                                       "policy_version": float(result.version)}  # reported as it was
            self.last_train_metrics["reward_mean"] = float(batch.rewards.mean())
            self.last_train_metrics["step_s"] = time.perf_counter() - started
            logger.info("train step %d: policy version %d, reward %.3f", self.train_steps, self.version,
                        self.last_train_metrics["reward_mean"])

    # -- reporting -----------------------------------------------------------------------------------
    def health(self) -> GatewayHealth:
        healthy = len(self.generators.healthy_replicas()) if self.generators is not None else 0
        return GatewayHealth(status="ok", policy_version=self.version, active_sessions=len(self.sessions),
                             generator_replicas_healthy=healthy, train_steps=self.train_steps)

    async def stats(self) -> GatewayStats:
        self.buffer_stats = await self._buffer_call(self.buffer.stats.call_one())
        self.held = self.buffer_stats["held"]
        c = self.counts
        return GatewayStats(policy_version=self.version, train_steps=self.train_steps, active_sessions=len(self.sessions),
                            capacity=self.cfg.capacity, used_capacity=self.used_capacity,
                            sessions_started=c["sessions_started"], sessions_ended=dict(self.ended),
                            interactions=c["interactions"], exported_trajectories=c["exported_trajectories"],
                            exported_episodes=c["exported_episodes"], skipped_interactions=c["skipped_interactions"],
                            history_breaks=c["history_breaks"],
                            export_failures=c["export_failures"], trained_episodes=c["trained_episodes"],
                            buffer=dict(self.buffer_stats), last_train_metrics=self.last_train_metrics)


def batch_relative_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Advantages relative to the batch: (r - mean) / std (population std; 0 when every reward is equal)."""
    rewards = rewards.double()
    std = rewards.std(correction=0)
    if std == 0:
        return torch.zeros_like(rewards, dtype=torch.float32)
    return ((rewards - rewards.mean()) / (std + 1e-6)).float()
