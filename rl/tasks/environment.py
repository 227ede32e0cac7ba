"""A user's environment class, written to forge's own protocol, as a multi-turn task (`task.source: environment`).

    task:
      source: environment
      name: my_envs:LookupEnv          # a class with `async reset(problem)` and `async step(action) -> StepResult`
      options: {hidden_max: 9}         # its constructor's keyword arguments
      held_out: 200                    # evaluation episodes: problem.seed in [0, held_out)

One object of the class plays one episode (rl.environments.protocol): `reset(problem)` gets a `SeededProblem`,
whose `seed` the environment draws its episode from, and returns the first prompt; `step(action)` gets each model
turn's text. A class attribute `stop_texts` (e.g. `("?",)`) lists texts that end a model turn (each must be one token
of the model's tokenizer; the turn includes it); without it a turn ends at EOS, which also ends the episode, or after
`rollout.max_tokens` tokens. Everything is checked when the config is read: the module imports, the class has the
protocol's coroutines, `task.options` fit its constructor.

Training episodes use seeds from [held_out, 2**31), so train and evaluation never share a seed (as OpenEnv tasks).
"""

from __future__ import annotations

import inspect
import random
from typing import Any, Callable, NamedTuple

from rl.environments.protocol import Environment

MAX_SEED = 2**31 - 1


class SeededProblem(NamedTuple):
    """One episode of an environment task: the environment draws it from `seed`. Such environments make their own first
    prompt, so `prompt` is a label (failure messages print it) and, with `answer`, the fixed text the weight canary
    scores (apps.grpo's canary.every)."""

    seed: int
    prompt: str
    answer: str


class SeededTask:
    """The task of an environment that draws its episodes from a seed: held-out seeds [0, held_out), training seeds
    above them. Subclasses give `environment()`; the environment scores the episodes."""

    stop_token_ids: tuple[int, ...] = ()  # a model turn ends at EOS (which also ends the episode) or max_tokens
    source = ""  # the task.source value, for messages

    def __init__(self, name: str, *, held_out: int) -> None:
        if not 1 <= held_out < MAX_SEED:
            raise ValueError(f"task.held_out={held_out}: must be in [1, {MAX_SEED})")
        self.name = name
        self._held_out = [self._problem(seed) for seed in range(held_out)]

    def _problem(self, seed: int) -> SeededProblem:
        return SeededProblem(seed=seed, prompt=f"{self.name} reset(seed={seed})", answer=f" {seed}")

    def sample_prompts(self, n: int, rng: random.Random) -> list[SeededProblem]:
        return [self._problem(rng.randint(len(self._held_out), MAX_SEED)) for _ in range(n)]

    def held_out(self) -> list[SeededProblem]:
        return list(self._held_out)

    def transcript(self, problem: SeededProblem) -> list[tuple[str, bool]]:
        """What a multi-turn warm start trains on (apps.warm_start.multiturn): such an environment has none."""
        raise ValueError(f"warm_start.enabled=true: task.source={self.source!r} ({self.name}) has no reference "
                         "episodes to warm start from; set warm_start.enabled: false")

    def reward(self, completion_text: str, answer: str) -> float:
        raise TypeError(f"task.source={self.source!r} ({self.name}): its environment scores the episodes; there is no "
                        "completion reward")


class EnvironmentTask(SeededTask):
    """Episodes of `factory(**options)`, a class implementing forge's Environment protocol."""

    source = "environment"

    def __init__(self, factory: type, *, options: dict[str, Any], held_out: int,
                 stop_token_ids: tuple[int, ...] = ()) -> None:
        super().__init__(factory.__name__, held_out=held_out)
        self.factory, self.options, self.stop_token_ids = factory, dict(options), tuple(stop_token_ids)

    def environment(self) -> Environment:
        """A fresh environment for one episode. Bound to a picklable task (a class by reference, plain options), so
        `environment.isolated` can ship it to the environment host."""
        return self.factory(**self.options)


