"""Every shipped GRPO config parses and validates on a CPU machine; bad configs fail before any process starts."""

from pathlib import Path

import pytest

from apps.grpo.config import GRPOConfig
from apps.grpo.main import check_resources, load_job_config
from forge.config import ConfigError, load_config, validate

ROOT = Path(__file__).resolve().parents[2]
# The GRPO app's configs (the other apps' configs are tested with those apps).
CONFIGS = sorted([*(ROOT / "configs").glob("grpo_*.yaml"), *(ROOT / "configs").glob("qwen3_*.yaml")])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    cfg, _ = load_job_config(["--config", str(path)])
    assert cfg.trainer.model_path == cfg.model and cfg.generator.model == cfg.model
    assert cfg.replay_buffer.batch_size % cfg.resources.trainer_procs == 0


def test_gpu_layouts_need_their_gpus():
    cfg = validate(load_config(ROOT / "configs/qwen3_8b.yaml"), GRPOConfig)
    with pytest.raises(ConfigError, match=r"the layout needs 8 GPUs .* but 0 are visible"):
        check_resources(cfg)


BAD = [
    ("replay_buffer.max_policy_age=-1", r"replay_buffer.max_policy_age=-1"),
    ("replay_buffer.batch_sise=8", r"replay_buffer.batch_sise=8: unknown key. Did you mean 'replay_buffer.batch_size'"),
    ("trainer.lr=fast", r"trainer.lr='fast'"),
    ("trainer.lr=-1", r"trainer.lr=-1"),
    ("rollout.group_size=1", r"rollout.group_size=1: must be >= 2"),
    ("steps=0", r"steps=0: must be >= 1"),
    ("resources.trainer_procs=3", r"replay_buffer.batch_size=\d+: must be divisible by resources.trainer_procs=3"),
    ("task.name=chess", r"task.name='chess': must be one of 'arithmetic', 'gsm8k'"),
    ("task.reward=not_a_reference", r"task.reward='not_a_reference': must be 'package.module:function'"),
    ("trainer.loss=ppo2", r"loss='ppo2'"),
    ("generator.engine=sglang", r"generator.engine='sglang': must be one of hf, vllm"),
    ("model=/no/such/model", r"model_path='/no/such/model'"),
    ("trainer.temperature=0.5", r"trainer.temperature=0.5: must equal rollout.temperature=0.7"),
    ("generator.engine=vllm", r"rollout.temperature=0.7: generator.engine='vllm' samples at 1.0 only"),
    ("replay_buffer.max_buffer_size=8", r"max_buffer_size=8"),
    ("eval.num_prompts=0", r"num_prompts=0"),
    ("warm_start.target_accuracy=1.5", r"warm_start.target_accuracy=1.5: must be in \(0, 1\]"),
    ("trainer.micro_batch_size=0", r"micro_batch_size=0"),
    ("rollout.max_tokens=-4", r"rollout.max_tokens=-4: must be >= 1"),
    ("rollout.temperature=0", r"temperature=0(\.0)?: must be (a number )?> 0"),
    ("rollout.top_p=1.5", r"rollout.top_p=1.5: must be in \(0, 1\]"),
    ("replay_buffer.batch_size=24", r"replay_buffer.batch_size=24: must be a multiple of rollout.group_size=16"),
    ("trainer.minibatches=3", r"trainer.minibatches=3: replay_buffer.batch_size=1024 must split into"),
    ("trainer.dtype=float8", r"dtype='float8': must be one of float32, bfloat16"),
    ("trainer.loss_params.clip_eps=-0.1", r"clip_eps=-0.1"),
    ("trainer.loss_params.bogus=1", r"bogus"),
    ("task.reward=no_such_module:score", r"task.reward='no_such_module:score': cannot import module 'no_such_module'"),
    ("task.reward=forge.tasks:no_such_fn", r"task.reward='forge.tasks:no_such_fn': module 'forge.tasks' has no callable"),
    ("steps=many", r"steps='many'"),
    ("+no_such_section.key=1", r"no_such_section.*unknown key"),
    ("checkpoint.keep=0", r"keep=0 >= 1"),
    ("generator.max_batch_size=0", r"max_batch_size=0"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_refused_with_the_key_and_value(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), override])
        check_resources(cfg)


def test_asking_for_gpus_on_a_cpu_host_fails_naming_the_layout():
    cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "resources.with_gpus=true"])
    with pytest.raises(ConfigError, match=r"needs 2 GPUs \(generator_replicas=1 x generator_procs=1 \+ trainer_procs=1\) but 0"):
        check_resources(cfg)
