"""OpenEnv environments (openenv-core) as forge environments, unchanged.

An OpenEnv environment is a gym-style object, `reset(seed=..., episode_id=...) -> Observation` and
`step(Action) -> Observation`, whose Action and Observation are pydantic models (the observation carries `reward`
and `done`). `OpenEnvEnvironment` plays one forge episode on one: the model's text becomes the Action's text field,
the Observation's text field the next observation, its reward and done the StepResult's, its metadata the info.
The environment is either in this process (an `Environment` subclass) or served (an `EnvClient` subclass, OpenEnv's
client of an environment server: one WebSocket session per episode, its blocking calls on a worker thread; its
constructor's options give the server's `base_url`).

    spec = OpenEnvSpec.resolve("my_pkg.envs:GuessEnvironment", options={"tries": 3})   # checked before spawn
    env = spec.environment()              # a forge Environment over a fresh GuessEnvironment(tries=3)
    first_prompt = await env.reset(OpenEnvProblem(seed=7, ...))

The text fields are found from the types: the Action's one `str` field and the Observation's one `str` field beyond
OpenEnv's own (done, reward, metadata); with several, `action_field` / `observation_field` name them.
"""

from __future__ import annotations

import asyncio
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rl.environments.protocol import StepResult


class OpenEnvProblem(NamedTuple):
    """One episode of an OpenEnv task: the environment is reset with `seed`. OpenEnv environments make their own
    first prompt, so `prompt` is a label (failure messages print it) and, with `answer`, the fixed text the weight
    canary scores (apps.grpo's canary.every)."""

    seed: int
    prompt: str
    answer: str


@dataclass
class OpenEnvSpec:
    """An OpenEnv environment class (or factory) resolved and checked, with its text fields."""

    factory: Any  # the Environment subclass, or the EnvClient subclass of a served one
    options: dict[str, Any] = field(default_factory=dict)  # its constructor's keyword arguments
    action_type: type = object
    action_field: str = ""
    observation_field: str | None = None  # None: found on the first observation (its type was not declared)

    @classmethod
    def resolve(cls, reference: str, *, options: dict[str, Any] | None = None, action_field: str | None = None,
                observation_field: str | None = None, prefix: str = "task") -> OpenEnvSpec:
        """'package.module:Class' -> the spec; every error names the config field (`prefix`.name, ...) and value."""
        from openenv.core import EnvClient
        from openenv.core.env_server.interfaces import Environment

        from forge.config import load_callable

        factory = load_callable(reference, field=f"{prefix}.name")
        if not (isinstance(factory, type) and issubclass(factory, (Environment, EnvClient))):
            raise ValueError(f"{prefix}.name={reference!r}: must name an OpenEnv environment, a subclass of "
                             "openenv.core.env_server.interfaces.Environment, or the client of a served one, a "
                             f"subclass of openenv.core.EnvClient (got {factory!r})")
        action_type, observation_type = _declared_types(factory)
        if action_type is None:
            raise ValueError(f"{prefix}.name={reference!r}: cannot tell its Action type; declare it as "
                             f"`class {factory.__name__}(Environment[MyAction, MyObservation, State])` (or "
                             "EnvClient[...]) or annotate step's `action` parameter")
        action_field = _text_field(action_type, action_field, f"{prefix}.action_field", base=_base("Action"))
        if observation_type is not None:
            observation_field = _text_field(observation_type, observation_field, f"{prefix}.observation_field",
                                            base=_base("Observation"))
        return cls(factory, dict(options or {}), action_type, action_field, observation_field)

    def environment(self) -> OpenEnvEnvironment:
        """One episode's forge environment over a fresh OpenEnv environment."""
        return OpenEnvEnvironment(self.factory(**self.options), self.action_type, self.action_field,
                                  self.observation_field)


class OpenEnvEnvironment:
    """The forge Environment protocol over one OpenEnv environment object (closed when its episode ends)."""

    def __init__(self, env: Any, action_type: type, action_field: str, observation_field: str | None) -> None:
        from openenv.core import EnvClient

        self.env, self.action_type, self.action_field = env, action_type, action_field
        self.observation_field = observation_field
        self.served = isinstance(env, EnvClient)  # an environment server's client: blocking calls

    async def reset(self, problem: OpenEnvProblem) -> str:
        if self.served:
            return self._text((await asyncio.to_thread(self.env.reset, seed=problem.seed)).observation)
        return self._text(await self.env.reset_async(seed=problem.seed))

    async def step(self, action: str) -> StepResult:
        request = self.action_type(**{self.action_field: action})
        if self.served:  # the client's StepResult carries the reward and done beside the observation
            result = await asyncio.to_thread(self.env.step, request)
            observation, reward, done = result.observation, result.reward, result.done
        else:
            observation = await self.env.step_async(request)
            reward, done = observation.reward, observation.done
        return StepResult(observation=self._text(observation), reward=float(reward or 0.0), done=bool(done),
                          info=dict(observation.metadata))

    async def close(self) -> None:
        """The rollout's end of the episode, however it ended: a served environment's session on its server ends."""
        if self.served:
            await asyncio.to_thread(self.env.close)
        else:
            self.env.close()

    def _text(self, observation: Any) -> str:
        if self.observation_field is None:
            self.observation_field = _text_field(type(observation), None, "task.observation_field",
                                                 base=_base("Observation"))
        return getattr(observation, self.observation_field)


def _base(name: str) -> set[str]:
    from openenv.core.env_server import types

    return set(getattr(types, name).model_fields)


def _declared_types(factory: type) -> tuple[type | None, type | None]:
    """(Action type, Observation type) from `Environment[A, O, S]` in the class's bases, else from the annotations
    of `step`'s action and `reset`'s return."""
    from openenv.core.env_server.types import Action, Observation

    for klass in factory.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = [a for a in typing.get_args(base) if isinstance(a, type)]
            action = next((a for a in args if issubclass(a, Action)), None)
            if action is not None:
                return action, next((a for a in args if issubclass(a, Observation)), None)
    try:
        step, reset = typing.get_type_hints(factory.step), typing.get_type_hints(factory.reset)
    except Exception:  # unresolvable annotations: treated as undeclared
        return None, None
    action, observation = step.get("action"), reset.get("return")
    return (action if isinstance(action, type) and issubclass(action, Action) else None,
            observation if isinstance(observation, type) and issubclass(observation, Observation) else None)


def _text_field(model: type, named: str | None, field_name: str, *, base: set[str]) -> str:
    """The model's text field: `named` (checked), or its one `str` field beyond OpenEnv's own."""
    fields = model.model_fields
    if named is not None:
        if named not in fields:
            raise ValueError(f"{field_name}={named!r}: {model.__name__} has no field {named!r}; its fields: "
                             f"{sorted(fields)}")
        return named
    text = [name for name, info in fields.items() if name not in base and info.annotation is str]
    if len(text) != 1:
        raise ValueError(f"{field_name}=None: {model.__name__} has {len(text)} str fields ({text}); name the one "
                         f"that carries the text with {field_name}")
    return text[0]
