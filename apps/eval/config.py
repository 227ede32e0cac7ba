"""The evaluation's configuration: typed sections, validated before any process starts.

Plain Python (no torch, Monarch or vLLM): `python -m apps.eval` refuses a bad config in about a second, naming the key,
the value and what is allowed. Building the config reads no file; its check step, `EvalJobConfig.check` (run by
apps/eval/cli.py before anything starts), looks at the model and the folders it is to read (sources.py), so a run
directory without checkpoints is refused before anything starts, not after the generators have.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from omegaconf import MISSING

from actors.engines.vllm_args import check_engine_args
from actors.generator_config import GeneratorConfig
from actors.model_config import is_hf_checkpoint
from actors.model_files import check_chat_template
from apps.eval.sources import ModelVersion, checkpoint_version, model_label, run_checkpoints
from forge.metrics import MetricsConfig
from rl.environments.config import EnvironmentConfig
from rl.tasks.config import TaskConfig


@dataclass
class SamplingSection:
    """How each held-out prompt is sampled and what counts as correct."""

    num_samples: int = 1
    """Samples per prompt (n): pass@k and mean@k are estimated from them (unbiased: docs/eval.md)."""
    pass_k: list[int] | None = None
    """The k of pass@k reported, each from 1 to `num_samples`; null: 1 and `num_samples`."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy, which needs num_samples=1: greedy samples are all the same)."""
    top_p: float = 1.0
    """Nucleus mass kept."""
    max_tokens: int = 16
    """Tokens generated per sample (tiny: 4)."""
    seed: int | None = None
    """Reproducible samples: prompt i of a task is sampled with seed `seed + i`, so the same weights give the same
    samples (an endpoint gets the seed in its request). Each prompt is then its own engine call (slower). null:
    unseeded, prompts batched."""
    correct_at: float = 1.0
    """A sample counts as correct for pass@k when its reward is at least this (forge's exact-match rewards: 1)."""

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0: greedy)")
        if self.temperature == 0 and self.num_samples > 1:
            raise ValueError(f"num_samples={self.num_samples}: with temperature=0 (greedy) every sample is the same; "
                             "set sampling.temperature > 0, or num_samples=1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        bad = [k for k in self.pass_k or [] if not 1 <= k <= self.num_samples]
        if bad or self.pass_k == []:
            raise ValueError(f"pass_k={self.pass_k}: each k must be from 1 to num_samples={self.num_samples} "
                             "(null: 1 and num_samples)")

    @property
    def ks(self) -> list[int]:
        return sorted(set(self.pass_k or [1, self.num_samples]))


@dataclass
class EndpointConfig:
    """An OpenAI-compatible server evaluated over HTTP instead of a model forge loads: a vLLM server
    (`/v1/completions`), or forge's gateway (`/v1/chat/completions`, a session's key as `api_key`)."""

    base_url: str = "???"
    """The API's base URL, up to and including `/v1`, e.g. http://127.0.0.1:8000/v1."""
    model: str = "default"
    """The `model` field of each request (a vLLM server's served model name)."""
    api: Literal["completions", "chat"] = "completions"
    """`completions`: the task's prompt as is, n samples per request (vLLM). `chat`: the prompt as one user message,
    one sample per request (forge's gateway serves chat only, one choice per request)."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer ...` (never printed)."""
    timeout_s: float = 60.0
    """Per request."""
    retries: int = 2
    """Further tries of a request that failed to connect, timed out or got a 5xx / 429 answer; then its samples
    count as failed."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={self.base_url!r}: must be an http:// or https:// URL, e.g. "
                             "http://127.0.0.1:8000/v1")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0")
        if self.retries < 0:
            raise ValueError(f"retries={self.retries}: must be >= 0")


@dataclass
class EvalJobConfig:
    """The whole evaluation: what model, which tasks, how sampled, where the results go."""

    model: str = "tiny"
    """`tiny` (built by forge into `model_cache`), an HF checkpoint folder or hub id: the model evaluated; with
    `checkpoint` or `run_dir`, the base those were trained from (its architecture and tokenizer; step 0 of a run);
    with `endpoint`, only the tokenizer the tasks that use a chat template render their prompts with."""
    model_cache: str = ".cache/forge"
    """Where the tiny model is built."""
    checkpoint: str | None = None
    """One checkpoint of a run on `model`: its `checkpoints/step_NNNNNN` folder (or the `trainer/` inside), or a Hugging
    Face export folder (`hf_model/`)."""
    run_dir: str | None = None
    """Every complete step checkpoint of a GRPO run, in step order: `run_dir/checkpoints/step_*` (or the checkpoints
    folder itself). Adds the plot of accuracy over steps."""
    include_base: bool = True
    """With `run_dir`: evaluate `model` too, as step 0 (it must be the run's starting model; the tiny job's is its
    warm-started model, printed in the run's log)."""
    endpoint: EndpointConfig | None = None
    """An OpenAI-compatible server to evaluate instead (null: a model forge loads into its generator service)."""
    tasks: list[TaskConfig] = MISSING  # type: ignore[assignment]  (required: forge.config reports it by name)
    """The tasks, each an `apps.grpo` `task` section (keys below, `tasks[i].`), e.g. `[{name: arithmetic}]`; each
    one's held-out set is evaluated. A multi-turn task (`lookup`, openenv, environment) plays each sample as an
    episode against its environment, which scores it (`environment` sets its limits)."""
    num_prompts: int | None = None
    """At most this many held-out prompts per task (null: each task's whole held-out set, its `held_out`)."""
    seed: int = 0
    """The tasks' seed: the same as the training run's to evaluate the held-out set it held out."""
    sampling: SamplingSection = field(default_factory=SamplingSection)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn tasks: each episode's limits, where its environment runs, chat mode (as `apps.grpo`'s section;
    `sampling.max_tokens` bounds each model turn)."""
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(model=""))
    replicas: int = 1
    """Generator service replicas (each its own process)."""
    concurrency: int = 64
    """Prompts in flight at once (generator requests or HTTP requests); tasks are evaluated one after another."""
    progress_every_s: float = 10.0
    """A progress line at most this often while a task is evaluated (0: none)."""
    output_dir: str = "runs/eval"
    """results.json, samples.jsonl (`save_samples`), accuracy.png (several steps), metrics.jsonl."""
    save_samples: bool = False
    """Write every sample (prompt, answer, text, reward or error) to `output_dir/samples.jsonl`."""
    metrics: MetricsConfig = field(default_factory=lambda: MetricsConfig(console=False))

    def __post_init__(self) -> None:
        given = {"checkpoint": self.checkpoint, "run_dir": self.run_dir,
                 "endpoint.base_url": self.endpoint and self.endpoint.base_url}
        sources = [f"{key}={value!r}" for key, value in given.items() if value is not None]
        if len(sources) > 1:
            raise ValueError(f"{', '.join(sources)}: set at most one of checkpoint, run_dir and endpoint (none: "
                             "evaluate `model`)")
        if self.generator.model not in ("", self.model):
            raise ValueError(f"generator.model={self.generator.model!r}: the generator serves `model`; set model "
                             "instead, or leave generator.model out")
        self.generator = replace(self.generator, model=self.model)
        if self.generator.engine == "vllm":  # vLLM's own check of engine_args, as apps.grpo runs it
            try:
                check_engine_args(self.generator.engine_args, device=self.generator.device)
            except (ImportError, ValueError) as e:
                raise ValueError(f"generator.{e}" if str(e).startswith("engine_args") else
                                 f"generator.engine='vllm': {e}") from None
        if not self.tasks:
            raise ValueError("tasks=[]: name at least one task")
        for i, task in enumerate(self.tasks):
            if task.multi_turn and self.endpoint is not None:
                raise ValueError(f"tasks[{i}]: source={task.source!r}, name={task.name!r} is a multi-turn task and "
                                 f"endpoint.base_url={self.endpoint.base_url!r} is set: its episodes are played "
                                 "token in / token out through forge's generator service, which an endpoint is not; "
                                 "evaluate it with model, checkpoint or run_dir")
        for name in ("num_prompts", "replicas", "concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if self.progress_every_s < 0:
            raise ValueError(f"progress_every_s={self.progress_every_s}: must be >= 0 (0: no progress lines)")

    def check(self) -> None:
        """The checks construction leaves out because they read files or the hub: `model` is a checkpoint, its
        tokenizer has a chat template where multi-turn episodes are played in it, and the folders named exist and hold
        what they should. apps/eval/cli.py calls it before anything starts."""
        if not is_hf_checkpoint(self.model):  # `tiny` is resolved to its built folder before this
            raise ValueError(f"model={self.model!r}: must be 'tiny', a Hugging Face checkpoint folder with "
                             "config.json, or a hub id 'org/name'")
        if self.environment.chat_template and any(t.multi_turn for t in self.tasks):
            check_chat_template(self.model)
        self.versions()

    def versions(self) -> list[ModelVersion]:
        """What is evaluated, in order (a run's steps oldest first)."""
        if self.endpoint is not None:
            return [ModelVersion(self.endpoint.base_url, "endpoint", self.endpoint.base_url)]
        if self.checkpoint is not None:
            return [checkpoint_version(self.checkpoint)]
        if self.run_dir is not None:
            base = [ModelVersion("base", "hf", self.model, 0)] if self.include_base else []
            return base + run_checkpoints(self.run_dir)
        return [ModelVersion(model_label(self.model), "hf", self.model)]

    def task_labels(self) -> list[str]:
        """Each task's name in the report: its name, numbered where two tasks share one."""
        names = [t.name if t.source == "forge" else f"{t.source}:{t.name}" for t in self.tasks]
        return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
