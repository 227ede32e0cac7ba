"""The GRPO job's configuration: typed sections, validated before any process starts.

Plain Python: the schema and its checks import no torch, Monarch, TorchTitan or vLLM, so `python -m apps.grpo`
refuses a bad config in about a second (tests/apps/grpo/test_cli.py checks the imports). Building a GRPOConfig reads
no file and no hub: what needs the model's files (its layout against its config.json, the teacher's tokenizer, the
chat template; actors/model_files.py reads them) is `GRPOConfig.check`, which apps/grpo/cli.py runs before anything
starts.

Each actor's section is that actor's own config dataclass; `model` fills the model paths of all of them
(the YAML files write `${model}`), so one key switches the whole job to another checkpoint.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from actors import model_files
from actors.engines.vllm_args import check_engine_args, lora_engine_args
from actors.generator_config import ENGINE_KINDS, GeneratorConfig
from actors.lora_config import check_lora_for_model
from actors.model_config import HUB_ID
from actors.model_layout import check_hf_config, check_parallel_layout
from actors.replay_buffer_config import ReplayBufferConfig
from actors.trainer_config import TrainerConfig
from actors.weight_canary import CanaryConfig
from rl.environments.config import EnvironmentConfig
from forge.hosts.config import HostsConfig
from losses.registry import REGISTERED_LOSSES
from losses.rules import VOCABULARY_KLS, check_advantage_normalization
from forge.metrics import MetricsConfig
from rl.tasks.config import ENVIRONMENT_SOURCES, TaskConfig
from apps.run_checkpoints import CheckpointConfig
from apps.warm_start.config import WarmStartConfig


@dataclass
class RolloutConfig:
    """How episodes are generated: the GRPO group, sampling, and which groups are kept."""

    group_size: int = 8
    """Completions per prompt (the GRPO group)."""
    max_tokens: int = 6
    """Sampling: tokens generated per completion (per model turn in multi-turn tasks)."""
    temperature: float = 1.0
    """Sampling temperature; `trainer.temperature` must equal it."""
    top_p: float = 1.0
    """Sampling: nucleus mass kept (the kept set is replayed by the trainer: docs/off_policy.md)."""
    concurrency: int = 4
    """Prompt groups generating at once (the replay buffer may allow fewer)."""
    normalize_advantages: bool = True
    """Divide advantages by the group's std (false for Dr. GRPO)."""
    drop_zero_variance_groups: bool = False
    """DAPO's dynamic sampling: skip groups whose rewards are all equal (counted)."""
    max_dropped_groups_per_step: int | None = None
    """Dynamic sampling's budget (verl's max_num_gen_batches, per group): past this many groups dropped while one
    training step waits, that step keeps its further zero-variance groups (advantage 0), so a policy that solves most
    prompts cannot make each step generate ever more. null: no budget; needs `drop_zero_variance_groups`."""

    def __post_init__(self) -> None:
        if not 2 <= self.group_size <= 1 << 16:
            raise ValueError(f"group_size={self.group_size}: must be from 2 (advantages are relative to the group) "
                             "to 65536")
        for name in ("max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0 for sampling")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.max_dropped_groups_per_step is not None:
            if not self.drop_zero_variance_groups:
                raise ValueError(f"max_dropped_groups_per_step={self.max_dropped_groups_per_step}: budgets dropped "
                                 f"groups, but drop_zero_variance_groups is false; set it true, or leave the budget "
                                 f"unset")
            if self.max_dropped_groups_per_step < 1:
                raise ValueError(f"max_dropped_groups_per_step={self.max_dropped_groups_per_step}: must be >= 1 "
                                 f"(or unset: no budget)")


