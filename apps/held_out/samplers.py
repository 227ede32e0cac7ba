"""Where samples come from in forge: its generator service, a prompt's completions or a multi-turn task's episodes
(apps.eval adds an OpenAI-compatible server over HTTP: apps/eval/samplers.py).

Each has `sample(problem, params) -> list[str | Scored | Exception]`: `params.n` samples of one problem, each a text,
an episode its environment scored, or the error that sample failed with. A call that raises failed all n samples.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from apps.held_out.evaluate import Scored
from rl.types import SamplingParams

if TYPE_CHECKING:  # the player's module imports Monarch; an endpoint's evaluation starts no process of forge's
    from rl.environments.player import EpisodePlayer


class GeneratorSampler:
    """One `generate` request per prompt: the service routes it to a replica, which batches concurrent requests with
    the same parameters into one engine call (an unseeded evaluation's prompts; a seeded prompt runs alone)."""

    def __init__(self, generators: Any) -> None:
        self.generators = generators

    async def sample(self, problem: Any, params: SamplingParams) -> list[str | Exception]:
        return [c.text for c in await self.generators.generate.route(problem.prompt, params)]


class EnvironmentFailed(RuntimeError):
    """An episode's environment failed (its reset or a step raised or timed out): not the model's answer."""


class EpisodeSampler:
    """A multi-turn task's samples: `params.n` episodes of the problem, played together through the generator service
    (rl.environments.player) and scored by their environments. A sample's text is everything after the first prompt,
    the model's turns and the environment's replies, decoded. Seeded, episode j of prompt seed s is played with seed
    s * n + j: one seed for the n copies of one prompt would play n equal episodes."""

    def __init__(self, player: EpisodePlayer, tokenizer: Any) -> None:
        self.player, self.tokenizer = player, tokenizer

    async def sample(self, problem: Any, params: SamplingParams) -> list[Scored | Exception]:
        one = replace(params, n=1)
        if params.seed is None:
            played = await self.player.play([problem] * params.n, one)
        else:
            played = [t for j in range(params.n)
                      for t in await self.player.play([problem], replace(one, seed=params.seed * params.n + j))]
        return [EnvironmentFailed(t.error or "the environment failed") if t.failed else
                Scored(self.tokenizer.decode(t.completion_ids), t.reward) for t in played]
