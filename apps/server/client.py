"""Python client of forge's REST training service (`python -m apps.server`), Tinker-style.

    from apps.server import client as fc
    service = fc.ServiceClient("http://127.0.0.1:8000")          # or FORGE_BASE_URL / FORGE_API_KEY
    training = service.create_training_client()                   # a session: one trainer on the server
    sampler = service.create_sampling_client()
    out = sampler.sample("12+34=", fc.SamplingParams(max_tokens=4), num_samples=8).result()
    fwd = training.forward_backward(data, loss_fn="grpo", loss_fn_params={"clip_eps": 0.2})
    opt = training.optim_step(fc.AdamParams(learning_rate=3e-4))
    fwd.result(); opt.result()                                    # or `await fwd` in async code
    training.sync_inference_weights().result()                    # the sampler now serves the new weights

    lora = service.create_lora_training_client(rank=8)             # an adapter over the server's shared base
    ...                                                           # forward_backward / optim_step as above
    adapter_sampler = lora.save_weights_and_get_sampling_client("my-adapter-step-10")
    adapter_sampler.sample("12+34=", fc.SamplingParams(max_tokens=4)).result()   # samples with that adapter

Every method returns an `APIFuture` at once: `.result()` blocks, `await` works in async code. Calls of one
training client carry increasing `seq_id`s, so the server runs them in the order they were made whatever
order they arrive in. A large `forward_backward` / `forward` batch is sent in chunks and runs as one batch.
Results are `Result` objects: dicts whose keys are also attributes (`out.samples[0][0].text`).

No torch and no Monarch here (a test checks): plain HTTP with httpx, and `rl.sampling.SamplingParams`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, TypeVar

import httpx

from rl.sampling import SamplingParams

T = TypeVar("T")
BASE_URL_ENV = "FORGE_BASE_URL"
API_KEY_ENV = "FORGE_API_KEY"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


class ForgeAPIError(RuntimeError):
    """The server answered with an error status; `detail` is its explanation (field errors for 422)."""

    def __init__(self, status_code: int, detail: Any, method: str, path: str) -> None:
        super().__init__(f"{method} {path} -> {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class Result(dict):
    """A JSON object whose keys are also attributes, recursively."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def wrap(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return cls({k: cls.wrap(v) for k, v in value.items()})
        if isinstance(value, list):
            return [cls.wrap(v) for v in value]
        return value


class APIFuture(Generic[T]):
    """The pending result of one call: `.result(timeout)` blocks, `await future` suspends."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


# --- request data ------------------------------------------------------------------------------------
@dataclass
class ModelInput:
    input_ids: list[int]

    @classmethod
    def from_ints(cls, tokens: Iterable[int]) -> ModelInput:
        return cls([int(t) for t in tokens])


@dataclass
class Datum:
    """One training sequence: the full prompt + completion, and the loss inputs aligned to input_ids[1:]
    (`logprobs`, `advantages` per token or one number, optional `mask`, `ref_logprobs`, `reward`, and a sample's
    `kept_token_ids`, `temperature` and `policy_versions`: `from_sample` fills them)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_sample(cls, prompt_tokens: Sequence[int], sample: Mapping[str, Any], advantage: float, *,
                    reward: float = 0.0) -> Datum:
        """One sampled sequence (`samples[i][j]` of a sample result, `prompt_tokens[i]` its prompt) to train on:
        its sampling log-probs, `advantage` on its tokens, the temperature its log-probs are at, and, when it was
        sampled with top_k/top_p, the kept sets the trainer renormalises over (without either the trainer's
        log-probs would be of another distribution than the sample's); and the policy version that sampled each
        token."""
        context, n = len(prompt_tokens) - 1, len(sample["tokens"])
        inputs = {"logprobs": [0.0] * context + list(sample["logprobs"]),
                  "advantages": [0.0] * context + [float(advantage)] * n,
                  "mask": [0.0] * context + [1.0] * n, "reward": float(reward)}
        if sample.get("temperature") is not None:
            inputs["temperature"] = float(sample["temperature"])
        if sample.get("kept_token_ids") is not None:
            inputs["kept_token_ids"] = [[] for _ in range(context)] + [list(k) for k in sample["kept_token_ids"]]
        if sample.get("policy_versions") is not None:  # -1: no version (the prompt), as in rl.types.TrainBatch
            inputs["policy_versions"] = [-1] * context + [int(v) for v in sample["policy_versions"]]
        return cls(ModelInput.from_ints([*prompt_tokens, *sample["tokens"]]), inputs)

    def to_json(self) -> dict[str, Any]:
        return {"model_input": {"input_ids": list(self.model_input.input_ids)},
                "loss_fn_inputs": {k: _plain(v) for k, v in self.loss_fn_inputs.items()}}


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = None


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # tensors and arrays
        return value.tolist()
    return value