@dataclass
class ResourcesConfig:
    """How many processes each actor gets, and whether they get GPUs."""

    generator_replicas: int = 1
    """Generator service replicas."""
    generator_procs: int = 1
    """Processes per generator replica (1 with vllm: a tensor-parallel vLLM replica is one process with
    `generator.engine_args.tensor_parallel_size` GPUs)."""
    trainer_procs: int = 1
    """FSDP data-parallel ranks of the trainer."""
    reference_procs: int = 1
    """Ranks of the reference model."""
    with_gpus: bool = False
    """One GPU per process (a tensor-parallel vLLM replica's process: `tensor_parallel_size` GPUs), assigned without
    overlap; too few GPUs is an error before anything starts."""

    def __post_init__(self) -> None:
        for name in ("generator_replicas", "generator_procs", "trainer_procs", "reference_procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


@dataclass
class EvalConfig:
    """Greedy accuracy on the task's held-out problems."""

    at_start: bool = True
    """Evaluate before the first step."""
    at_end: bool = True
    """Evaluate after the last step."""
    every: int = 0
    """Also every N steps (0: never)."""
    num_prompts: int = 500
    """Held-out prompts per evaluation."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every={self.every}: must be >= 0 (0: only at the start and the end)")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts}: must be >= 1")


@dataclass
class ReferenceSection:
    """A frozen reference model for the KL term."""

    enabled: bool = False
    """Run it (for `trainer.loss_params.kl_coef` > 0)."""
    chunk_rows: int = 4
    """Rows per forward pass."""


TEACHER_WARM_START = "warm_start"  # `teacher.model`: the task's warm start, trained on (apps/grpo/rollouts.py)
TEACHER_ENGINES = ("titan", *ENGINE_KINDS)


@dataclass
class TeacherSection:
    """On-policy distillation's teacher (`trainer.loss: distill`, docs/distillation.md): a frozen model that scores
    the student's own samples, served like the reference model (its own mesh of `resources.reference_procs` ranks,
    the trainer's family, dtype and temperature); its log-probs take the reference's place in the batch."""

    model: str | None = None
    """null: no teacher. An HF checkpoint folder or hub id with the student's tokenizer (e.g. a GRPO run's
    `hf_model`), or `warm_start`: the task's supervised warm start trained on to `warm_start_accuracy`, built and
    cached in `model_cache` like the student's (any task with answers: not openenv or environment ones)."""
    warm_start_accuracy: float = 0.8
    """`model: warm_start`: the greedy accuracy (on the warm start's own eval prompts) its training stops at."""
    engine: str = "titan"
    """What serves the teacher. `titan`: TorchTitan, like the reference model (the trainer's family, dtype and
    temperature, FSDP over `resources.reference_procs` ranks). `hf` or `vllm`: that generator engine in one process
    of its own (the generator's dtype and device; vLLM's tensor parallelism from `engine_args`), for any architecture
    the engine loads; it scores over the full vocabulary, so `rollout.top_p` must be 1 (and vLLM's raw-logit
    log-probs need `rollout.temperature` 1)."""
    engine_args: dict = field(default_factory=dict)
    """`engine: hf` or `vllm`: the engine's own arguments, as `generator.engine_args`."""
    chunk_rows: int = 4
    """`engine: titan`: rows per forward pass."""
    top_k: int = 0
    """`trainer.loss_params.kl: reverse` or `forward` (losses/distill.py): the teacher hands over its `top_k` most
    likely tokens at every position of the student's samples and their log-probs, the rest of its mass as one more
    bucket (the tiny model's vocabulary is 99: 100 covers it all, and the KL is exact); 0: only the sampled tokens'
    log-probs (`kl: sampled`). `engine: titan` only."""
    kl_check_steps: int = 20
    """Every this many steps the run checks that the reverse KL to the teacher has fallen (the mean of the last 5
    steps at least 10% under the first 5's) and prints a warning line when it has not; 0: no check."""

    def __post_init__(self) -> None:
        if self.model == "":
            raise ValueError("model='': must be null (no teacher), a checkpoint folder or hub id, or "
                             f"{TEACHER_WARM_START!r}")
        if self.engine not in TEACHER_ENGINES:
            raise ValueError(f"engine={self.engine!r}: must be one of {', '.join(TEACHER_ENGINES)}")
        if self.engine == "titan" and self.engine_args:
            raise ValueError(f"engine_args={self.engine_args}: only an hf or vllm teacher takes engine arguments "
                             "(engine=titan)")
        if not 0 < self.warm_start_accuracy <= 1:
            raise ValueError(f"warm_start_accuracy={self.warm_start_accuracy}: must be in (0, 1]")
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows={self.chunk_rows}: must be >= 1")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an int >= 0 (0: the sampled tokens' log-probs only)")
        if not isinstance(self.kl_check_steps, int) or self.kl_check_steps < 0:
            raise ValueError(f"kl_check_steps={self.kl_check_steps!r}: must be an int >= 0 (0: no check)")

    @property
    def on_engine(self) -> bool:
        """A teacher is set and an hf or vllm engine scores for it (not TorchTitan)."""
        return self.model is not None and self.engine != "titan"


