"""LoRA sessions of the training service: one frozen base model, loaded once, and one peft adapter per session.

`SharedBaseLoRATrainer` is `ServerTrainer` (forward_backward, forward, optim_step, save/load state, export) over a
base whose linear layers carry one named peft adapter per session, added and removed while the server runs.
Every call names its session (`run(session_id, method, ...)`): that session's adapter becomes the active one on
every LoRA layer (peft's `set_adapter`, which also makes it the only adapter that requires grad) and its own
optimizer (over its adapter's parameters only), LR schedule, step counter and gradient count are swapped in. A
session's accumulated gradients stay on its own parameters while other sessions step.

Checkpoints and exports name a session's adapter as peft's single adapter ("default"), so one session's
`save_state` loads into any session with the same rank and targets, and reads like an apps.grpo LoRA checkpoint.

`LoRATrainerActor` serves all LoRA sessions of a server from one process (adapters are added after the model
is built, and FSDP shards a model when it is built, so the shared trainer is not sharded), and samples with
saved adapters over the same base tensors (`AdapterSampler`).

`AdapterSampler`: the Hugging Face model it samples with is built without weights and then given the trainer's
frozen base tensors (`load_state_dict(assign=True)`: the same storage, no copy), so the base is in memory once for
training and sampling. Each saved adapter (a peft folder from `save_weights_for_sampler`) is loaded once with peft
as a named adapter (`PeftModel.load_adapter`), kept for later requests (the oldest dropped beyond `max_adapters`),
and made the active one for its request; the adapter runs in the forward pass, so the base never changes.
Generation is forge's hf engine (`HFEngine.from_model`): the same sampling and log-prob rules as the generators.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from actors import checkpoint, lora as lora_layers
from actors.engines.hf import HFEngine
from actors.lora_config import LoRAConfig
from actors.titan_trainer import OptimizerState, TrainState
from actors.trainer import TrainerActor
from apps.server.trainer import ServerTrainer
from forge.actor import endpoint
from forge.distributed import init_from_environment
from rl.types import Completion, SamplingParams



def adapter_name(session_id: str) -> str:
    """peft's name for a session's adapter (a module key: no '.'; '-' becomes '_')."""
    return "s_" + session_id.replace("-", "_").replace(".", "_").replace(":", "_")


def _renamed(key: str, old: str, new: str) -> str:
    return key.replace(f".lora_A.{old}.", f".lora_A.{new}.").replace(f".lora_B.{old}.", f".lora_B.{new}.")


class _SingleAdapterNames(Stateful):
    """A session's optimizer in checkpoints under the single-adapter names (`.lora_A.default.`)."""

    def __init__(self, optimizers: Any, name: str) -> None:
        self.optimizers, self.name = optimizers, name

    def state_dict(self) -> dict[str, Any]:
        return {_renamed(k, self.name, lora_layers.ADAPTER_NAME): v for k, v in self.optimizers.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizers.load_state_dict({_renamed(k, lora_layers.ADAPTER_NAME, self.name): v
                                         for k, v in state_dict.items()})


@dataclass
class AdapterSession:
    name: str  # the adapter's peft name
    lora: LoRAConfig
    optimizers: Any  # torchtitan's OptimizersContainer over this adapter's parameters
    lr_schedulers: Any
    train_state: TrainState
    accumulated: int = 0


class SharedBaseLoRATrainer(ServerTrainer):
    """ServerTrainer over one frozen base shared by every session's adapter (one process)."""

    def __init__(self, config: Any, *, rank: int = 0, world_size: int = 1) -> None:
        if world_size != 1:
            raise ValueError(f"the LoRA sessions' shared trainer runs in one process, not world_size={world_size}: "
                             "adapters are added after the model is built, and FSDP shards a model as it is built")
        if config.lora is not None:
            raise ValueError("the shared LoRA trainer takes its adapters per session (add_session), not trainer.lora")
        super().__init__(config, rank=rank, world_size=world_size)
        self.model.requires_grad_(False)
        # TitanTrainer built an optimizer over the whole model; each session brings its own over its adapter.
        self.optimizers = self.lr_schedulers = None
        self.sessions: dict[str, AdapterSession] = {}
        self._active: str | None = None

    # -- sessions ---------------------------------------------------------------------------------
    def add_session(self, session_id: str, lora: LoRAConfig, seed: int) -> dict[str, int]:
        """A new adapter on the base (peft's initialization drawn from `seed`: B = 0, so it starts at the base)
        with a fresh optimizer over its parameters only. Returns its parameter count."""
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} already has an adapter")
        name = adapter_name(session_id)
        lora_layers.inject(self.model, lora, lora_layers.titan_targets(lora, self.adapter), adapter_name=name)
        lora_layers.init_adapters(self.model, seed, adapter_name=name)
        # Only this adapter requires grad right after `inject`: the optimizer takes exactly its parameters.
        optimizers, schedulers = self._build_optimizers()
        self.sessions[session_id] = AdapterSession(name, lora, optimizers, schedulers, TrainState())
        self._active = None  # `inject` changed which parameters require grad
        return {"adapter_parameters": sum(p.numel() for o in optimizers.optimizers for g in o.param_groups
                                          for p in g["params"])}

    def remove_session(self, session_id: str) -> None:
        """Delete the session's adapter from every layer, with its optimizer state."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        with warnings.catch_warnings():  # peft warns when it picks another active adapter for a layer
            warnings.simplefilter("ignore")
            for module in self.model.modules():
                if isinstance(module, BaseTunerLayer) and session.name in module.lora_A:
                    module.delete_adapter(session.name)
        getattr(self.model, "peft_config", {}).pop(session.name, None)
        self._active = None

    def run(self, session_id: str, method: str, *args: Any) -> Any:
        """`method` of ServerTrainer with the session's adapter, optimizer and counters in place."""
        session = self._activate(session_id)
        try:
            return getattr(self, method)(*args)
        finally:
            session.accumulated = self.accumulated

    def _activate(self, session_id: str) -> AdapterSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise KeyError(f"no LoRA adapter for session {session_id!r}; adapters: {sorted(self.sessions)}")
        if self._active != session_id:
            for module in self.model.modules():
                if isinstance(module, BaseTunerLayer):
                    module.set_adapter(session.name)  # also: only this adapter requires grad
            self._active = session_id
        self.optimizers, self.lr_schedulers, self.train_state = (session.optimizers, session.lr_schedulers,
                                                                 session.train_state)
        self.accumulated = session.accumulated
        return session

    @property
    def _session(self) -> AdapterSession:
        return self.sessions[self._active]

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """The active session's adapter under the single-adapter names (the model's own tensors)."""
        name = self._session.name
        state = lora_layers.adapter_state(get_model_state_dict(self.model), adapter_name=name)
        return {_renamed(k, name, lora_layers.ADAPTER_NAME): v for k, v in state.items()}

    # -- checkpoints and export of the active session ----------------------------------------------
    def _checkpoint_states(self) -> dict[str, Any]:
        session = self._session
        states = {**self._adapter_state(), "optimizer": _SingleAdapterNames(OptimizerState(session.optimizers),
                                                                          session.name),
                  "lr_scheduler": session.lr_schedulers, "train_state": session.train_state}
        if self._model_only:
            for key in checkpoint.OPTIMIZER_PARTS:
                states.pop(key)
        return states

    def load_checkpoint(self, path: str | Path) -> None:
        states = self._checkpoint_states()
        renamed, _ = checkpoint.in_checkpoint_names(states, Path(path))  # a save_state of forge on torchtitan 0.2.0
        checkpoint.load(renamed, Path(path), rank=self.rank, world_size=self.world_size)
        name = self._session.name
        adapter = {_renamed(k, lora_layers.ADAPTER_NAME, name): v for k, v in states.items()
                   if checkpoint.is_model_key(k)}
        set_model_state_dict(self.model, adapter, options=StateDictOptions(strict=False))

    def export_hf(self, path: str | Path) -> str:
        """The session's adapter as a peft folder (adapter_config.json, adapter_model.safetensors)."""
        dtype = checkpoint.source_dtype(self.model_path)
        adapter = {k: v.detach().to(dtype, copy=True)
                   for k, v in lora_layers.to_peft_names(self._adapter_state(), self.adapter).items()}
        lora_layers.export_peft(adapter, self._session.lora, str(self.model_path), Path(path))
        return str(path)

    def base_hf_state(self) -> dict[str, torch.Tensor]:
        """The frozen base in Hugging Face names: the model's own tensors, no copy."""
        state = {lora_layers.base_key(k): v for k, v in get_model_state_dict(self.model).items()
                 if ".lora_A." not in k and ".lora_B." not in k}
        # A tied lm_head is the embedding's storage: the adapter leaves it out, and the HF model ties it itself.
        return self.adapter.to_hf(state)


