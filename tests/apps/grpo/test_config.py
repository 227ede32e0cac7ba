"""Every shipped GRPO config parses and validates on a CPU machine; bad configs fail before any process starts."""

import json
import shutil
from pathlib import Path

import pytest

from actors.model_builder import parallel_dims
from apps.grpo.config import GRPOConfig
from apps.grpo.cli import check_resources, load_job_config
from forge.config import ConfigError, load_config, validate
from rl.tiny_model import write_tiny_config

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

ROOT = Path(__file__).resolve().parents[3]
# The GRPO app's configs (the other apps' configs are tested with those apps).
CONFIGS = sorted([*(ROOT / "configs").glob("grpo_*.yaml"), *(ROOT / "configs").glob("qwen3_*.yaml")])


# The config.json of each real model a shipped config names, with its real values (no hub in tests).
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 40960, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
REAL_CONFIGS = {
    "Qwen/Qwen3-1.7B": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "max_window_layers": 28,
                        "num_attention_heads": 16, "num_hidden_layers": 28, "tie_word_embeddings": True},
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 36,
                      "num_attention_heads": 32, "num_hidden_layers": 36, "tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def real_models(tmp_path_factory) -> dict[str, Path]:
    """A checkpoint folder holding only config.json for each real model: what the pre-spawn checks read."""
    folders = {}
    for hub_id, hf_config in REAL_CONFIGS.items():
        folder = tmp_path_factory.mktemp(hub_id.split("/")[1])
        (folder / "config.json").write_text(json.dumps(hf_config))
        folders[hub_id] = folder
    return folders


def load_with_real_model(path: Path, real_models: dict[str, Path], *overrides: str):
    """A shipped config with its hub model replaced by the folder holding that model's config.json."""
    hub_id = load_config(path)["model"]
    cfg, _ = load_job_config(["--config", str(path), f"model={real_models[hub_id]}", *overrides])
    return cfg


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path, real_models, tmp_path):
    if path.name.startswith("qwen3_"):
        cfg = load_with_real_model(path, real_models)
    elif str(load_config(path)["model"]).startswith("runs/"):  # an earlier run's export (apps.sft's): not in a clone
        cfg, _ = load_job_config(["--config", str(path), f"model={write_tiny_config(tmp_path / 'export')}"])
    else:
        cfg, _ = load_job_config(["--config", str(path)])
    assert cfg.trainer.model_path == cfg.model and cfg.generator.model == cfg.model
    assert cfg.replay_buffer.batch_size % cfg.resources.trainer_procs == 0


QWEN3_1_7B, QWEN3_8B = ROOT / "configs/qwen3_1_7b.yaml", ROOT / "configs/qwen3_8b.yaml"
LAYOUT_REFUSALS = [
    # Qwen3-1.7B ties its embeddings: the trainer's own check (actors.model_layout.check_parallel_layout).
    (QWEN3_1_7B, "resources.trainer_procs=2",
     r"resources.trainer_procs=2: config.json tie_word_embeddings=True with world_size=2: forge does not shard tied "
     r"embeddings \(untested on torchtitan 0.3.0\); use one rank or an untied checkpoint"),
    (QWEN3_1_7B, "resources.reference_procs=2", r"resources.reference_procs=2: config.json tie_word_embeddings=True"),
    (QWEN3_8B, "trainer.tensor_parallel_degree=3",
     r"resources.trainer_procs=3: tensor_parallel_degree=3: must divide config.json num_attention_heads=32"),
    (QWEN3_8B, "trainer.tensor_parallel_degree=2", r"resources.trainer_procs=3: world_size=3: must be a multiple of "
                                                   r"tensor_parallel_degree=2"),
    (QWEN3_8B, "resources.generator_procs=2",
     r"resources.generator_procs=2: must be 1 with generator.engine='vllm' \(one engine per replica; its GPUs come "
     r"from generator.engine_args.tensor_parallel_size\)"),
    (QWEN3_8B, "+generator.engine_args.tensor_parallel_size=3",
     r"generator.engine_args.tensor_parallel_size=3: must divide config.json num_attention_heads=32"),
    (QWEN3_8B, "+generator.engine_args.tensor_parallel_size=2 resources.with_gpus=false",
     r"generator.engine_args.tensor_parallel_size=2: needs resources.with_gpus=true"),
    (QWEN3_8B, "generator.engine_args.max_model_len=50000",
     r"generator.engine_args.max_model_len=50000: must be <= the model's max_position_embeddings=40960"),
    (QWEN3_1_7B, "rollout.max_tokens=2048",
     r"rollout.max_tokens=2048: must be < generator.engine_args.max_model_len=2048"),
    (QWEN3_8B, "trainer.family=llama3",
     r"model='.*' with trainer.family='llama3': config.json model_type='qwen3' is not family 'llama3'"),
]