def _datum_json(datum: Datum | dict) -> dict[str, Any]:
    return datum.to_json() if isinstance(datum, Datum) else datum


def _sampling_body(params: SamplingParams | None, num_samples: int | None) -> dict[str, Any]:
    """`num_samples` (Tinker's name) and `sampling_params.n` say the same thing; the request carries one count."""
    params = params or SamplingParams()
    if num_samples is not None:
        params = replace(params, n=num_samples)  # validated again: num_samples=0 raises here, not on the server
    return {"num_samples": params.n, "sampling_params": asdict(params)}


# --- transport ---------------------------------------------------------------------------------------
class _Transport:
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float, max_workers: int,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = (base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="forge-client")

    def request(self, method: str, path: str, body: dict | None = None) -> Result:
        response = self.http.request(method, path, json=body)
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        if response.status_code >= 400:
            detail = payload.get("detail", payload) if isinstance(payload, dict) else payload
            raise ForgeAPIError(response.status_code, detail, method, path)
        return Result.wrap(payload)

    def submit(self, fn: Callable[[], T]) -> APIFuture[T]:
        return APIFuture(self.pool.submit(fn))

    def call(self, method: str, path: str, body: dict | None = None) -> APIFuture[Result]:
        return self.submit(lambda: self.request(method, path, body))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()


