"""Online-RL sessions: per-session API keys, every interaction's tokens, log-probs and policy versions, rewards,
and the trajectory each session exports as replay-buffer episodes when it ends. Plain Python (no actors).

A conversation of several requests is one episode: a request whose prompt starts with exactly the previous request's
prompt and generated ids continues it (rl.environments.trajectory.Trajectory: the new tokens between, the user's
message and the template's, go in masked out; the reply's tokens masked in, with their log-probs and versions).
A request that re-sends the conversation verbatim (the reply as the gateway answered it) gets such a prompt: the
encoder continues the session's exact ids (apps/gateway/chat.py, ChatContext). Any other request (a message edited,
a reply changed, a new conversation) starts a new episode and the break is counted: an episode never holds tokens
the model did not see."""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from apps.gateway.chat import ChatContext
from apps.http.errors import ServiceError
from rl.environments.trajectory import Trajectory
from rl.types import Completion, Episode


@dataclass
class Interaction:
    interaction_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    trainable: bool  # sampled at the trainer's temperature (log-probs comparable)
    reward: float | None = None
    kept_token_ids: Any = None  # the kept sets of truncated sampling (a tensor), None: the full vocabulary

    def completion(self) -> Completion:
        return Completion(prompt_ids=self.prompt_ids, token_ids=self.completion_ids, text="", logprobs=self.logprobs,
                          finish_reason="stop", policy_versions=self.policy_versions,
                          kept_token_ids=self.kept_token_ids)


@dataclass
class RLSession:
    session_id: str
    api_key: str
    timeout_s: float
    last_active: float = field(default_factory=time.monotonic)
    interactions: list[Interaction] = field(default_factory=list)
    busy: int = 0  # chat requests in progress
    context: ChatContext | None = None  # the conversation so far, as the model saw it (the next request's start)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def idle_for(self) -> float:
        return 0.0 if self.busy else time.monotonic() - self.last_active


def new_api_key() -> str:
    return f"sk-sess-{secrets.token_urlsafe(18)}"


class SessionStore:
    """Active sessions by key and by id. Ending a session removes it (its key stops working) and returns it."""

    def __init__(self) -> None:
        self.by_key: dict[str, RLSession] = {}
        self.by_id: dict[str, RLSession] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.by_id)

    def lookup(self, api_key: str) -> RLSession:
        session = self.by_key.get(api_key)
        if session is None:
            raise ServiceError(401, "invalid session API key: no active session holds it (it may have ended or "
                                    "timed out; start a new one with /rl/start_session)")
        return session

    def check_new(self, task_id: str | None, api_key: str | None, refresh: bool) -> RLSession | None:
        """The session a start_session would end (a refresh), or None; 409 for the conflicts."""
        bound = self.by_key.get(api_key) if api_key else None
        if bound is not None and not refresh:
            raise ServiceError(409, f"api_key is already bound to session {bound.session_id!r}; end that session "
                                    "first or start with refresh=true")
        if task_id is not None and task_id in self.by_id and self.by_id[task_id] is not bound:
            raise ServiceError(409, f"task_id={task_id!r}: session {task_id!r} is active and bound to another API "
                                    "key; end it first, or refresh it with its own key")
        return bound

    def start(self, task_id: str | None, api_key: str | None, timeout_s: float) -> RLSession:
        session_id = task_id or f"sess-{next(self._ids)}-{secrets.token_hex(4)}"
        session = RLSession(session_id, api_key or new_api_key(), timeout_s)
        self.by_key[session.api_key] = session
        self.by_id[session_id] = session
        return session

    def remove(self, session: RLSession) -> None:
        if self.by_key.get(session.api_key) is session:
            del self.by_key[session.api_key]
        if self.by_id.get(session.session_id) is session:
            del self.by_id[session.session_id]

    def expired(self) -> list[RLSession]:
        return [s for s in self.by_id.values() if s.idle_for() > s.timeout_s]


def set_reward(session: RLSession, reward: float, interaction_id: str | None) -> Interaction:
    if not session.interactions:
        raise ServiceError(409, f"session {session.session_id!r} has no interaction yet; call /chat/completions first")
    if interaction_id is None:
        target = session.interactions[-1]
    else:
        target = next((i for i in session.interactions if i.interaction_id == interaction_id), None)
        if target is None:
            known = [i.interaction_id for i in session.interactions][-10:]
            raise ServiceError(404, f"interaction_id={interaction_id!r} is not in session {session.session_id!r}; "
                                    f"its interactions: {known}")
    target.reward = reward
    return target


class SessionExport(NamedTuple):
    episodes: list[Episode]
    skipped: int  # interactions not trained: sampled off the trainer's temperature, or no token generated
    history_breaks: int  # requests that did not continue the previous one's exact tokens (a new episode each)


def conversations(interactions: list[Interaction]) -> tuple[list[tuple[Trajectory, list[Interaction]]], int]:
    """The session's episodes as trajectories with the interactions each holds, and the history breaks between them.
    An untrainable reply stays in its episode as context (masked out: the model saw it, the loss may not score it)."""
    chains: list[tuple[Trajectory, list[Interaction]]] = []
    breaks = 0
    for interaction in interactions:
        if chains and interaction.prompt_ids[: len(chains[-1][0].ids)] == chains[-1][0].ids:
            trajectory, held = chains[-1]
            trajectory.add_observation(interaction.prompt_ids[len(trajectory.ids):])
        else:
            breaks += bool(chains)
            trajectory, held = Trajectory(prompt_ids=list(interaction.prompt_ids)), []
            chains.append((trajectory, held))
        if interaction.trainable:
            trajectory.add_model_turn(interaction.completion())
        else:
            trajectory.add_observation(list(interaction.completion_ids))
        held.append(interaction)
    return chains, breaks


def trajectory_episodes(session: RLSession, *, discount: float, group_id: int, first_episode_id: int) -> SessionExport:
    """One episode per conversation (`conversations`) with at least one trainable generated token.

    An episode's reward is the sum of the rewards set on its interactions; an episode without any takes the next
    episode's (effective) reward times `discount`; the last one without any gets 0.
    """
    chains, breaks = conversations(session.interactions)
    rewards: list[float] = [0.0] * len(chains)
    following: float | None = None
    for index in range(len(chains) - 1, -1, -1):
        own = [i.reward for i in chains[index][1] if i.reward is not None]
        following = sum(own) if own else (following * discount if following is not None else None)
        rewards[index] = following if following is not None else 0.0
    skipped = sum(1 for i in session.interactions if not i.trainable or not i.completion_ids)
    trained = [(trajectory, reward) for (trajectory, _), reward in zip(chains, rewards) if any(trajectory.mask)]
    episodes = [trajectory.to_episode(episode_id=first_episode_id + n, group_id=group_id, reward=float(reward))
                for n, (trajectory, reward) in enumerate(trained)]
    return SessionExport(episodes, skipped, breaks)
