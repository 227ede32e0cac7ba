"""Where an evaluation's samples come from: forge's generator service, through the rollout every app plays with
(rl.rollout: a prompt's completions, or a multi-turn task's episodes), or an OpenAI-compatible server over HTTP.

Each has `sample(problem, params) -> list[str | Scored | Exception]`: `params.n` samples of one problem, each a text,
an episode its environment scored, or the error that sample failed with. A call that raises failed all n samples.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx

from apps.eval.config import EndpointConfig
from apps.eval.evaluate import Scored
from rl.types import CompletionBatch, SamplingParams

if TYPE_CHECKING:  # the rollout's module imports Monarch; an endpoint's evaluation starts no process of forge's
    from rl.rollout import Rollout
    from rl.tasks.protocol import TaskProblem

_RETRIED_STATUS = {429, 500, 502, 503, 504}


class EnvironmentFailed(RuntimeError):
    """An episode's environment failed (its reset or a step raised or timed out): not the model's answer."""


class RolloutSampler:
    """One problem's `params.n` samples through `rollout` (rl.rollout.SingleTurn without a scorer, or MultiTurn): a
    single-turn one's completions as texts (the evaluation scores them with its reward); a multi-turn one's episodes,
    scored by their environments, each as the text after the first prompt (the model's turns and the environment's
    replies) decoded with `tokenizer`, or EnvironmentFailed. The service routes each problem's call to a replica,
    which batches concurrent calls with the same parameters into one engine call."""

    def __init__(self, rollout: Rollout, tokenizer: Any = None) -> None:
        self.rollout, self.tokenizer = rollout, tokenizer

    async def sample(self, problem: TaskProblem, params: SamplingParams) -> list[str | Scored | Exception]:
        (group,) = await self.rollout.play_groups([problem], params)
        if isinstance(group, Exception):
            raise group
        if isinstance(group.samples, CompletionBatch):
            return list(group.samples.texts)
        return [EnvironmentFailed(t.error or "the environment failed") if t.failed else
                Scored(self.tokenizer.decode(t.completion_ids), t.reward) for t in group.samples]


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
