"""The GRPO job's configuration: typed sections, validated before any process starts.

Each actor's section is that actor's own config dataclass; `model` fills the model paths of all of them
(the YAML files write `${model}`), so one key switches the whole job to another checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from actors.generator import GeneratorConfig
from actors.replay_buffer import ReplayBufferConfig
from actors.trainer import TrainerConfig
from forge.metrics import MetricsConfig
from forge.warm_start import WarmStartConfig


@dataclass
class TaskConfig:
    name: Literal["arithmetic", "gsm8k"] = "arithmetic"
    # arithmetic: the built-in task (problems generated from `seed`)
    num_digits: int = 2
    reverse_answer: bool = False  # write answers least-significant digit first (learned much faster)
    held_out: int = 500
    # gsm8k-style math: loaded with `datasets` (a hub id or a local path / data files)
    dataset: str = "openai/gsm8k"
    dataset_config: str | None = "main"
    train_split: str = "train"
    eval_split: str = "test"
    # The reward: "package.module:function" taking (completion_text, answer) -> float; None = the task's own.
    reward: str | None = None
    reward_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"num_digits={self.num_digits}: must be >= 1")
        if self.held_out < 1:
            raise ValueError(f"held_out={self.held_out}: must be >= 1")
        if self.reward is not None and ":" not in self.reward:
            raise ValueError(f"reward={self.reward!r}: must be 'package.module:function'")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s={self.reward_timeout_s}: must be > 0")


@dataclass
class RolloutConfig:
    group_size: int = 8  # completions per prompt (the GRPO group)
    max_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    concurrency: int = 4  # rollout loops running at once (each: one prompt group at a time)
    normalize_advantages: bool = True  # divide by the group's std (False for Dr. GRPO)
    drop_zero_variance_groups: bool = False  # DAPO's dynamic sampling

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: must be >= 2 (advantages are relative to the group)")
        for name in ("max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0 for sampling")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")


@dataclass
class ResourcesConfig:
    generator_replicas: int = 1
    generator_procs: int = 1  # processes per replica (tensor-parallel engines)
    trainer_procs: int = 1  # data-parallel ranks (FSDP)
    reference_procs: int = 1
    with_gpus: bool = False

    def __post_init__(self) -> None:
        for name in ("generator_replicas", "generator_procs", "trainer_procs", "reference_procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


@dataclass
class EvalConfig:
    at_start: bool = True
    at_end: bool = True
    every: int = 0  # also every N steps (0 = never)
    num_prompts: int = 500

    def __post_init__(self) -> None:
        if self.every < 0 or self.num_prompts < 1:
            raise ValueError(f"every={self.every} must be >= 0 and num_prompts={self.num_prompts} >= 1")


@dataclass
class CheckpointConfig:
    interval: int = 0  # save the whole job every N steps (0 = only at the end when `final` is set)
    final: bool = True
    folder: str = "${run_dir}/checkpoints"
    keep: int = 2  # newest job checkpoints kept on disk

    def __post_init__(self) -> None:
        if self.interval < 0 or self.keep < 1:
            raise ValueError(f"interval={self.interval} must be >= 0 and keep={self.keep} >= 1")


@dataclass
class ReferenceSection:
    enabled: bool = False  # a frozen reference model for the KL term (trainer.loss_params.kl_coef > 0)
    chunk_rows: int = 4


@dataclass
class GRPOConfig:
    # The actors' own config sections. Their model paths are `${model}` in the YAML files.
    generator: GeneratorConfig
    trainer: TrainerConfig
    model: str = "tiny"  # "tiny" (built by forge, cached in model_cache), an HF checkpoint folder, or a hub id
    model_cache: str = ".cache/forge"
    run_dir: str = "runs/grpo"
    seed: int = 0
    steps: int = 100
    resume: bool = False
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")
        dp = self.resources.trainer_procs
        if self.replay_buffer.dp_size != 1 and self.replay_buffer.dp_size != dp:
            raise ValueError(f"replay_buffer.dp_size={self.replay_buffer.dp_size}: must be 1 or resources.trainer_procs={dp}")
        if self.replay_buffer.batch_size % dp:
            raise ValueError(
                f"replay_buffer.batch_size={self.replay_buffer.batch_size}: must be divisible by "
                f"resources.trainer_procs={dp} (each data-parallel rank trains an equal slice)"
            )
        if self.replay_buffer.batch_size % self.rollout.group_size:
            raise ValueError(
                f"replay_buffer.batch_size={self.replay_buffer.batch_size}: must be a multiple of "
                f"rollout.group_size={self.rollout.group_size} (whole groups per step)"
            )
        slices = self.trainer.minibatches * dp
        if self.replay_buffer.batch_size % slices:
            raise ValueError(
                f"trainer.minibatches={self.trainer.minibatches}: replay_buffer.batch_size="
                f"{self.replay_buffer.batch_size} must split into minibatches x resources.trainer_procs={slices} "
                "equal slices"
            )
        if self.trainer.temperature != self.rollout.temperature:
            raise ValueError(
                f"trainer.temperature={self.trainer.temperature}: must equal rollout.temperature="
                f"{self.rollout.temperature} (log-probs are compared at the sampling temperature)"
            )
        if self.generator.engine == "vllm" and self.rollout.temperature != 1.0:
            raise ValueError(
                f"rollout.temperature={self.rollout.temperature}: generator.engine='vllm' samples at 1.0 only (vLLM "
                "reports log-probs of the raw logits); use rollout.temperature=1.0 or generator.engine=hf"
            )
        tied = _tied_embeddings(self.trainer.model_path)
        if tied and (dp > 1 or self.reference.enabled and self.resources.reference_procs > 1):
            raise ValueError(
                f"resources.trainer_procs={dp}: {self.trainer.model_path} ties its input and output embeddings, which "
                "torchtitan 0.2.0 cannot shard (pytorch/torchtitan#2252); use trainer_procs=1 or an untied checkpoint"
            )
        if self.trainer.max_steps < self.steps:
            raise ValueError(f"trainer.max_steps={self.trainer.max_steps}: must be >= steps={self.steps}")


def _tied_embeddings(model_path: str) -> bool:
    """From a local checkpoint's config.json (a hub id is checked when the trainer loads it)."""
    config = Path(model_path) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