@dataclass
class GRPOConfig:
    """The whole job."""

    # The actors' own config sections. Their model paths are `${model}` in the YAML files.
    generator: GeneratorConfig
    trainer: TrainerConfig
    model: str = "tiny"
    """`tiny` (built by forge into `model_cache`), an HF checkpoint folder, or a hub id; `${model}` fills the actors'
    model paths."""
    model_cache: str = ".cache/forge"
    """Where the tiny model and warm-start checkpoints are cached."""
    run_dir: str = "runs/grpo"
    """metrics.jsonl, summary.json, hf_model/, checkpoints/."""
    seed: int = 0
    """RNG seed."""
    steps: int = 100
    """Training steps (one published policy version each)."""
    resume: bool = False
    """Resume from the newest checkpoint in `checkpoint.folder` (as `--resume`)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)  # multi-turn tasks' episode limits
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # weight-sync check (actors/weight_canary.py)
    hosts: HostsConfig = field(default_factory=HostsConfig)  # several hosts (forge/hosts/config.py); empty: this one

    def teacher_engine(self, model: str) -> GeneratorConfig:
        """An hf or vllm teacher's engine settings: the generator's, with the teacher's model, engine and arguments."""
        return replace(self.generator, model=model, engine=self.teacher.engine, engine_args=self.teacher.engine_args)

    @property
    def scorer_gpus(self) -> int:
        """GPUs the reference model's or the teacher's mesh takes (with `resources.with_gpus`); 0 without either."""
        if self.teacher.on_engine:
            return self.teacher.engine_args.get("tensor_parallel_size", 1) if self.teacher.engine == "vllm" else 1
        return self.resources.reference_procs if self.reference.enabled or self.teacher.model is not None else 0

    @property
    def generator_gpus_per_proc(self) -> int:
        """GPUs each generator process gets: a tensor-parallel vLLM engine's size, else one."""
        return self.generator.engine_args.get("tensor_parallel_size", 1) if self.generator.engine == "vllm" else 1

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")
        dp = self.resources.trainer_procs
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
        self.hosts.validate("hosts")  # its agents' reachability is checked when the job starts (apps/grpo/cli.py)
        check_advantage_normalization(self.trainer.loss, self.rollout.normalize_advantages, loss_field="trainer.loss",
                                      normalize_field="rollout.normalize_advantages")
        if self.trainer.max_steps < self.steps:
            raise ValueError(f"trainer.max_steps={self.trainer.max_steps}: must be >= steps={self.steps}")
        if self.trainer.lora is not None and self.trainer.init_checkpoint is not None:
            raise ValueError(f"trainer.init_checkpoint={self.trainer.init_checkpoint!r} with trainer.lora: a LoRA "
                             f"version publishes the adapter only, and the generators merge it onto model="
                             f"{self.model!r}'s weights, not the trainer's base from init_checkpoint; export that "
                             "checkpoint as a Hugging Face folder and set model to it, or train without lora")
        if self.generator.engine == "vllm":
            _check_vllm_engine_args(self.generator.engine_args, self.generator.device, "generator")
            if self.trainer.lora is not None:  # every version is a LoRA request: what vLLM cannot serve, refused now
                lora_engine_args(self.trainer.lora.rank, self.trainer.lora.target_modules)
        if self.task.source in ENVIRONMENT_SOURCES and self.warm_start.enabled:
            raise ValueError(f"warm_start.enabled=true: task.source={self.task.source!r} task.name={self.task.name!r} "
                             "has no correct episodes to warm start from (its environment gives rewards, not "
                             "answers); set warm_start.enabled=false")
        lookup = (self.task.source, self.task.name) == ("forge", "lookup")
        if self.environment.chat_template and self.warm_start.enabled and lookup:
            raise ValueError("environment.chat_template=true: the multi-turn warm start trains and evaluates the "
                             "task's plain-text transcripts, not episodes in the chat template; set "
                             "warm_start.enabled=false")
        check_teacher(self)

    def check(self) -> None:
        """The checks construction leaves out because they read files or the hub: the job's layout against the
        model's config.json (a hub id's is fetched alone), the teacher's checkpoint and tokenizer, the chat template.
        apps/grpo/cli.py calls it before anything starts; each error names the field, its value and what is allowed."""
        check_teacher_checkpoint(self)
        check_model_layout(self)
        if self.environment.chat_template:
            model_files.check_chat_template(self.trainer.model_path)