def resolve_environment(reference: str, options: dict[str, Any], *, prefix: str = "task.") -> type:
    """'package.module:Class' -> the class, checked against forge's Environment protocol and `options` against its
    constructor; every error names the config field (`prefix`name, `prefix`options) and value."""
    from forge.config import load_callable

    field = f"{prefix}name"
    factory = load_callable(reference, field=field)
    if not isinstance(factory, type):
        raise ValueError(f"{field}={reference!r}: must name a class implementing forge's Environment protocol "
                         f"(rl/environments/protocol.py; got {factory!r})")
    for method, parameter in (("reset", "problem"), ("step", "action")):
        _check_coroutine(factory, method, parameter, f"{field}={reference!r}")
    if hasattr(factory, "close") and not inspect.iscoroutinefunction(factory.close):
        raise ValueError(f"{field}={reference!r}: {factory.__name__}.close must be `async def close(self)` (awaited "
                         "once when the episode ends)")
    stop_texts(factory, f"{field}={reference!r}")
    check_options(factory, options, field=f"{prefix}options")
    return factory


def _check_coroutine(factory: type, method: str, parameter: str, where: str) -> None:
    """`factory.method` is a coroutine function that takes one argument after self."""
    fn = getattr(factory, method, None)
    wanted = f"`async def {method}(self, {parameter})`"
    if fn is None:
        raise ValueError(f"{where}: {factory.__name__} has no {method}; forge's Environment protocol needs {wanted}")
    if not inspect.iscoroutinefunction(fn):
        hint = ("; an OpenEnv environment (synchronous reset/step) is named with task.source: openenv"
                if _is_openenv(factory) else "")
        raise ValueError(f"{where}: {factory.__name__}.{method} must be {wanted} (a coroutine){hint}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        raise ValueError(f"{where}: {factory.__name__}.{method} must take one argument after self, as {wanted} ({e})"
                         ) from None


def _is_openenv(factory: type) -> bool:
    return any(klass.__module__.startswith("openenv.") for klass in factory.__mro__)


def stop_texts(factory: type, where: str) -> tuple[str, ...]:
    """The class's `stop_texts`: texts that end a model turn (checked: a tuple or list of non-empty str)."""
    texts = getattr(factory, "stop_texts", ())
    if not isinstance(texts, (tuple, list)) or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{where}: {factory.__name__}.stop_texts={texts!r}: must be a tuple of non-empty strings "
                         "(texts that end a model turn)")
    return tuple(texts)


def stop_token_ids(factory: type, tokenizer: Any, where: str) -> tuple[int, ...]:
    """The token of each of the class's `stop_texts` in the model's tokenizer: each must be exactly one token (the
    generator stops on token ids)."""
    ids = []
    for text in stop_texts(factory, where):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"{where}: {factory.__name__}.stop_texts has {text!r}, which the model's tokenizer "
                             f"encodes as {len(encoded)} tokens {encoded}; a stop text must be one token")
        ids.append(encoded[0])
    return tuple(ids)


def check_options(factory: Callable[..., Any], options: dict[str, Any], *, field: str,
                  set_by_forge: tuple[str, ...] = ()) -> None:
    """`options` as keyword arguments of `factory`'s constructor: each is a parameter it takes (anything, with
    **kwargs) and none it requires is missing (`set_by_forge`: passed by forge, neither accepted nor missing). Errors
    name the option, the class and the names it accepts."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or an extension type: nothing to check against
        return
    name = getattr(factory, "__name__", repr(factory))
    parameters = signature.parameters.values()
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in set_by_forge]
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        unknown = [key for key in options if key not in named]
        if unknown:
            accepted = ", ".join(named) if named else "none"
            raise ValueError(f"{field}: {name} takes no option {', '.join(map(repr, unknown))}; its constructor "
                             f"accepts: {accepted}")
    missing = [name for name in named if signature.parameters[name].default is inspect.Parameter.empty
               and name not in options]
    if missing:
        raise ValueError(f"{field}: {name}'s constructor requires {', '.join(map(repr, missing))}; add "
                         f"{'it' if len(missing) == 1 else 'them'} to {field}")