# --- clients -----------------------------------------------------------------------------------------
class ServiceClient:
    """Entry point: connects to the server and makes the other clients.

    `base_url` defaults to $FORGE_BASE_URL (else http://127.0.0.1:8000), `api_key` to $FORGE_API_KEY.
    `transport` is an optional httpx transport (tests use `httpx.MockTransport`).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 900.0,
                 max_workers: int = 32, transport: httpx.BaseTransport | None = None) -> None:
        self._transport = _Transport(base_url, api_key, timeout, max_workers, transport)

    @property
    def base_url(self) -> str:
        return self._transport.base_url

    def health(self) -> APIFuture[Result]:
        return self._transport.call("GET", "/health")

    def get_server_info(self) -> APIFuture[Result]:
        return self._transport.call("GET", "/api/v1/get_server_info")

    def create_training_client(self, base_model: str | None = None, *, idle_timeout_s: float | None = None,
                               metadata: dict | None = None) -> TrainingClient:
        """A new session from the served model's weights (blocks while its trainer starts)."""
        return self._create(base_model=base_model, idle_timeout_s=idle_timeout_s, metadata=metadata or {})

    def create_lora_training_client(self, base_model: str | None = None, rank: int = 16, *, alpha: float = 32.0,
                                    dropout: float = 0.0, target_modules: Sequence[str] | None = None,
                                    seed: int | None = None, idle_timeout_s: float | None = None,
                                    metadata: dict | None = None) -> TrainingClient:
        """A new LoRA session: an adapter of `rank` on `target_modules` (peft's names, e.g. "q_proj"; default:
        every linear layer of the blocks) over the server's one shared base model, with an optimizer of its own.
        Its adapter is seen by no other session; `save_weights_for_sampler` publishes it for sampling."""
        lora = {"rank": rank, "alpha": alpha, "dropout": dropout, "seed": seed,
                "target_modules": None if target_modules is None else list(target_modules)}
        return self._create(base_model=base_model, lora={k: v for k, v in lora.items() if v is not None},
                            idle_timeout_s=idle_timeout_s, metadata=metadata or {})

    def create_training_client_from_state(self, checkpoint_id: str, **kwargs: Any) -> TrainingClient:
        """A new session with the weights of a save_state checkpoint (a fresh optimizer); a LoRA session when the
        checkpoint is a LoRA session's."""
        return self._create(from_checkpoint=checkpoint_id, with_optimizer=False, **kwargs)

    def create_training_client_from_state_with_optimizer(self, checkpoint_id: str, **kwargs: Any) -> TrainingClient:
        """A new session with the weights and the optimizer state of a save_state checkpoint."""
        return self._create(from_checkpoint=checkpoint_id, with_optimizer=True, **kwargs)

    def training_client(self, session_id: str) -> TrainingClient:
        """A client for an existing session (continues its seq_id numbering)."""
        info = self._transport.request("GET", f"/api/v1/sessions/{session_id}")
        return TrainingClient(self._transport, info)

    def _create(self, **body: Any) -> TrainingClient:
        body = {k: v for k, v in body.items() if v is not None}
        return TrainingClient(self._transport, self._transport.request("POST", "/api/v1/create_session", body))

    def create_sampling_client(self, model_path: str | None = None) -> SamplingClient:
        """Sampling with the generators' current policy, or with `model_path`: a LoRA session's
        save_weights_for_sampler checkpoint (its name or path), i.e. the base with that adapter."""
        return SamplingClient(self._transport, model_path)

    def get_memory(self) -> APIFuture[Result]:
        """Resident bytes of the server's processes (controller, generators, trainers) by name."""
        return self._transport.call("GET", "/api/v1/memory")

    def create_rest_client(self) -> RestClient:
        return RestClient(self._transport)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TrainingClient:
    """One session on the server. Calls are numbered (seq_id) in the order they are made."""

    def __init__(self, transport: _Transport, info: Result, *, max_chunk_datums: int = 256) -> None:
        self._transport = transport
        self.info = info
        self.session_id: str = info["session_id"]
        self.max_chunk_datums = max_chunk_datums
        self._seq = itertools.count(int(info.get("next_seq_id", 0)))
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self.session_id

    def _next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def _sequenced(self, path: str, body: dict[str, Any]) -> APIFuture[Result]:
        body = {"model_id": self.session_id, "seq_id": self._next_seq(), **body}
        return self._transport.call("POST", path, body)

    def _chunked(self, path: str, data: Sequence[Datum | dict], body: dict[str, Any]) -> APIFuture[Result]:
        if not data:
            raise ValueError("data: give at least one Datum")
        seq_id = self._next_seq()
        rows = [_datum_json(d) for d in data]
        size = max(1, self.max_chunk_datums)
        chunks = [rows[i : i + size] for i in range(0, len(rows), size)]

        def send() -> Result:
            # Every chunk but the last is acknowledged at once (202); the last one runs the whole batch.
            result = None
            for index, chunk in enumerate(chunks):
                result = self._transport.request("POST", path, {
                    "model_id": self.session_id, "seq_id": seq_id, "data": chunk, "chunk_index": index,
                    "num_chunks": len(chunks), **body})
            return result

        return self._transport.submit(send)

    def forward_backward(self, data: Sequence[Datum | dict], loss_fn: str = "grpo",
                         loss_fn_params: dict[str, Any] | None = None) -> APIFuture[Result]:
        """Loss on the batch, gradients accumulated on the server (no optimizer step). Result: loss, metrics,
        loss_fn_outputs[i].logprobs (len(input_ids) - 1 each)."""
        return self._chunked("/api/v1/forward_backward", data,
                             {"loss_fn": loss_fn, "loss_fn_params": loss_fn_params or {}})

    def forward(self, data: Sequence[Datum | dict], loss_fn: str | None = None,
                loss_fn_params: dict[str, Any] | None = None) -> APIFuture[Result]:
        """Log-probs (and the loss's value when `loss_fn` is given) without gradients."""
        return self._chunked("/api/v1/forward", data, {"loss_fn": loss_fn, "loss_fn_params": loss_fn_params or {}})

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[Result]:
        """One AdamW step on the gradients accumulated since the last one."""
        return self._sequenced("/api/v1/optim_step", {"adam_params": asdict(adam_params or AdamParams())})

    def save_state(self, name: str, *, with_optimizer: bool = True) -> APIFuture[Result]:
        return self._sequenced("/api/v1/save_state", {"path": name, "with_optimizer": with_optimizer})

    def load_state(self, name: str, *, with_optimizer: bool = False) -> APIFuture[Result]:
        """Weights of a save_state checkpoint (and its optimizer state with `with_optimizer=True`)."""
        return self._sequenced("/api/v1/load_state", {"path": name, "with_optimizer": with_optimizer})

    def load_state_with_optimizer(self, name: str) -> APIFuture[Result]:
        return self.load_state(name, with_optimizer=True)

    def save_weights_for_sampler(self, name: str) -> APIFuture[Result]:
        """Export the weights as a Hugging Face checkpoint folder on the server (a LoRA session: its adapter as a
        peft folder, which `create_sampling_client(model_path=name)` samples with)."""
        return self._sequenced("/api/v1/save_weights_for_sampler", {"path": name})

    def save_weights_and_get_sampling_client(self, name: str) -> SamplingClient:
        """A LoRA session's adapter saved as `name`, and a sampling client with it (blocks until saved)."""
        saved = self.save_weights_for_sampler(name).result()
        return SamplingClient(self._transport, saved.checkpoint.checkpoint_id)

    def sync_inference_weights(self) -> APIFuture[Result]:
        """Publish the weights to the server's generators as a new policy version (sampling uses them next)."""
        return self._sequenced("/api/v1/sync_inference_weights", {})

    def heartbeat(self) -> APIFuture[Result]:
        return self._transport.call("POST", "/api/v1/session_heartbeat", {"model_id": self.session_id})

    def get_info(self) -> APIFuture[Result]:
        return self._transport.call("GET", f"/api/v1/sessions/{self.session_id}")

    def get_tokenizer(self) -> Any:
        """The served model's tokenizer (transformers), loaded from the path the server reports."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._transport.request("GET", "/api/v1/get_server_info")["model"])

    def unload(self) -> APIFuture[Result]:
        return self._transport.call("POST", "/api/v1/unload_model", {"model_id": self.session_id})


@dataclass
class SampleBatchResult:
    completed: dict[int, Result]  # prompt index -> its SampleResponse
    failed: dict[int, BaseException]
    cancelled: list[int]  # prompts not answered within the timeout


class SamplingClient:
    """Generation with the server's generators (the last synced weights; the base model before any sync), or
    with a LoRA adapter saved by `save_weights_for_sampler` (`model_path`)."""

    def __init__(self, transport: _Transport, model_path: str | None = None) -> None:
        self._transport = transport
        self.model_path = model_path

    def _body(self, body: dict[str, Any]) -> dict[str, Any]:
        return body if self.model_path is None else {"model_path": self.model_path, **body}

    def sample(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
               num_samples: int | None = None) -> APIFuture[Result]:
        """`num_samples` (default: `sampling_params.n`) completions of one prompt (text or token ids). Result:
        policy_version, prompt_tokens[0], samples[0][j] with tokens, logprobs, text, finish_reason, policy_versions,
        temperature (what its logprobs are at) and kept_token_ids (top_k/top_p): `Datum.from_sample` keeps them."""
        return self._transport.call("POST", "/api/v1/sample", self._body({
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            **_sampling_body(sampling_params, num_samples)}))

    def sample_many(self, prompts: Sequence[str | Sequence[int]], sampling_params: SamplingParams | None = None,
                    num_samples: int | None = None) -> APIFuture[Result]:
        """Several prompts in one request (one engine batch); samples[i] belongs to prompts[i]."""
        return self._transport.call("POST", "/api/v1/sample", self._body({
            "prompts": [p if isinstance(p, str) else list(p) for p in prompts],
            **_sampling_body(sampling_params, num_samples)}))

    def sample_batch(self, prompts: Sequence[str | Sequence[int]], sampling_params: SamplingParams | None = None,
                     num_samples: int | None = None, timeout: float | None = None) -> APIFuture[SampleBatchResult]:
        """One request per prompt, all in flight at once; prompts not answered within `timeout` seconds are
        reported as cancelled (stragglers), failures per prompt."""
        futures = [self.sample(p, sampling_params, num_samples) for p in prompts]

        def collect() -> SampleBatchResult:
            concurrent.futures.wait([f._future for f in futures], timeout=timeout)
            result = SampleBatchResult({}, {}, [])
            for index, future in enumerate(futures):
                if not future.done():
                    future._future.cancel()
                    result.cancelled.append(index)
                elif future.exception() is not None:
                    result.failed[index] = future.exception()
                else:
                    result.completed[index] = future.result()
            return result

        return APIFuture(threading_future(collect))


def threading_future(fn: Callable[[], T]) -> concurrent.futures.Future:
    """Run `fn` on its own thread (it waits on pool futures, so it must not hold a pool worker)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


class RestClient:
    """Checkpoint management."""

    def __init__(self, transport: _Transport) -> None:
        self._transport = transport

    def list_checkpoints(self) -> APIFuture[Result]:
        """Result: checkpoints[i] with checkpoint_id, checkpoint_type ("state" | "sampler"), path, step, ..."""
        return self._transport.call("GET", "/api/v1/checkpoints")

    def get_checkpoint(self, checkpoint_id: str) -> APIFuture[Result]:
        return self._transport.call("GET", f"/api/v1/checkpoints/{checkpoint_id}")

    get_weights_info = get_checkpoint

    def delete_checkpoint(self, checkpoint_id: str) -> APIFuture[Result]:
        return self._transport.call("DELETE", f"/api/v1/checkpoints/{checkpoint_id}")

    def list_sessions(self) -> APIFuture[Result]:
        return self._transport.call("GET", "/api/v1/sessions")


__all__ = ["APIFuture", "AdamParams", "Datum", "ForgeAPIError", "ModelInput", "RestClient", "Result",
           "SampleBatchResult", "SamplingClient", "SamplingParams", "ServiceClient", "TrainingClient"]