@pytest.mark.parametrize("path,override,message", LAYOUT_REFUSALS, ids=[f"{p.stem}:{o}" for p, o, _ in LAYOUT_REFUSALS])
def test_layout_is_checked_against_the_models_config_json(path, override, message, real_models):
    with pytest.raises(ConfigError, match=message):
        load_with_real_model(path, real_models, *override.split())


def test_layouts_the_model_allows_are_accepted(real_models):
    # More replicas: the accepted layout is the one the GPU check counts (8 replicas + 3 trainer + 1 reference).
    cfg = load_with_real_model(QWEN3_8B, real_models, "resources.generator_replicas=8")
    with pytest.raises(ConfigError, match=r"needs 12 GPUs \(generator_replicas=8 x generator_procs=1 \+ "
                                          r"trainer_procs=3 \+ reference_procs=1\) but 0 are visible"):
        check_resources(cfg)
    # 4 trainer ranks with TP 2 (32 heads, 8 KV heads): the trainer's mesh is 2 FSDP shards x 2 TP ranks.
    cfg = load_with_real_model(QWEN3_8B, real_models, "resources.trainer_procs=4", "replay_buffer.batch_size=256",
                               "trainer.tensor_parallel_degree=2")
    dims = parallel_dims(cfg.resources.trainer_procs, cfg.trainer.tensor_parallel_degree)  # what the trainer builds
    assert (dims.dp_shard, dims.tp) == (2, 2)


def test_building_the_config_reads_no_file_its_check_step_does(monkeypatch):
    """GRPOConfig's construction does no I/O; `GRPOConfig.check` (run by the cli before anything starts) reads the
    model's config.json, the teacher's and the chat template, and its errors name the field and the value."""
    from actors import model_files

    reads = []
    monkeypatch.setattr(model_files, "read_checkpoint_file", lambda model, name: reads.append((model, name)))
    overrides = ["model=Qwen/Qwen3-1.7B", "environment.chat_template=true"]
    cfg = validate(load_config(ROOT / "configs/grpo_tiny.yaml", overrides), GRPOConfig)
    assert reads == []
    with pytest.raises(ValueError, match=r"^model='Qwen/Qwen3-1.7B': has no config.json"):
        cfg.check()
    assert reads == [("Qwen/Qwen3-1.7B", "config.json")]
    distill = validate(load_config(ROOT / "configs/distill_tiny.yaml", [overrides[0], "teacher.model=/nonexistent/t"]),
                       GRPOConfig)  # a teacher folder that is not there: refused by the check step, not before
    with pytest.raises(ValueError, match=r"^teacher.model='/nonexistent/t': no such folder"):
        distill.check()