def check_model_layout(cfg: GRPOConfig) -> None:
    """The job's layout against the model's config.json, so a layout the trainer, the reference model or vLLM
    would refuse after spawning is refused now (with the same checks the trainer makes when it builds)."""
    model = cfg.trainer.model_path
    hf_config = model_files.read_hf_config(model)
    try:
        check_hf_config(cfg.trainer.family, hf_config)
    except KeyError as e:
        raise ValueError(f"model={model!r}: config.json has no {e} (a {cfg.trainer.family} checkpoint needs it)"
                         ) from None
    except ValueError as e:
        raise ValueError(f"model={model!r} with trainer.family={cfg.trainer.family!r}: {e}") from None
    r = cfg.resources
    meshes = [("resources.trainer_procs", r.trainer_procs, cfg.trainer.tensor_parallel_degree, model, hf_config)]
    titan_teacher = cfg.teacher.model is not None and not cfg.teacher.on_engine
    if cfg.reference.enabled or titan_teacher:  # the reference model's mesh, or the teacher's
        teacher = cfg.teacher.model not in (None, TEACHER_WARM_START)  # a warm-start teacher has the student's layout
        meshes.append(("resources.reference_procs", r.reference_procs, 1, cfg.teacher.model if teacher else model,
                       model_files.read_hf_config(cfg.teacher.model) if teacher else hf_config))
    for name, procs, tp, checkpoint, layout in meshes:
        try:
            check_parallel_layout(layout, procs, tp)
        except ValueError as e:
            raise ValueError(f"{name}={procs}: {e} ({checkpoint})") from None
    if cfg.trainer.lora is not None:  # TrainerConfig checked it against a local folder only; a hub id's is here now
        check_lora_for_model(cfg.trainer.lora, cfg.trainer.family, hf_config, field_prefix="trainer.lora",
                             tensor_parallel_degree=cfg.trainer.tensor_parallel_degree)
    if cfg.generator.engine == "vllm":
        _check_vllm_layout(cfg, hf_config)


def check_teacher(cfg: GRPOConfig) -> None:
    """A distillation job has a teacher, only a distillation job has one, and its settings can serve it (no file
    read: the teacher's checkpoint and tokenizer are `check_teacher_checkpoint`'s)."""
    teacher, loss = cfg.teacher.model, cfg.trainer.loss
    if loss == "distill" and teacher is None:
        raise ValueError("trainer.loss='distill': needs a teacher to distill from; set teacher.model (a checkpoint "
                         f"with the student's tokenizer, or {TEACHER_WARM_START!r})")
    if teacher is None:
        return
    if loss in REGISTERED_LOSSES and loss != "distill":
        raise ValueError(f"teacher.model={teacher!r} with trainer.loss={loss!r}: only trainer.loss='distill' trains "
                         "toward a teacher; set trainer.loss=distill, or teacher.model=null")
    if cfg.reference.enabled:
        raise ValueError(f"teacher.model={teacher!r} with reference.enabled=true: the teacher's log-probs take the "
                         "reference model's place in the batch (TrainBatch.ref_logprobs); set reference.enabled=false")
    if cfg.teacher.on_engine:
        check_engine_teacher(cfg)
    check_teacher_top_k(cfg)
    if teacher == TEACHER_WARM_START:
        task = (cfg.task.source, cfg.task.name)
        if cfg.task.source in ENVIRONMENT_SOURCES:
            raise ValueError(f"teacher.model={teacher!r}: task.source={task[0]!r} task.name={task[1]!r} has no "
                             "correct episodes to warm start a teacher from (its environment gives rewards, not "
                             "answers); set teacher.model to a checkpoint with the student's tokenizer")
        if cfg.environment.chat_template and task == ("forge", "lookup"):
            raise ValueError(f"teacher.model={teacher!r} with environment.chat_template=true: the multi-turn warm "
                             "start trains plain-text transcripts, not episodes in the chat template; set "
                             "teacher.model to a checkpoint with the student's tokenizer")