# -- sampling with saved adapters over the same base ----------------------------------------------------------------
def shared_base_model(base_hf_state: dict[str, torch.Tensor], model_path: str) -> torch.nn.Module:
    """The HF causal LM of `model_path` whose parameters are the tensors of `base_hf_state` (no copy)."""
    config = AutoConfig.from_pretrained(model_path)
    with init_empty_weights():  # parameters on meta, buffers (rotary frequencies) real
        model = AutoModelForCausalLM.from_config(config, dtype=next(iter(base_hf_state.values())).dtype)
    missing, unexpected = model.load_state_dict(base_hf_state, assign=True, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"the trainer's base does not fit {model_path}: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()
    return model.eval().requires_grad_(False)


class AdapterSampler:
    """Generation with any saved adapter of the served base model, one adapter active per request."""

    def __init__(self, base_hf_state: dict[str, torch.Tensor], model_path: str, *, seed: int = 0,
                 max_adapters: int = 8) -> None:
        self.model_path = str(Path(model_path).resolve())
        self.model = shared_base_model(base_hf_state, model_path)
        self.engine = HFEngine.from_model(self.model, AutoTokenizer.from_pretrained(model_path), seed=seed)
        self.max_adapters = max_adapters
        self.peft: PeftModel | None = None
        self.adapters: OrderedDict[tuple[str, int], str] = OrderedDict()  # (folder, file mtime) -> adapter name
        self._names = 0

    def _adapter(self, path: str) -> str:
        """The peft name of the adapter saved at `path`, loading it on first use."""
        weights = Path(path, "adapter_model.safetensors")
        key = (str(Path(path).resolve()), weights.stat().st_mtime_ns)  # a name saved again is a new adapter
        if key in self.adapters:
            self.adapters.move_to_end(key)
            return self.adapters[key]
        base = json.loads(Path(path, "adapter_config.json").read_text()).get("base_model_name_or_path")
        if base is not None and str(Path(base).resolve()) != self.model_path:
            raise ValueError(f"adapter {path} was trained on {base!r}, not the served base model {self.model_path!r}")
        self._names += 1
        name = f"sampler_{self._names}"
        if self.peft is None:  # wraps self.model in place: its LoRA layers serve every later adapter too
            self.peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
        else:
            self.peft.load_adapter(path, adapter_name=name)
        self.adapters[key] = name
        if len(self.adapters) > self.max_adapters:
            _, oldest = self.adapters.popitem(last=False)
            self.peft.delete_adapter(oldest)
        return name

    def generate(self, adapter_path: str, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        name = self._adapter(adapter_path)
        self.peft.set_adapter(name)
        return self.engine.generate(prompts, params)

    def prompt_logprobs(self, adapter_path: str, prompt: list[int]) -> list[float]:
        """Log-probs of prompt[1:], each given the tokens before it, with the adapter at `adapter_path`."""
        name = self._adapter(adapter_path)
        self.peft.set_adapter(name)
        return self.engine.score(prompt[:1], prompt[1:])[0] if len(prompt) > 1 else []


class LoRATrainerActor(TrainerActor):
    """Every LoRA session of the server on one process: one base, one adapter per session, and sampling with
    saved adapters over that same base. One call at a time (a lock: each call switches the active adapter)."""

    def __init__(self, config: Any, *, sampler_seed: int = 0, max_sampler_adapters: int = 8) -> None:
        super().__init__(config)
        self.sampler_seed, self.max_sampler_adapters = sampler_seed, max_sampler_adapters

    @endpoint
    async def setup(self) -> None:
        if self.config.torch_threads and self.config.device == "cpu":
            torch.set_num_threads(self.config.torch_threads)
        rank, world_size = init_from_environment(self.config.device)
        self.trainer = await self._compute(SharedBaseLoRATrainer, self.config, rank=rank, world_size=world_size)
        self.sampler: AdapterSampler | None = None
        self._lock = asyncio.Lock()

    async def _locked(self, fn: Any, *args: Any) -> Any:
        async with self._lock:
            return await self._compute(fn, *args)

    @endpoint
    async def add_session(self, session_id: str, lora: dict, seed: int) -> dict:
        return await self._locked(self.trainer.add_session, session_id, LoRAConfig(**lora), seed)

    @endpoint
    async def remove_session(self, session_id: str) -> None:
        await self._locked(self.trainer.remove_session, session_id)

    @endpoint
    async def forward_backward(self, session_id: str, batch: Any, loss: str, loss_params: dict,
                               temperature: float | None = None) -> dict:
        return await self._locked(self.trainer.run, session_id, "forward_backward", batch, loss, loss_params,
                                  temperature)

    @endpoint
    async def forward(self, session_id: str, batch: Any, loss: str | None, loss_params: dict,
                      temperature: float | None = None) -> dict:
        return await self._locked(self.trainer.run, session_id, "forward_only", batch, loss, loss_params,
                                  temperature)

    @endpoint
    async def optim_step(self, session_id: str, lr: float, betas: tuple, eps: float, weight_decay: float,
                         max_grad_norm: float | None) -> dict:
        return await self._locked(self.trainer.run, session_id, "optim_step", lr, tuple(betas), eps, weight_decay,
                                  max_grad_norm)

    @endpoint
    async def save_state(self, session_id: str, path: str, with_optimizer: bool) -> dict:
        await self._locked(self.trainer.run, session_id, "save_state", path, with_optimizer)
        return {"path": path, "step": self.trainer.sessions[session_id].train_state.step}

    @endpoint
    async def load_state(self, session_id: str, path: str, with_optimizer: bool) -> dict:
        await self._locked(self.trainer.run, session_id, "load_state", path, with_optimizer)
        return {"path": path, "step": self.trainer.sessions[session_id].train_state.step}

    @endpoint
    async def export_hf(self, session_id: str, path: str) -> str:
        return await self._locked(self.trainer.run, session_id, "export_hf", path)

    @endpoint
    async def sample(self, adapter_path: str, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Completions with the saved adapter at `adapter_path` on the shared base."""
        async with self._lock:
            return await self._compute((await self._sampler()).generate, adapter_path, prompts, params)

    @endpoint
    async def score_prompt(self, adapter_path: str, prompt: list[int]) -> list[float]:
        """Teacher-forced log-probs of prompt[1:] with the saved adapter at `adapter_path` (temperature 1)."""
        async with self._lock:
            return await self._compute((await self._sampler()).prompt_logprobs, adapter_path, prompt)

    async def _sampler(self) -> AdapterSampler:
        if self.sampler is None:
            self.sampler = await self._compute(AdapterSampler, self.trainer.base_hf_state(),
                                               str(self.trainer.model_path), seed=self.sampler_seed,
                                               max_adapters=self.max_sampler_adapters)
        return self.sampler