def test_an_unreachable_hub_model_is_refused_before_anything_starts(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    with pytest.raises(ConfigError, match=r"model='Qwen/Qwen3-1.7B': cannot read its config.json to check the job"):
        load_job_config(["--config", str(QWEN3_1_7B)])


# The vLLM engine's own check (actors.engines.vllm.check_engine_args), run before anything starts.
ENGINE_ARG_REFUSALS = [
    ("+generator.engine_args.gpu_memory_utilisation=0.5",
     r"generator.engine_args: unknown vLLM engine argument\(s\) \['gpu_memory_utilisation'\]; allowed: the fields "
     r"of vLLM's AsyncEngineArgs"),
    ("+generator.engine_args.dtype=float16", r"generator.engine_args: \['dtype'\] are set by the generator"),
]


@pytest.mark.parametrize("override,message", ENGINE_ARG_REFUSALS, ids=[o for o, _ in ENGINE_ARG_REFUSALS])
def test_vllm_engine_args_must_be_vllm_engine_arguments(override, message, real_models):
    with pytest.raises(ConfigError, match=message):
        load_with_real_model(QWEN3_8B, real_models, override)


def test_vllm_engine_args_that_vllm_takes_are_accepted(real_models):
    cfg = load_with_real_model(QWEN3_8B, real_models, "+generator.engine_args.enable_prefix_caching=false",
                               "+generator.engine_args.enforce_eager=true")
    # The engine gets the shipped engine_args plus the added ones, typed (a string 'false' would be truthy in vLLM).
    shipped = load_config(QWEN3_8B)["generator"]["engine_args"]
    assert cfg.generator.engine_args == {**shipped, "enable_prefix_caching": False, "enforce_eager": True}
    assert shipped and not {"enable_prefix_caching", "enforce_eager"} & set(shipped)  # the merge is exercised


def test_vllm_tensor_parallelism_on_cpu_is_refused_before_anything_starts(real_models):
    with pytest.raises(ConfigError, match=r"generator.engine_args.tensor_parallel_size=2: the "
                                          r"vllm engine runs tensor-parallel on CUDA only"):
        load_with_real_model(QWEN3_8B, real_models, "generator.device=cpu",
                             "+generator.engine_args.tensor_parallel_size=2")


def test_vllm_chunked_prefill_on_cpu_is_refused_with_the_config_naming_the_field_and_why(real_models):
    # forge.compat, 25: refused by the config check, not minutes later when the engine starts in its replica.
    with pytest.raises(ConfigError, match=r"generator\.engine_args\.enable_chunked_prefill=true: on CPU, vLLM's "
                                          r"engine core dies on a seeded request whose prefill is split across engine "
                                          r"steps \(forge\.compat, 25\)"):
        load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "generator.engine=vllm",
                         "+generator.engine_args.enable_chunked_prefill=true"])
    cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "generator.engine=vllm",
                              "+generator.engine_args.enable_chunked_prefill=false"])
    assert cfg.generator.engine_args["enable_chunked_prefill"] is False
    # On CUDA vLLM's default (and a request for it) stands.
    cfg = load_with_real_model(QWEN3_8B, real_models, "+generator.engine_args.enable_chunked_prefill=true")
    assert cfg.generator.device == "cuda" and cfg.generator.engine_args["enable_chunked_prefill"] is True


def test_vllm_samples_at_temperatures_other_than_one():
    # vLLM reports processed log-probs (after temperature), so the behaviour log-probs are the sampled ones.
    cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "generator.engine=vllm"])
    assert cfg.generator.engine == "vllm" and cfg.rollout.temperature == 0.7 == cfg.trainer.temperature


# LoRA with the vLLM engine: every version is a LoRA request, so what vLLM cannot serve is refused with the config,
# before the task is built and the warm start runs (it was found in apps/grpo/launch.py, after both).
VLLM_LORA_REFUSALS = [
    (QWEN3_8B, ["+trainer.lora.rank=1024"], r"trainer\.lora\.rank=1024: vLLM serves LoRA ranks up to 512"),
]


@pytest.mark.parametrize("path,overrides,message", VLLM_LORA_REFUSALS, ids=["rank"])
def test_lora_that_vllm_cannot_serve_is_refused_with_the_config(path, overrides, message, real_models, monkeypatch):
    import apps.grpo.launch as launch
    import apps.grpo.rollouts as rollouts

    def started(*args, **kwargs):
        raise AssertionError("the job started before its LoRA settings were checked")

    monkeypatch.setattr(rollouts, "warm_start_on_task", started)
    monkeypatch.setattr(launch, "start_actors", started)
    with pytest.raises(ConfigError, match=message):
        if path == QWEN3_8B:
            load_with_real_model(path, real_models, *overrides)
        else:
            load_job_config(["--config", str(path), *overrides])