def check_teacher_top_k(cfg: GRPOConfig) -> None:
    """`kl: reverse` or `forward` (losses/distill.py) and `teacher.top_k` go together: the loss needs the teacher's
    top-k at every position, and only it uses them; both compare full-vocabulary distributions, so the student samples
    from one."""
    kl, top_k = cfg.trainer.loss_params.get("kl", "sampled"), cfg.teacher.top_k
    if kl in VOCABULARY_KLS and top_k < 1:
        raise ValueError(f"trainer.loss_params.kl={kl!r} with teacher.top_k={top_k}: the KL over the vocabulary at "
                         "each position needs the teacher's top-k log-probs there; set teacher.top_k >= 1 (the "
                         "vocabulary's size for the exact KL), or kl=sampled")
    if top_k and kl not in VOCABULARY_KLS:
        raise ValueError(f"teacher.top_k={top_k} with trainer.loss_params.kl={kl!r}: only "
                         f"kl={' or '.join(VOCABULARY_KLS)} use the teacher's top-k; set trainer.loss_params.kl, or "
                         "teacher.top_k=0")
    if not top_k:
        return
    if cfg.teacher.engine != "titan":
        raise ValueError(f"teacher.top_k={top_k} with teacher.engine={cfg.teacher.engine!r}: only the titan teacher "
                         "hands over its top-k; set teacher.engine=titan, or teacher.top_k=0 and kl=sampled")
    if cfg.rollout.top_p != 1:
        raise ValueError(f"teacher.top_k={top_k} with rollout.top_p={cfg.rollout.top_p}: the per-position KL compares "
                         "full-vocabulary distributions, so the student must sample from one; set rollout.top_p=1")


def check_teacher_checkpoint(cfg: GRPOConfig) -> None:
    """A teacher checkpoint (not forge's warm start) exists, is built by the trainer's family where TorchTitan serves
    it, and has the student's tokenizer: read from its folder or the hub, so run by `GRPOConfig.check`."""
    teacher = cfg.teacher.model
    if teacher in (None, TEACHER_WARM_START):
        return  # none, or trained from the student's own checkpoint: its layout and tokenizer
    if not Path(teacher).exists() and not HUB_ID.match(teacher):
        raise ValueError(f"teacher.model={teacher!r}: no such folder; must be a Hugging Face checkpoint folder, a hub "
                         f"id 'org/name', {TEACHER_WARM_START!r} or null")
    family = cfg.trainer.family
    try:
        hf_config = model_files.read_hf_config(teacher)
        if cfg.teacher.engine == "titan":  # built by the trainer's family; an engine loads what transformers does
            check_hf_config(family, hf_config)
        model_files.check_same_tokenizer(cfg.trainer.model_path, teacher)
    except KeyError as e:
        raise ValueError(f"teacher.model={teacher!r}: config.json has no {e} (a {family} checkpoint needs it)"
                         ) from None
    except ValueError as e:  # model_files' own messages start with "model=<teacher>: "
        message = str(e).removeprefix(f"model={teacher!r}: ")
        built = f" (built as trainer.family={family!r})" if cfg.teacher.engine == "titan" else ""
        raise ValueError(f"teacher.model={teacher!r}{built}: {message}") from None


