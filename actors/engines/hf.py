"""The transformers engine: batched sampling with a KV cache, on CPU or GPU.

It runs anywhere and is the reference for log-prob parity: behaviour log-probs are the log-probs of the
distribution the token was drawn from, exactly what the trainer recomputes with a teacher-forced forward pass:
`log_softmax(raw_logits / temperature)` (temperature 0 = greedy, scored at temperature 1), and with top-k /
top-p the same renormalised over the tokens the step kept. Those kept tokens are recorded per generated token
(`Completion.kept_token_ids`) so the trainer renormalises over exactly them (`actors.logprobs.token_logprobs`).

Weight updates. `load_weights` swaps at once (waiting for a running `generate` to finish: "between
batches"). `stage_weights` validates now and swaps at the next decode-step boundary ("between decode
steps"): the sequences in flight continue with the new weights on top of a KV cache that the old weights
wrote. That mix is deliberate (PipelineRL-style in-flight updates) and visible: every token records the
policy version whose weights produced it (`Completion.policy_versions`), so the trainer can reject or
importance-correct exactly. No single forward pass ever mixes two versions' weights.

LoRA versions. A LoRA trainer publishes only its adapter (`actors/engines/lora_weights.py`). The engine keeps
the base weights of the adapted layers the first time one arrives and sets each to `base + B @ A` at the swap,
a new tensor computed from the kept base: version after version, the weights are always one merge away from
the base, never an accumulation of merges. A full-weight version replaces the base.

KV reuse across turns. A multi-turn episode's next prompt is its previous prompt, the model's tokens and the
observation (by id), and its turns reach the same replica; the engine keeps the past key values of the sequences it
generated in its prefix cache (`actors/engines/prefix_cache.py`, at most `kv_reuse_tokens` tokens, least recently
used out), and a prompt that starts with one of them prefills only its new suffix. In the batch, row r's kept KV
sits right-aligned in the first P columns of the cache (P: the longest reused prefix), its new tokens right-aligned
after them; the attention mask covers exactly the kept and the new tokens, and positions count them (so the gap
between them changes nothing). Tokens and log-probs equal those without reuse within float rounding (the same
arithmetic, in other batch shapes). Every weight change (load_weights, a staged swap, a LoRA version) drops the kept
KV, and a batch during which the weights changed keeps none. Each prompt records `generator/prefix_cached_tokens`
(sum) and `generator/prefix_cached_share`, as the vLLM engine does, and `generator/prefill_s` (the batch's first
forward pass, cache assembly included).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from actors.engines import lora_weights
from actors.engines.prefix_cache import PrefixCache
from actors.engines.weights import check_state_dict, hf_weight_specs
from forge.metrics import record_metric
from rl.types import Completion, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tokens of kept KV (KV reuse across turns); a token costs layers x 2 x kv_heads x head_dim x dtype bytes: 1 KiB on
# the tiny model, 25 KiB on the 50m one, 112 KiB on Qwen3-1.7B in bfloat16 (64 conversations of 1000 tokens fit).
KV_REUSE_TOKENS = 65536


class HFEngine:
    """Generation with a Hugging Face causal LM (a local checkpoint directory or a hub id)."""

    def __init__(self, model: str | Path, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 kv_reuse_tokens: int = KV_REUSE_TOKENS) -> None:
        """`kv_reuse_tokens`: how many tokens of past key values to keep for later prompts that continue a
        sequence (KV reuse across turns); 0 keeps none."""
        if dtype not in DTYPES:
            raise ValueError(f"HFEngine.dtype={dtype!r}: allowed {list(DTYPES)}")
        if kv_reuse_tokens < 0:
            raise ValueError(f"HFEngine.kv_reuse_tokens={kv_reuse_tokens}: must be >= 0 (0 = no KV reuse)")
        tokenizer = AutoTokenizer.from_pretrained(model)
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype]).to(torch.device(device))
        self._attach(loaded, tokenizer, seed=seed, kv_reuse_tokens=kv_reuse_tokens)
        self.model.requires_grad_(False)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, *, seed: int = 0) -> HFEngine:
        """An engine over a model already in memory (e.g. one being trained): no copy is made. It keeps no KV
        between calls: the model may be trained in place, which no weight swap of the engine's announces."""
        engine = cls.__new__(cls)
        engine._attach(model, tokenizer, seed=seed, kv_reuse_tokens=0)
        return engine

    def _attach(self, model: torch.nn.Module, tokenizer, *, seed: int, kv_reuse_tokens: int) -> None:
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.max_model_len: int = self.model.config.max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(set(eos))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else self.eos_token_ids[0]
        self._generator = torch.Generator(self.device).manual_seed(seed)

        self._targets = self.model.state_dict(keep_vars=True)
        self._lora_base: dict[str, torch.Tensor] = {}  # adapted layers' base weights, kept from the first adapter
        _, self._required = hf_weight_specs(self.model)  # tied weights: either of their names loads them

        self._version = 0
        self._weights_lock = threading.Lock()  # held while the weights are used (generate) or written
        self._staged_lock = threading.Lock()  # guards _staged
        self._staged: tuple[dict[str, torch.Tensor], int] | None = None
        # used under the weights lock only
        self._prefix_cache = PrefixCache(kv_reuse_tokens) if kv_reuse_tokens else None
        self._weight_changes = 0  # a batch keeps its KV only if no weight change came during it

    @property
    def policy_version(self) -> int:
        return self._version

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(t.shape), t.dtype) for name, t in self._targets.items()}

    # ----- weights -----

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy in HF-named weights now; refuses a mismatching state dict and keeps the old weights."""
        self._validate(state_dict, version, "load_weights")
        with self._weights_lock:
            self._copy_in(state_dict, version)

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Validate now; apply at the next decode-step boundary, or at once if no `generate` is running.

        Thread-safe. A later staged update replaces one not yet applied.
        """
        self._validate(state_dict, version, "stage_weights")
        with self._staged_lock:
            self._staged = (state_dict, version)
        if self._weights_lock.acquire(blocking=False):
            try:
                self._apply_staged()
            finally:
                self._weights_lock.release()

    def _validate(self, state_dict: dict[str, torch.Tensor], version: int, caller: str) -> None:
        if lora_weights.is_adapter(state_dict):
            lora_weights.check_adapter(state_dict, version, self.parameter_specs(), f"HFEngine.{caller}",
                                       current_version=self._version)
            return
        check_state_dict(state_dict, version, self.parameter_specs(), self._required, f"HFEngine.{caller}",
                         current_version=self._version)

    def _copy_in(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Caller holds the weights lock. Tensors that already have the parameter's dtype, device and layout
        are taken over by pointer (the engine owns them from now on): the swap then costs microseconds, not
        a copy of the whole model under the lock. Others are copied. Kept KV is dropped: new weights, new KV."""
        self._weight_changes += 1
        if self._prefix_cache is not None:
            self._prefix_cache.clear()
        if lora_weights.is_adapter(state_dict):
            self._merge_adapter(state_dict, version)
            return
        self._lora_base.clear()  # full weights: the new base
        with torch.no_grad():
            for name, tensor in state_dict.items():
                target = self._targets[name]
                if tensor.dtype == target.dtype and tensor.device == target.device and tensor.is_contiguous():
                    target.data = tensor
                else:
                    target.copy_(tensor)
        self._version = version

    def _merge_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> None:
        """Caller holds the weights lock. Every adapted layer becomes base + B @ A (a pointer swap to a new
        tensor); a layer adapted before but not in this version returns to its base."""
        pairs = lora_weights.adapter_pairs(adapter)
        with torch.no_grad():
            for name in pairs.keys() - self._lora_base.keys():
                self._lora_base[name] = self._targets[name].detach().clone()
            for name, base in self._lora_base.items():
                self._targets[name].data = lora_weights.merged(base, *pairs[name]) if name in pairs else base.clone()
        self._version = version

    def _apply_staged(self) -> None:
        """Caller holds the weights lock."""
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._copy_in(*staged)

    # ----- generation -----

    def generate(self, prompts: list[list[int]] | list[str], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt; all prompts x n run as one left-padded batch."""
        if params.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={params.top_k}: must be >= 0 (0 = no top-k)")
        prompt_ids = [self._encode(i, prompt) for i, prompt in enumerate(prompts)]
        if not prompt_ids:
            return []
        with self._weights_lock, torch.no_grad():
            completions = self._generate(prompt_ids, params)
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]

    def score(self, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0) -> tuple[list[float], int]:
        if not temperature > 0:
            raise ValueError(f"HFEngine.score: temperature={temperature}: must be > 0")
        ids = self._encode(0, list(prompt_ids) + list(token_ids))
        with self._weights_lock, torch.no_grad():
            self._apply_staged()
            logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0, len(prompt_ids) - 1 : -1]
            logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
            targets = torch.tensor(token_ids, device=self.device)[:, None]
            return logprobs.gather(-1, targets)[:, 0].tolist(), self._version

    def _encode(self, index: int, prompt: list[int] | str) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError(f"HFEngine.generate: prompt {index} is empty; a prompt needs at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"HFEngine.generate: prompt {index} has {len(ids)} tokens; the model window "
                f"(max_position_embeddings) is {self.max_model_len}, so at most {self.max_model_len - 1} "
                "prompt tokens leave room to generate"
            )
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"HFEngine.generate: prompt {index} has token ids outside the vocabulary [0, {vocab})")
        return ids

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Every prompt `params.n` times, as one batch; its completions, prompt by prompt."""
        start = time.perf_counter()
        self._apply_staged()  # the start of a batch is a step boundary too; before the lookup: a swap drops the KV
        weight_changes = self._weight_changes
        matches = [self._prefix_cache.match(ids) if self._prefix_cache is not None else (None, 0)
                   for ids in prompts]
        if len({len(ids) for ids in prompts}) == 1 and all(reused for _, reused in matches):
            # Equal lengths, all reused: the shortest reuse for every row leaves the batch without padding, so
            # transformers drops the attention mask (SDPA's GQA and causal kernel, no per-step copy of the cache).
            shortest = min(reused for _, reused in matches)
            matches = [(kept, shortest) for kept, _ in matches]
        for ids, (_, reused) in zip(prompts, matches):
            record_metric("generator/prefix_cached_tokens", reused, "sum")
            record_metric("generator/prefix_cached_share", reused / len(ids))
        rows = [ids for ids in prompts for _ in range(params.n)]
        hits = [match for match in matches for _ in range(params.n)]
        # Row r: [pads, its reused KV] in the cache's `past` columns, then [pads, its new tokens] in the input's.
        past = max(reused for _, reused in hits)
        batch, width = len(rows), max(len(ids) - reused for ids, (_, reused) in zip(rows, hits))
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, past + width), dtype=torch.long)
        for row, (ids, (_, reused)) in enumerate(zip(rows, hits)):
            new = len(ids) - reused
            input_ids[row, width - new :] = torch.tensor(ids[reused:])
            attention_mask[row, past - reused : past] = 1
            attention_mask[row, past + width - new :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        # Positions count real tokens only, so padding (left, or between reused and new tokens) shifts none.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        cache = self._prefix_cache.assemble(hits, past) if past else DynamicCache()
        # A row stops at max_tokens or at the end of the model window, whichever comes first.
        budgets = [min(params.max_tokens, self.max_model_len - len(ids)) for ids in rows]
        budgets = torch.tensor(budgets, device=self.device)
        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), device=self.device)
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)

        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped = torch.zeros_like(finished)
        step_tokens, step_logprobs, step_kept, step_versions, step_active = [], [], [], [], []
        for step in range(int(budgets.max())):
            version = self._version
            logits = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1].float()
            tokens, logprobs, kept = _sample(logits, params, generator)
            step_tokens.append(tokens)
            step_logprobs.append(logprobs)
            step_kept.append(kept)
            step_versions.append(version)
            step_active.append(~finished)
            stopped |= ~finished & torch.isin(tokens, stop_ids)
            finished = finished | stopped | (step + 1 >= budgets)
            done = bool(finished.all())  # waits for the step (on a GPU too)
            if step == 0:
                prefill_s = time.perf_counter() - start
                for _ in prompts:
                    record_metric("generator/prefill_s", prefill_s)
            if done:
                break
            self._apply_staged()  # between decode steps: the next token may come from new weights
            input_ids = tokens[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1

        tokens = torch.stack(step_tokens, dim=1).tolist()
        logprobs = torch.stack(step_logprobs, dim=1).tolist()
        lengths = torch.stack(step_active, dim=1).sum(dim=1).tolist()
        kept = torch.stack(step_kept, dim=1).cpu() if params.truncates else None  # [batch, steps, K]
        stopped = stopped.tolist()
        if self._prefix_cache is not None and self._weight_changes == weight_changes:
            # A row's KV covers its prompt and its tokens but the last step's (sampled, never fed back).
            steps = len(step_tokens)
            self._prefix_cache.keep_batch(cache, attention_mask,
                                [ids + tokens[row][: min(lengths[row], steps - 1)] for row, ids in enumerate(rows)],
                                [kept_sequence for kept_sequence, _ in hits])
        completions = []
        for row, ids in enumerate(rows):
            n = lengths[row]
            row_kept = None
            if kept is not None:  # kept ids come first in each step's row: trim the columns only -1 fills
                row_kept = kept[row, :n, : int((kept[row, :n] >= 0).sum(-1).max())].clone()
            completions.append(
                Completion(
                    prompt_ids=list(ids),
                    token_ids=tokens[row][:n],
                    text=self.tokenizer.decode(tokens[row][:n], skip_special_tokens=True),
                    logprobs=logprobs[row][:n],
                    finish_reason="stop" if stopped[row] else "length",
                    policy_versions=step_versions[:n],
                    kept_token_ids=row_kept,
                )
            )
        return completions


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pick one token per row; return it, its behaviour log-prob and the ids the step kept ([batch, K] int32,
    -1 padded; None when sampling does not truncate)."""
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), None
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    if not params.truncates:
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), None
    kept_logprobs, kept_ids = _truncate(logprobs, params.kept_width, params.top_p)
    choice = torch.multinomial(kept_logprobs.exp(), 1, generator=generator)
    return kept_ids.gather(-1, choice).squeeze(-1), kept_logprobs.gather(-1, choice).squeeze(-1), kept_ids.int()


def _truncate(logprobs: torch.Tensor, width: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k / top-p distribution, renormalised: its log-probs and token ids ([batch, K], most likely first;
    dropped tokens have log-prob -inf and id -1).

    The `width` most likely tokens (`SamplingParams.kept_width`: top_k, or MAX_KEPT_TOKENS when only top_p is
    set; ties broken by `topk`), then top_p keeps the smallest prefix holding top_p of their renormalised mass
    (a token stays while the tokens ranked above it hold at most top_p; the top token always stays).
    """
    width = min(width, logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(width, dim=-1)  # sorted, most likely first
    top_logprobs = top_logprobs.log_softmax(dim=-1)
    if top_p < 1:
        probs = top_logprobs.exp()
        dropped = probs.cumsum(dim=-1) - probs > top_p
        top_logprobs = top_logprobs.masked_fill(dropped, float("-inf")).log_softmax(dim=-1)
        top_ids = top_ids.masked_fill(dropped, -1)
    return top_logprobs, top_ids
