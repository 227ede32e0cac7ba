"""The Generator actor: an engine behind endpoints, batching concurrent requests, following the trainer's
published policy versions.

Batching: requests that arrive while the engine is busy (several callers, a rollout's calls, an evaluation beside
them) wait in one queue and go to the engine together, up to `max_batch_size` sequences (`_batch_loop`). It is the
one place forge merges requests: where the cost is, an engine call per batch rather than per request. Callers send
what they have as one call (a GRPO rollout, all the groups the replay buffer granted at once) and need no merging of
their own.

Weight updates: a background task watches the weight store; when a newer version appears it fetches it
(while generation goes on) and stages it in the engine, which swaps it in at the next safe point (the hf
engine between decode steps, vLLM between batches). Every generated token records the version that made
it. A replica that starts late (or is restarted after a crash) loads the newest version before serving.
A request may name a `min_policy_version`: its batch does not start before that version is fetched, which
is how the GRPO app bounds the age of what it generates without waiting on the background poll.

Kept completions: a GRPO rollout's completions stay here (`generate_kept` answers with their texts and a key) until the
replay buffer takes the ones the controller selected (`take_kept`), so their tokens go generator -> buffer without
passing through the controller. A kept batch nobody takes (its rollout failed or was cancelled in between) is evicted,
oldest first, once the replica keeps more than the caller's `keep_at_most`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from actors.engines import start_engine
from actors.generator_config import GeneratorConfig  # noqa: F401  (re-exported: `from actors.generator import GeneratorConfig`)
from forge.actor import ForgeActor, endpoint
from forge.metrics import record_metric
from rl.types import Completion, CompletionBatch, EpisodeBatch, KeptCompletions, SamplingParams
from forge.weights.store import RELAY_WAIT_S, WeightStore, WeightVersionError

_DELETED_RETRIES = 3  # versions deleted between the store's notice and the fetch, before a request fails

logger = logging.getLogger(__name__)


class NotKeptError(LookupError):
    """`take_kept` named a batch this replica does not keep (taken already, evicted, or never kept)."""


@dataclass
class _Request:
    prompt: str | list[int]
    params: SamplingParams
    min_policy_version: int
    future: asyncio.Future


class Generator(ForgeActor):
    def __init__(self, config: GeneratorConfig | dict | None = None, **overrides) -> None:
        if isinstance(config, dict) or config is None:
            config = GeneratorConfig(**{**(config or {}), **overrides})
        self.config = config
        self.engine = None
        self._queue: asyncio.Queue[_Request] | None = None
        self._tasks: list[asyncio.Task] = []
        self.swaps = 0
        self._fetched_version = -1  # newest version loaded or staged in the engine
        self._fetch_lock = asyncio.Lock()  # one fetch at a time: the poll and a request's minimum share it
        self._running: set[asyncio.Task] = set()  # engine calls in flight (several only for vllm)
        # Kept batches by key, oldest first. Keys count up: every rank of a multi-process replica, called alike,
        # keeps its batch under the key rank 0 answers with.
        self._kept: OrderedDict[int, CompletionBatch] = OrderedDict()
        self._next_key = 0

    @endpoint
    async def setup(self) -> None:
        self.engine = await start_engine(self.config)
        self.store = WeightStore(self.config.weight_namespace)
        latest = await self.store.latest_version()
        if latest is not None:  # a (re)started replica serves the current policy from its first token
            await self._load(latest, stage=False)
        self._queue = asyncio.Queue()
        self._stopping = False
        self._reported: set[str] = set()
        self._tasks = [asyncio.ensure_future(self._follow_weights()), asyncio.ensure_future(self._batch_loop())]

    # --- endpoints ----------------------------------------------------------------------------------
    @endpoint
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       min_policy_version: int = 0) -> list[Completion]:
        """`params.n` completions of one prompt; concurrent calls are batched into one engine call.

        No token comes from a policy older than `min_policy_version` (a published version): if the replica
        has not fetched it yet, it does so before the batch starts."""
        return await self._submit(prompt, params or SamplingParams(), min_policy_version)

    @endpoint
    async def generate_batch(self, prompts: list, params: SamplingParams | None = None,
                             min_policy_version: int = 0) -> CompletionBatch:
        """Several prompts in one call (one engine batch); their completions travel packed (`batch[i]` is prompt i's
        list, as from `generate`)."""
        return await self._generate_batch(prompts, params or SamplingParams(), min_policy_version)

    @endpoint
    async def generate_kept(self, prompts: list, params: SamplingParams | None = None, min_policy_version: int = 0,
                            keep_at_most: int = 64) -> KeptCompletions:
        """`generate_batch`, but the completions stay here under the key answered with their texts, for the replay
        buffer to take (`take_kept`): the caller scores and selects them without receiving their tokens. Past
        `keep_at_most` batches kept, the oldest are evicted (a rollout that failed between the two calls must not
        hold memory for ever); the caller sizes it above the batches it can have in flight on a replica."""
        if not isinstance(keep_at_most, int) or isinstance(keep_at_most, bool) or keep_at_most < 1:
            raise ValueError(f"Generator.generate_kept: keep_at_most={keep_at_most!r}: must be an int >= 1")
        batch = await self._generate_batch(prompts, params or SamplingParams(), min_policy_version)
        key, self._next_key = self._next_key, self._next_key + 1
        self._kept[key] = batch
        while len(self._kept) > keep_at_most:
            self._kept.popitem(last=False)
        record_metric("generator/kept_batches", len(self._kept), "max")
        return KeptCompletions(key, batch.samples.tolist(), list(batch.texts))

    @endpoint
    async def take_kept(self, key: int, rows: list[int]) -> EpisodeBatch | None:
        """Forget kept batch `key` and answer its completions at `rows` (completion indices, prompt by prompt) as
        episodes, their prompts included; the taker fills in their ids, rewards and advantages. No rows: only
        forget it (None)."""
        batch = self._kept.pop(key, None)
        if batch is None:
            state = "never kept" if key >= self._next_key else "already taken, or evicted (only the newest are kept)"
            raise NotKeptError(f"Generator.take_kept: key={key} is not kept on this replica: {state}")
        if not rows:
            return None
        count = len(batch.lengths)
        bad = [r for r in rows if not 0 <= r < count]
        if bad:
            raise ValueError(f"Generator.take_kept: rows={bad[:5]} out of range: batch {key} has {count} completions")
        zeros = [0] * count
        return EpisodeBatch.from_completions(batch, episode_ids=zeros, group_ids=zeros, rewards=zeros,
                                             advantages=zeros).select(rows)

    @endpoint
    async def score(self, prompt_ids: list[int], token_ids: list[int], policy_version: int) -> tuple[list[float], int]:
        """Teacher-forced log-probs of `token_ids` after `prompt_ids` (temperature 1, full vocabulary) with exactly
        `policy_version` loaded, and the version scored: the weight-sync canary's generator side."""
        await self._ensure_version(policy_version)  # a version already prefetched (staged) is not fetched again
        return await asyncio.to_thread(self.engine.score, prompt_ids, token_ids)  # applies staged weights first

    @endpoint
    async def policy_version(self) -> int:
        return self.engine.policy_version

    @endpoint
    async def update_weights(self, version: int) -> int:
        """Fetch `version` and swap it in now (between batches), once the store names it readable on this host (the
        one path: `WeightStore.wait_for_version`, bounded by RELAY_WAIT_S); returns the engine's version."""
        await self.store.wait_for_version(version, RELAY_WAIT_S, self.config.weight_poll_s)
        await self._load(version, stage=False)
        return self.engine.policy_version

    @endpoint
    async def teardown(self) -> None:
        """Stop following weights and serving. A store request in flight is allowed to finish (cancelling it
        would leave the store replying to a port that no longer exists, a supervision failure in Monarch)."""
        self._stopping = True
        follow, batches = self._tasks
        batches.cancel()  # waits on the local queue only
        try:
            await asyncio.wait_for(asyncio.shield(follow), timeout=10)
        except asyncio.TimeoutError:
            follow.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.config.engine == "vllm":
            # vLLM's engine core is a process of its own: stopped here, or it outlives this actor's process.
            await asyncio.to_thread(self.engine.close)

    @endpoint
    async def stats(self) -> dict:
        return {"policy_version": self.engine.policy_version, "swaps": self.swaps}

    # --- internals ----------------------------------------------------------------------------------
    async def _generate_batch(self, prompts: list, params: SamplingParams, min_policy_version: int) -> CompletionBatch:
        groups = await asyncio.gather(*(self._submit(p, params, min_policy_version) for p in prompts))
        return CompletionBatch.pack(groups)

    async def _submit(self, prompt: str | list[int], params: SamplingParams, min_policy_version: int = 0) -> list[Completion]:
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(prompt, params, min_policy_version, future))
        return await future

    async def _load(self, version: int, *, stage: bool) -> None:
        async with self._fetch_lock:
            if stage and version <= self._fetched_version:
                return  # fetched while this call waited for the lock
            start = time.perf_counter()
            weights = await self.store.fetch(version)
            if stage:
                await asyncio.to_thread(self.engine.stage_weights, weights, version)
            else:
                await asyncio.to_thread(self.engine.load_weights, weights, version)
            self._fetched_version = max(self._fetched_version, version)
            self.swaps += 1
            record_metric("generator/weight_swaps", 1, "sum")
            record_metric("generator/weight_fetch_s", time.perf_counter() - start)

    @property
    def _held_version(self) -> int:
        """The newest version in the engine, applied or staged (staged weights apply when a batch starts)."""
        return max(self._fetched_version, self.engine.policy_version)

    async def _stage_newest(self) -> None:
        """Stage the store's newest version readable on this host if it is newer than what this replica has fetched."""
        latest = await self.store.latest_version()
        if latest is not None and latest > self._held_version:
            await self._load(latest, stage=True)

    async def _ensure_version(self, version: int, wait_s: float | None = None) -> None:
        """Return once `version` or newer is loaded or staged (staged weights apply when the batch starts). The
        store names a version only once its bytes can be read on this host (`wait_for_version`, bounded by
        RELAY_WAIT_S): nothing is fetched before that. A version deleted between the notice and the fetch means a
        newer one is readable: that one is fetched instead (a few times at most)."""
        if self._held_version >= version:
            return
        waited = time.perf_counter()
        for attempt in range(_DELETED_RETRIES):
            latest = await self.store.wait_for_version(version, RELAY_WAIT_S if wait_s is None else wait_s,
                                                       self.config.weight_poll_s)
            try:
                await self._load(latest, stage=True)
                break
            except WeightVersionError:
                if attempt + 1 == _DELETED_RETRIES:
                    raise
        record_metric("generator/version_wait_s", time.perf_counter() - waited, "sum")

    async def _follow_weights(self) -> None:
        while not self._stopping:
            try:
                await self._stage_newest()
            except WeightVersionError:
                pass  # deleted between listing and fetching: a newer one exists; try again
            except Exception as error:
                # Counted every time, printed once per kind: a persistent failure must not flood the logs
                # (a blocked stderr pipe stalls the whole process).
                record_metric("generator/weight_update_failures", 1, "sum")
                kind = f"{type(error).__name__}: {str(error)[:200]}"
                if kind not in self._reported:
                    self._reported.add(kind)
                    logger.exception("generator: weight update failed (shown once; counted in "
                                     "generator/weight_update_failures)")
                await asyncio.sleep(min(1.0, 10 * self.config.weight_poll_s))
            await asyncio.sleep(self.config.weight_poll_s)

    async def _batch_loop(self) -> None:
        while True:
            first = await self._queue.get()
            if self.config.batch_wait_s:
                await asyncio.sleep(self.config.batch_wait_s)
            batch = [first]
            while not self._queue.empty() and sum(r.params.n for r in batch) < self.config.max_batch_size:
                batch.append(self._queue.get_nowait())
            # Requests with the same sampling parameters share one engine call; a seeded request has one of its own,
            # so that its samples depend on its seed and prompt only, not on who else asked at the same moment (the
            # engines seed a call's prompts in turn: gateway clients sending one seed got different answers).
            groups: dict[object, list[_Request]] = {}
            for request in batch:
                key = repr(request.params) if request.params.seed is None else id(request)
                groups.setdefault(key, []).append(request)
            for requests in groups.values():
                try:
                    await self._ensure_version(max(r.min_policy_version for r in requests))
                except Exception as e:
                    for request in requests:
                        _resolve(request.future, error=e)
                    continue
                if self.config.engine == "vllm":
                    # vLLM batches continuously: a batch joins the engine at once, not after the one before it.
                    task = asyncio.ensure_future(self._run(requests))
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)
                else:
                    await self._run(requests)

    async def _run(self, requests: list[_Request]) -> None:
        start = time.perf_counter()
        try:
            outputs = await asyncio.to_thread(self.engine.generate, [r.prompt for r in requests], requests[0].params)
        except ValueError:
            # One bad prompt must not fail its batch-mates: run each alone so only it gets the error.
            for request in requests:
                try:
                    (out,) = await asyncio.to_thread(self.engine.generate, [request.prompt], request.params)
                    _resolve(request.future, out)
                except Exception as e:
                    _resolve(request.future, error=e)
            return
        except Exception as e:
            for request in requests:
                _resolve(request.future, error=e)
            return
        tokens = sum(len(c.token_ids) for out in outputs for c in out)
        elapsed = time.perf_counter() - start
        record_metric("generator/tokens_per_s", tokens / max(elapsed, 1e-9))
        record_metric("generator/batch_sequences", sum(len(out) for out in outputs))
        record_metric("generator/busy_s", elapsed, "sum")
        for request, out in zip(requests, outputs):
            _resolve(request.future, out)


def _resolve(future: asyncio.Future, result: object = None, error: BaseException | None = None) -> None:
    """A caller that went away (cancelled) leaves a done future behind: skip it."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