def check_engine_teacher(cfg: GRPOConfig) -> None:
    """An hf or vllm teacher scores over the full vocabulary (Engine.score; vLLM at temperature 1 only), so the
    student must sample so too, or the reverse KL would compare two different distributions; its engine arguments
    get the generator's checks."""
    engine = cfg.teacher.engine
    limits = [("rollout.top_p", cfg.rollout.top_p, "over the full vocabulary")]
    if engine == "vllm":
        limits.append(("rollout.temperature", cfg.rollout.temperature, "at temperature 1 (raw-logit log-probs)"))
    for name, value, how in limits:
        if value != 1:
            raise ValueError(f"teacher.engine={engine!r} with {name}={value}: the {engine} teacher scores {how}, so "
                             f"the student must sample so too; set {name}=1, or teacher.engine=titan (it scores as "
                             "the trainer does)")
    try:
        cfg.teacher_engine(cfg.model)
    except ValueError as e:  # GeneratorConfig's messages start with the field
        raise ValueError(f"teacher.{e}") from None
    if engine == "vllm":
        _check_vllm_engine_args(cfg.teacher.engine_args, cfg.generator.device, "teacher")
        tp = cfg.teacher.engine_args.get("tensor_parallel_size", 1)
        if tp != 1 and not cfg.resources.with_gpus:
            raise ValueError(f"teacher.engine_args.tensor_parallel_size={tp}: needs resources.with_gpus=true")


def _check_vllm_layout(cfg: GRPOConfig, hf_config: dict) -> None:
    # One vLLM engine per replica, in one process; a tensor-parallel engine gets tensor_parallel_size GPUs in
    # that process (forge.provisioner's gpus_per_proc) and starts its own workers on them.
    if cfg.resources.generator_procs != 1:
        raise ValueError(f"resources.generator_procs={cfg.resources.generator_procs}: must be 1 with "
                         "generator.engine='vllm' (one engine per replica; its GPUs come from "
                         "generator.engine_args.tensor_parallel_size); scale with resources.generator_replicas")
    tp = cfg.generator.engine_args.get("tensor_parallel_size", 1)
    if tp != 1 and not cfg.resources.with_gpus:
        raise ValueError(f"generator.engine_args.tensor_parallel_size={tp}: needs resources.with_gpus=true (the "
                         "replica's process is given that many GPUs)")
    heads = hf_config.get("num_attention_heads")
    if heads and heads % tp:
        raise ValueError(f"generator.engine_args.tensor_parallel_size={tp}: must divide config.json "
                         f"num_attention_heads={heads} (vLLM shards whole heads)")
    max_model_len = cfg.generator.engine_args.get("max_model_len")
    positions = hf_config.get("max_position_embeddings")
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise ValueError(f"generator.engine_args.max_model_len={max_model_len}: must be <= the model's "
                         f"max_position_embeddings={positions}")
    if max_model_len is not None and cfg.rollout.max_tokens >= max_model_len:
        raise ValueError(f"rollout.max_tokens={cfg.rollout.max_tokens}: must be < generator.engine_args.max_model_len="
                         f"{max_model_len} (the prompt takes part of the window)")


def _check_vllm_engine_args(engine_args: dict, device: str, section: str) -> None:
    """The vLLM engine's own check of `section.engine_args`, run before anything starts."""
    try:
        check_engine_args(engine_args, device=device)
    except ImportError as e:
        raise ValueError(f"{section}.engine='vllm': {e}") from None
    except ValueError as e:  # its messages start with "engine_args"
        raise ValueError(f"{section}.{e}") from None


# Moved to actors/model_files.py (beside the model layout checks); importable from here for one release.
_MOVED_TO_MODEL_FILES = ("read_hf_config", "read_checkpoint_file", "check_chat_template", "check_same_tokenizer")


def __getattr__(name: str) -> Any:
    if name not in _MOVED_TO_MODEL_FILES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: use actors.model_files.{name}", DeprecationWarning, stacklevel=2)
    return getattr(model_files, name)
