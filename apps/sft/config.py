"""The SFT job's configuration: typed sections, validated before any process starts.

The trainer, generator, task and metrics sections are the actors' and rl's own config dataclasses, as apps.grpo's are;
the checkpoint section is apps.run_checkpoints'. Building an SFTConfig reads no file: `SFTConfig.check` (run by
apps/sft/cli.py before anything starts) checks the model's layout against its config.json (actors/model_files.py reads
it) and that a JSONL file is there. Errors name the key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from actors import model_files
from actors.generator_config import GeneratorConfig
from actors.model_layout import check_hf_config, check_parallel_layout
from actors.trainer_config import TrainerConfig
from apps.run_checkpoints import CheckpointConfig
from forge.metrics import MetricsConfig
from rl.environments.config import EnvironmentConfig
from rl.tasks.config import ENVIRONMENT_SOURCES, TaskConfig
from rl.tiny_model import check_shape

# The loss SFT trains with (losses/nll.py), by module path: losses/registry.py lists the policy losses, each taking
# the rollout corrections, and a GRPO job must not pick the supervised objective by name.
NLL_LOSSES = ("losses.nll:nll", "nll")
# Task sources whose problems have no reference answer to learn from: their environments give rewards only.


@dataclass
class DataSection:
    """What the model is fine-tuned on: a task's reference answers, or demonstrations in a file or dataset."""

    source: Literal["task", "jsonl", "datasets"] = "task"
    """`task`: the `task` section's problems with their reference answers (arithmetic, gsm8k, reasoning-gym; the
    multi-turn `lookup` task's correct episodes);
    `jsonl`: a local JSONL file (`path`); `datasets`: a dataset loaded with the `datasets` library (`path`: a hub id,
    a folder or a data file). A row is `{prompt, completion}` (strings) or `{messages[, tools]}` (chat: multi-turn,
    tool calls, rendered with the model's chat template)."""
    path: str | None = None
    """jsonl and datasets: where the rows are."""
    dataset_config: str | None = None
    """datasets: the dataset's config name."""
    split: str = "train"
    """datasets: the split trained on."""
    held_out: int = 0
    """jsonl and datasets: rows drawn (seeded) out of training for the held-out loss (0: none)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to the chat template (Qwen3: `enable_thinking`)."""
    max_length: int | None = None
    """Rows longer than this many tokens are left out (counted and printed); null: the model's
    max_position_embeddings."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """source=task: an apps.grpo `task` section."""

    def __post_init__(self) -> None:
        if self.source == "task":
            if self.path is not None:
                raise ValueError(f"path={self.path!r}: source=task reads the task section; set source to jsonl or "
                                 "datasets to read a file")
            if self.task.source in ENVIRONMENT_SOURCES:
                raise ValueError(f"task.source={self.task.source!r}: its environment gives rewards, not reference "
                                 f"answers, so there is nothing to fine-tune on; SFT takes a task with answers "
                                 f"(forge arithmetic or gsm8k, reasoning_gym)")
        else:
            if self.path is None:
                raise ValueError(f"path=None: source={self.source} needs the rows' path")
        if self.held_out < 0:
            raise ValueError(f"held_out={self.held_out}: must be >= 0")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: must be >= 2, or null")


@dataclass
class SFTEvalSection:
    """Held-out loss (every source) and greedy held-out accuracy (task sources, scored by the shared evaluator, apps/held_out/)."""

    every: int = 0
    """Evaluate every N steps too (0: only at the start and the end)."""
    at_start: bool = True
    """Evaluate before the first step."""
    at_end: bool = True
    """Evaluate after the last step."""
    num_prompts: int = 200
    """Held-out examples per evaluation (the task's held-out problems, or the `data.held_out` rows)."""
    accuracy: bool = True
    """task sources: also greedy accuracy on those prompts, sampled by a generator service (`generator`); a
    multi-turn task's (lookup) as episodes played against its environment (`environment`)."""
    max_tokens: int = 16
    """Tokens generated per held-out prompt, per model turn in a multi-turn task's episode (tiny: 4)."""
    stop_at_accuracy: float | None = None
    """Stop training at the first evaluation (every `every` steps) whose greedy held-out accuracy reaches this, then
    export as at the end: a start for GRPO that gets some answers right and leaves it the rest (null: train all
    `steps`)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every={self.every}: must be >= 0 (0: only at the start and the end)")
        if self.stop_at_accuracy is not None and not 0 < self.stop_at_accuracy <= 1:
            raise ValueError(f"stop_at_accuracy={self.stop_at_accuracy}: must be in (0, 1], or null")
        for name in ("num_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


@dataclass
class SFTResources:
    """How many trainer processes, and whether they get GPUs."""

    trainer_procs: int = 1
    """FSDP data-parallel ranks of the trainer."""
    with_gpus: bool = False
    """One GPU per process."""

    def __post_init__(self) -> None:
        if self.trainer_procs < 1:
            raise ValueError(f"trainer_procs={self.trainer_procs}: must be >= 1")


@dataclass
class PackingSection:
    """Several examples in one row of the trainer's batch instead of one right-padded row each (docs/sft.md)."""

    enabled: bool = False
    """Pack: each example attends only to itself (block-causal attention), the loss is the same token mean."""
    max_length: int | None = None
    """Tokens per packed row at most (an example longer than that gets a row of its own), <= the model's
    max_position_embeddings; null: that."""

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: must be >= 2 (tokens per packed row)")


@dataclass
class SFTConfig:
    """The whole SFT job."""

    trainer: TrainerConfig
    """apps.grpo's trainer section; `loss` must be the nll loss, `temperature` 1."""
    model: str = "tiny"
    """`tiny` (built by forge into `model_cache`), an HF checkpoint folder, or a hub id; `${model}` fills the model
    paths."""
    model_cache: str = ".cache/forge"
    """Where the tiny model is built."""
    tiny_shape: dict[str, Any] = field(default_factory=dict)
    """`model: tiny` only: the tiny model's shape fields to change (rl/tiny_model.py DEFAULT_MODEL_ARGS: hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    max_position_embeddings, tie_word_embeddings), e.g. `{hidden_size: 256, num_hidden_layers: 4}`; built once into
    `model_cache`/tiny-qwen3-<digest of the shape>. Empty: the default ~0.4M-parameter shape."""
    run_dir: str = "runs/sft"
    """metrics.jsonl, summary.json, hf_model/, checkpoints/."""
    seed: int = 0
    """Data order and the task's problems."""
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 64
    """Examples per step, split evenly over the data-parallel ranks (then in trainer.micro_batch_size micro-batches:
    exact gradient accumulation)."""
    resume: bool = False
    """Resume from the newest checkpoint in `checkpoint.folder` (as `--resume`)."""
    data: DataSection = field(default_factory=DataSection)
    packing: PackingSection = field(default_factory=PackingSection)
    eval: SFTEvalSection = field(default_factory=SFTEvalSection)
    generator: GeneratorConfig | None = None
    """The generator service that samples the held-out prompts for `eval.accuracy` (null: no accuracy)."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """A multi-turn task's held-out episodes for `eval.accuracy`: their limits and where their environments run, as
    apps.grpo's section (plain text only: SFT trains the task's plain-text transcripts)."""
    resources: SFTResources = field(default_factory=SFTResources)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def is_multi_turn_task(self) -> bool:
        return self.data.source == "task" and self.data.task.multi_turn

    @property
    def measures_accuracy(self) -> bool:
        return self.data.source == "task" and self.eval.accuracy and self.generator is not None

    def __post_init__(self) -> None:
        check_shape(self.tiny_shape, "tiny_shape")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")
        dp = self.resources.trainer_procs
        if self.batch_size < 1 or self.batch_size % (dp * self.trainer.minibatches):
            raise ValueError(f"batch_size={self.batch_size}: must be a positive multiple of resources.trainer_procs="
                             f"{dp} x trainer.minibatches={self.trainer.minibatches} (each rank trains an equal slice)")
        if self.trainer.loss not in NLL_LOSSES:
            raise ValueError(f"trainer.loss={self.trainer.loss!r}: SFT trains with the nll loss; set it to "
                             f"{NLL_LOSSES[0]!r}")
        if self.trainer.temperature != 1:
            raise ValueError(f"trainer.temperature={self.trainer.temperature}: must be 1 (the likelihood of the "
                             "data is the model's own distribution)")
        if self.trainer.max_steps < self.steps:
            raise ValueError(f"trainer.max_steps={self.trainer.max_steps}: must be >= steps={self.steps} (the LR "
                             "schedule's length; the tiny config sets it to ${steps})")
        if self.trainer.lora is not None:
            raise ValueError("trainer.lora: SFT trains the full model here (its export and held-out sampling follow "
                             "the full weights); set trainer.lora=null")
        if self.environment.chat_template:
            raise ValueError("environment.chat_template=true: SFT trains a multi-turn task's plain-text transcripts, "
                             "so its held-out episodes are played in plain text too; set environment.chat_template="
                             "false")
        if self.eval.stop_at_accuracy is not None and not (self.measures_accuracy and self.eval.every):
            raise ValueError(f"eval.stop_at_accuracy={self.eval.stop_at_accuracy}: needs the held-out accuracy "
                             f"measured during training: a task source, eval.accuracy=true, a generator and "
                             f"eval.every > 0 (eval.every={self.eval.every})")
        if self.data.source != "task" and self.eval.accuracy and self.generator is not None:
            raise ValueError(f"eval.accuracy=true: data.source={self.data.source} has no reward to score samples "
                             "with (only task sources do); set eval.accuracy=false or generator=null")

    def check(self) -> None:
        """The checks construction leaves out because they read files: a JSONL file is there, and the trainer's
        layout fits the model's config.json (as apps.grpo checks it). apps/sft/cli.py calls it before anything
        starts; each error names the field, its value and what is allowed."""
        if self.data.source == "jsonl" and not Path(self.data.path).is_file():
            raise ValueError(f"data.path={self.data.path!r}: no such file (source=jsonl)")
        model = self.trainer.model_path
        hf_config = model_files.read_hf_config(model)
        positions = hf_config.get("max_position_embeddings")
        if self.packing.max_length and positions and self.packing.max_length > positions:
            raise ValueError(f"packing.max_length={self.packing.max_length}: must be <= the model's "
                             f"max_position_embeddings={positions} ({model})")
        try:
            check_hf_config(self.trainer.family, hf_config)
            check_parallel_layout(hf_config, self.resources.trainer_procs, self.trainer.tensor_parallel_degree)
        except (KeyError, ValueError) as e:
            raise ValueError(f"trainer.model_path={model!r} with resources.trainer_procs="
                             f"{self.resources.trainer_procs}: {e}") from None