def test_lora_that_vllm_serves_is_accepted(real_models):
    cfg = load_with_real_model(QWEN3_8B, real_models, "+trainer.lora.rank=24")
    assert cfg.generator.engine == "vllm" and cfg.trainer.lora.rank == 24


def test_lora_on_a_hub_models_tied_lm_head_is_refused_before_anything_starts(monkeypatch):
    # A hub id has no local config.json for TrainerConfig to read: the job's check reads the fetched one.
    from actors import model_files

    monkeypatch.setattr(model_files, "read_hf_config", lambda model: REAL_CONFIGS["Qwen/Qwen3-1.7B"])
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules=\['q_proj', 'lm_head'\]: 'lm_head' is tied "
                                          r"to the input embedding in this model"):
        load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "model=Qwen/Qwen3-1.7B",
                         "+trainer.lora.target_modules=[q_proj,lm_head]"])


def test_lora_from_an_init_checkpoint_is_refused(tmp_path):
    # The generators merge each adapter onto `model`'s weights: a trainer base from init_checkpoint would not be it.
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"trainer\.init_checkpoint='.*' with trainer\.lora: a LoRA version publishes "
                                          r"the adapter only, and the generators merge it onto model="):
        load_job_config(["--config", str(ROOT / "configs/grpo_tiny_lora.yaml"), f"trainer.init_checkpoint={tmp_path}"])


def test_the_reference_model_starts_from_the_trainers_init_checkpoint(tmp_path):
    from apps.grpo.launch import reference_config

    (tmp_path / ".metadata").write_bytes(b"")
    cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "reference.enabled=true",
                              f"trainer.init_checkpoint={tmp_path}"])
    ref = reference_config(cfg, cfg.model)
    assert ref.init_checkpoint == str(tmp_path) and ref.model_path == cfg.model
    assert (ref.family, ref.dtype, ref.temperature) == (cfg.trainer.family, cfg.trainer.dtype, cfg.trainer.temperature)


