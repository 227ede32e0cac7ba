"""Samples from an OpenAI-compatible server over HTTP; forge's own samplers (its generator service, a multi-turn task's
episodes) are the shared held-out evaluator's (apps/held_out/samplers.py).

`EndpointSampler.sample(problem, params)` gives `params.n` samples of one problem, each a text or the error that
sample failed with, as the shared samplers do; a call that raises failed all n samples.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import httpx

from apps.eval.config import EndpointConfig
from rl.types import SamplingParams

_RETRIED_STATUS = {429, 500, 502, 503, 504}


class EndpointError(RuntimeError):
    """The endpoint answered with an error, or not at all, after its retries."""


class EndpointSampler:
    """`/completions` (n samples per request, vLLM's `stop_token_ids`) or `/chat/completions` (the prompt as one user
    message, one sample per request), with `retries` further tries of a request that failed in transit or got a 5xx
    or 429 answer."""

    def __init__(self, config: EndpointConfig, retry_wait_s: float = 0.5) -> None:
        self.config, self.retry_wait_s = config, retry_wait_s
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.client = httpx.AsyncClient(base_url=config.base_url.rstrip("/") + "/", headers=headers,
                                        timeout=config.timeout_s)

    async def sample(self, problem: Any, params: SamplingParams) -> list[str | Exception]:
        prompt = problem.prompt
        if self.config.api == "completions":
            body = {"prompt": prompt, "n": params.n, **self._sampling(params, params.seed)}
            if params.stop_token_ids:
                body["stop_token_ids"] = list(params.stop_token_ids)
            choices = (await self._post("completions", body))["choices"]
            if len(choices) != params.n:
                raise EndpointError(f"asked for n={params.n} choices, got {len(choices)}")
            return [c["text"] for c in sorted(choices, key=lambda c: c.get("index", 0))]
        seeds = [None if params.seed is None else params.seed * params.n + j for j in range(params.n)]
        replies = await asyncio.gather(*(self._chat(prompt, params, seed) for seed in seeds), return_exceptions=True)
        return [r if isinstance(r, (str, Exception)) else EndpointError(repr(r)) for r in replies]

    async def close(self) -> None:
        await self.client.aclose()

    async def _chat(self, prompt: str, params: SamplingParams, seed: int | None) -> str:
        body = {"messages": [{"role": "user", "content": prompt}], "n": 1, **self._sampling(params, seed)}
        (choice,) = (await self._post("chat/completions", body))["choices"]
        return choice["message"]["content"] or ""

    def _sampling(self, params: SamplingParams, seed: int | None) -> dict:
        body = {"model": self.config.model, "max_tokens": params.max_tokens, "temperature": params.temperature,
                "top_p": params.top_p}
        return body if seed is None else {**body, "seed": seed}

    async def _post(self, path: str, body: dict) -> dict:
        for attempt in range(self.config.retries + 1):
            last = attempt == self.config.retries
            try:
                response = await self.client.post(path, json=body)
            except httpx.TransportError as e:  # could not connect, timed out, connection dropped
                if last:
                    raise EndpointError(f"POST {path}: {type(e).__name__}: {e}") from None
            else:
                if response.status_code < 400:
                    return response.json()
                if last or response.status_code not in _RETRIED_STATUS:
                    raise EndpointError(f"POST {path}: HTTP {response.status_code}: {response.text[:200]}")
            await asyncio.sleep(self.retry_wait_s * 2**attempt)
        raise AssertionError("unreachable")


def __getattr__(name: str) -> Any:
    """The samplers that moved to apps.held_out.samplers, importable from here for one release (GeneratorSampler and
    EpisodeSampler are gone: RolloutSampler over rl.rollout replaces both)."""
    from apps.held_out import samplers

    if name not in ("RolloutSampler", "EnvironmentFailed"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: use apps.held_out.samplers.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(samplers, name)