def test_gsm8k_job_asks_in_the_models_chat_template_and_stops_at_its_end_of_turn(real_models, tmp_path):
    from apps.grpo.launch import make_task
    from rl.tiny_model import build_tokenizer

    model = tmp_path / "Qwen3-1.7B"  # the real config.json beside a small tokenizer with a ChatML template
    shutil.copytree(real_models["Qwen/Qwen3-1.7B"], model)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer.save_pretrained(model)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join([json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"})] * 2))
    cfg, _ = load_job_config(["--config", str(QWEN3_1_7B), f"model={model}", f"task.dataset={data}", "task.held_out=1"])
    task = make_task(cfg)
    assert task.held_out()[0].prompt == ("<|im_start|>user\nWhat is 2+3?\nThink step by step, then give the final "
                                         "answer after '####'.<|im_end|>\n<|im_start|>assistant\n")
    assert task.stop_token_ids == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_gpu_layouts_need_their_gpus(real_models):
    cfg = validate(load_config(QWEN3_8B, [f"model={real_models['Qwen/Qwen3-8B']}"]), GRPOConfig)
    with pytest.raises(ConfigError, match=r"the layout needs 8 GPUs .* but 0 are visible"):
        check_resources(cfg)
    # A tensor-parallel vLLM replica: one process with tensor_parallel_size GPUs (forge.provisioner gpus_per_proc).
    cfg = load_with_real_model(QWEN3_8B, real_models, "resources.generator_replicas=4",
                               "+generator.engine_args.tensor_parallel_size=2")
    assert cfg.generator_gpus_per_proc == 2
    with pytest.raises(ConfigError, match=r"needs 12 GPUs \(generator_replicas=4 x generator_procs=1 x "
                                          r"tensor_parallel_size=2 \+ trainer_procs=3 \+ reference_procs=1\)"):
        check_resources(cfg)


# Each message: the key, the value as parsed, and the reason with what is allowed (every ConfigError starts with
# `key=value:`, so the reason is what tells this refusal from an "unknown key" one).
BAD = [
    ("replay_buffer.max_policy_age=-1",
     r"replay_buffer\.max_policy_age=-1: must be an int >= 0 \(0 = strictly on-policy\)"),
    ("replay_buffer.batch_sise=8",
     r"replay_buffer\.batch_sise=8: unknown key\. Did you mean 'replay_buffer\.batch_size'\? "
     r"Allowed keys in replay_buffer: batch_size, "),
    ("trainer.lr=fast", r"trainer\.lr='fast': expected float, got str"),
    ("trainer.lr=-1", r"trainer\.lr=-1\.0: must be a number > 0"),
    ("rollout.group_size=1", r"rollout\.group_size=1: must be from 2 \(advantages are relative to the group\) to 65536"),
    ("rollout.group_size=70000", r"rollout\.group_size=70000: must be from 2 .* to 65536"),
    ("+generator.engine_args.max_model_len=64",
     r"generator\.engine_args=\{'max_model_len': 64\}: the hf engine has no \['max_model_len'\]; it takes \['kv_reuse_tokens'\]"),
    ("+generator.engine_args.kv_reuse_tokens=-1", r"generator\.engine_args\.kv_reuse_tokens=-1: must be an int >= 0"),
    ("steps=0", r"steps=0: must be >= 1"),
    ("resources.trainer_procs=3", r"replay_buffer\.batch_size=1024: must be divisible by resources\.trainer_procs=3 "),
    ("task.name=chess", r"task\.name='chess': must be one of 'arithmetic', 'gsm8k'"),
    ("task.reward=not_a_reference", r"task\.reward='not_a_reference': must be 'package\.module:function'"),
    ("trainer.loss=ppo2", r"trainer\.loss='ppo2': unknown; must be one of grpo, dapo, gspo, cispo, dr_grpo, distill, or "
                          r"'package\.module:function'"),
    ("generator.engine=sglang", r"generator\.engine='sglang': must be one of hf, vllm"),
    ("model=/no/such/model", r"trainer\.model_path='/no/such/model': must be a Hugging Face checkpoint folder with "
                             r"config\.json, or a hub id 'org/name'"),
    ("trainer.temperature=0.5", r"trainer\.temperature=0\.5: must equal rollout\.temperature=0\.7"),
    ("replay_buffer.max_buffer_size=8", r"replay_buffer\.max_buffer_size=8: must be None or an int >= batch_size=1024"),
    ("eval.num_prompts=0", r"eval\.num_prompts=0: must be >= 1"),
    ("warm_start.target_accuracy=1.5", r"warm_start\.target_accuracy=1\.5: must be in \(0, 1\]"),
    ("trainer.micro_batch_size=0", r"trainer\.micro_batch_size=0: must be an int >= 1"),
    ("rollout.max_tokens=-4", r"rollout\.max_tokens=-4: must be >= 1"),
    # trainer.temperature is ${rollout.temperature} in the YAML: the key the user set is the one named.
    ("rollout.temperature=0", r"rollout\.temperature=0\.0: must be > 0 for sampling"),
    ("rollout.top_p=1.5", r"rollout\.top_p=1\.5: must be in \(0, 1\]"),
    ("rollout.max_dropped_groups_per_step=3",
     r"rollout\.max_dropped_groups_per_step=3: budgets dropped groups, but drop_zero_variance_groups is false"),
    ("rollout.drop_zero_variance_groups=true rollout.max_dropped_groups_per_step=0",
     r"rollout\.max_dropped_groups_per_step=0: must be >= 1 \(or unset: no budget\)"),
    ("replay_buffer.batch_size=24", r"replay_buffer\.batch_size=24: must be a multiple of rollout\.group_size=16 "),
    ("trainer.minibatches=3", r"trainer\.minibatches=3: replay_buffer\.batch_size=1024 must split into minibatches x "
                              r"resources\.trainer_procs=3 equal slices"),
    ("trainer.dtype=float8", r"trainer\.dtype='float8': must be one of float32, bfloat16"),
    ("trainer.loss_params.clip_eps=-0.1", r"trainer\.loss_params \(grpo\): clip_eps=-0\.1: must be a number > 0"),
    ("trainer.loss_params.bogus=1", r"trainer\.loss_params=\{.*\}: \['bogus'\] not taken by loss 'grpo'; allowed: "
                                    r"\['clip_eps', 'kl_coef', 'kl_estimator', 'seq_mask_band', 'tis_cap', "
                                    r"'token_mask_band'\]"),
    ("trainer.loss=dr_grpo", r"trainer\.loss='dr_grpo' with rollout\.normalize_advantages=True: Dr\. GRPO's advantage is "
                             r"mean-centred only .*; set rollout\.normalize_advantages=false"),
    ("+trainer.loss_params.token_mask_band=[5.0,0.5]",
     r"trainer\.loss_params \(grpo\): token_mask_band=\[5\.0, 0\.5\]: must be None \(off\) or \[low, high\] with "
     r"0 <= low < high"),
    ("+trainer.loss_params.seq_mask_band=0.9",
     r"trainer\.loss_params \(grpo\): seq_mask_band=0\.9: must be None \(off\) or \[low, high\] with 0 <= low < high"),
    ("steps=many", r"steps='many': expected int, got str"),
    ("+no_such_section.key=1", r"no_such_section=\{'key': 1\}: unknown key\. Allowed keys: generator, trainer, "),
    ("checkpoint.keep=0", r"checkpoint\.keep=0: must be >= 1"),
    ("checkpoint.stop_grace_s=0", r"checkpoint\.stop_grace_s=0(\.0)?: must be > 0 \(seconds\)"),
    ("generator.max_batch_size=0", r"generator\.max_batch_size=0: must be >= 1"),
    ("task.source=openenv task.name=tests.rl.environments.openenv_guess:GuessEnvironment",
     r"warm_start\.enabled=true: task\.source='openenv' task\.name='tests\.rl\.environments\.openenv_guess:GuessEnvironment' has no correct episodes to warm start from"),
    ("task.source=environment task.name=tests.rl.tasks.environment_classes:Good",
     r"warm_start\.enabled=true: task\.source='environment' task\.name='tests\.rl\.tasks\.environment_classes:Good' has no correct episodes to warm start from"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_refused_with_the_key_and_value(override, message):
    with pytest.raises(ConfigError, match=message):
        cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), *override.split()])
        check_resources(cfg)


# A reward that does not import is found by validation (TaskConfig loads it, before the model's layout check, so
# it answers without TorchTitan; tests/apps/grpo/test_cli.py checks the imports).
BAD_REWARDS = [
    ("task.reward=no_such_module:score", r"task\.reward='no_such_module:score': cannot import module 'no_such_module' "
                                         r"\(No module named 'no_such_module'\)"),
    ("task.reward=rl.tasks:no_such_fn", r"task\.reward='rl\.tasks:no_such_fn': module 'rl\.tasks' has no "
                                           r"callable 'no_such_fn'"),
]


@pytest.mark.parametrize("override,message", BAD_REWARDS, ids=[b[0] for b in BAD_REWARDS])
def test_a_reward_that_cannot_be_loaded_is_refused_before_anything_starts(override, message):
    with pytest.raises(ValueError, match=message):
        load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), override])


def test_asking_for_gpus_on_a_cpu_host_fails_naming_the_layout():
    cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "resources.with_gpus=true"])
    with pytest.raises(ConfigError, match=r"needs 2 GPUs \(generator_replicas=1 x generator_procs=1 \+ trainer_procs=1\) but 0"):
        check_resources(cfg)


def test_dr_grpo_runs_with_mean_centred_advantages_and_the_rollout_corrections_parse():
    cfg, _ = load_job_config(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "trainer.loss=dr_grpo",
                              "rollout.normalize_advantages=false", "trainer.loss_params.tis_cap=5.0",
                              "+trainer.loss_params.token_mask_band=[0.5,5.0]", "+trainer.loss_params.seq_mask_band=[0.9,1.1]"])
    assert cfg.trainer.loss_params == {"clip_eps": 0.2, "tis_cap": 5.0, "token_mask_band": [0.5, 5.0],
                                       "seq_mask_band": [0.9, 1.1]}
