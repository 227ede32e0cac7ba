"""On-policy distillation's config: a teacher for the distill loss only, one the student's token ids fit, checked
before anything starts; `teacher.model: warm_start` is the student's warm start trained on further."""

import json
import shutil
from pathlib import Path

import pytest

from apps.grpo.cli import load_job_config
from forge.config import ConfigError

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

ROOT = Path(__file__).resolve().parents[3]
DISTILL = str(ROOT / "configs/distill_tiny.yaml")
SAMPLED_KL = ["trainer.loss_params.kl=sampled", "teacher.top_k=0"]  # an engine teacher hands over no top-k


def load(*overrides: str):
    return load_job_config(["--config", DISTILL, *overrides])[0]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return Path(load().model)


def teacher_folder(tmp_path: Path, tiny: Path, *, config: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A copy of the tiny checkpoint's config.json and tokenizer files (no weights: the checks read no more)."""
    folder = tmp_path / "teacher"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, folder / name)
    if config is not None:
        (folder / "config.json").write_text(json.dumps({**json.loads((tiny / "config.json").read_text()), **config}))
    if tokenizer is not None:
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_the_distill_config_has_a_warm_start_teacher_and_the_distill_loss():
    cfg = load()
    assert (cfg.trainer.loss, cfg.teacher.model, cfg.reference.enabled) == ("distill", "warm_start", False)
    assert cfg.teacher.warm_start_accuracy > cfg.warm_start.target_accuracy  # a stronger teacher than the student


@pytest.mark.parametrize("task", [["task.name=gsm8k"], ["task.source=reasoning_gym", "task.name=spell_backward"]])
def test_a_warm_start_teacher_is_accepted_for_every_task_with_answers(task):
    assert load(*task).teacher.model == "warm_start"  # the student's warm start takes these tasks: so does the teacher


@pytest.mark.parametrize(("overrides", "message"), [
    (["teacher.model=null"], r"^trainer\.loss='distill': needs a teacher to distill from; set teacher\.model"),
    (["trainer.loss=grpo", "~trainer.loss_params.reward_coef", "~trainer.loss_params.kl", "teacher.top_k=0"],
     r"^teacher\.model='warm_start' with trainer\.loss='grpo': only trainer\.loss='distill' trains toward a teacher"),
    (["reference.enabled=true"], r"^teacher\.model='warm_start' with reference\.enabled=true: the teacher's log-probs "
                                 r"take the reference model's place"),
    (["task.source=environment", "task.name=tests.rl.tasks.environment_classes:Good", "warm_start.enabled=false"],
     r"^teacher\.model='warm_start': task\.source='environment' task\.name='tests\.rl\.tasks\.environment_classes:Good' "
     r"has no correct episodes to warm start a teacher from"),
    (["teacher.model=runs/no/such/teacher"], r"^teacher\.model='runs/no/such/teacher': no such folder"),
    (["teacher.warm_start_accuracy=1.5"], r"^teacher\.warm_start_accuracy=1\.5: must be in \(0, 1\]"),
    (["trainer.loss_params.reward_coef=-1"], r"reward_coef=-1: must be a number >= 0"),
    (["teacher.engine=tgi"], r"^teacher\.engine='tgi': must be one of titan, hf, vllm"),
    (["+teacher.engine_args.kv_reuse_tokens=0"], r"^teacher\.engine_args=\{'kv_reuse_tokens': 0\}: only an hf or "
                                                 r"vllm teacher takes engine arguments"),
    (["teacher.engine=hf", "+teacher.engine_args.max_model_len=64"],
     r"^teacher\.engine_args=\{'max_model_len': 64\}: the hf engine has no \['max_model_len'\]"),
    (["teacher.engine=vllm", "rollout.temperature=1", "+teacher.engine_args.foo=1"],
     r"^teacher\.engine_args: unknown vLLM engine argument\(s\) \['foo'\]"),
    (["teacher.engine=vllm"],
     r"^teacher\.engine='vllm' with rollout\.temperature=0\.7: the vllm teacher scores at temperature 1 \(raw-logit"),
    (["teacher.engine=hf", "rollout.top_p=0.9"],
     r"^teacher\.engine='hf' with rollout\.top_p=0\.9: the hf teacher scores over the full vocabulary"),
    (["++trainer.loss_params.kl=forward", "teacher.top_k=0"],
     r"^trainer\.loss_params\.kl='forward' with teacher\.top_k=0: the KL over the vocabulary at each position needs "
     r"the teacher's top-k"),
    (["++trainer.loss_params.kl=sampled", "teacher.top_k=5"],
     r"^teacher\.top_k=5 with trainer\.loss_params\.kl='sampled': only kl=reverse or forward use the teacher's top-k"),
    (["++trainer.loss_params.kl=reverse", "teacher.top_k=100", "teacher.engine=hf"],
     r"^teacher\.top_k=100 with teacher\.engine='hf': only the titan teacher hands over its top-k"),
    (["++trainer.loss_params.kl=reverse", "teacher.top_k=100", "rollout.top_p=0.9"],
     r"^teacher\.top_k=100 with rollout\.top_p=0\.9: the per-position KL compares full-vocabulary distributions"),
    (["teacher.top_k=-1"], r"^teacher\.top_k=-1: must be an int >= 0"),
    (["++trainer.loss_params.kl=exact"], r"kl='exact': must be one of sampled, reverse, forward"),
])
def test_bad_distillation_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(*overrides)


def test_a_teacher_checkpoint_with_the_students_tokenizer_is_accepted_and_scored_as_the_trainer_scores(tmp_path, tiny):
    from apps.grpo.launch import teacher_config

    folder = teacher_folder(tmp_path, tiny, config={"num_hidden_layers": 4})  # a bigger teacher, same tokenizer
    cfg = load(f"teacher.model={folder}")
    teacher = teacher_config(cfg, cfg.teacher.model)
    assert teacher.model_path == str(folder) and teacher.init_checkpoint is None  # its own weights, not the student's
    assert (teacher.family, teacher.dtype, teacher.temperature) == (cfg.trainer.family, cfg.trainer.dtype,
                                                                     cfg.trainer.temperature)


def test_an_engine_teacher_of_another_family_is_accepted(tmp_path, tiny):
    folder = teacher_folder(tmp_path, tiny, config={"model_type": "mistral"})  # no family TorchTitan builds here
    with pytest.raises(ConfigError, match=r"^teacher\.model='.*' \(built as trainer\.family='qwen3'\)"):
        load(f"teacher.model={folder}")
    cfg = load(f"teacher.model={folder}", "teacher.engine=hf", *SAMPLED_KL)
    engine = cfg.teacher_engine(str(folder))
    assert (engine.model, engine.engine, engine.dtype) == (str(folder), "hf", cfg.generator.dtype)
    # tests/apps/grpo/test_distill_run.py runs one (its log names the engine)


def test_a_teacher_whose_token_ids_mean_other_text_is_refused(tmp_path, tiny):
    tokenizer = json.loads((tiny / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    folder = teacher_folder(tmp_path, tiny, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=rf"^teacher\.model='{folder}' \(built as trainer\.family='qwen3'\): its "
                                          rf"tokenizer differs from the student's .* on 2 token ids \(id {vocab['b']}: "
                                          r"'b', the student's 'a'\): distillation compares"):
        load(f"teacher.model={folder}")


def test_without_a_tokenizer_file_the_vocabulary_sizes_must_agree(tmp_path, tiny):
    folder = teacher_folder(tmp_path, tiny, config={"vocab_size": 1000})
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"vocab_size=1000, the student's \(model=.*\) is \d+: distillation"):
        load(f"teacher.model={folder}")


def test_a_teacher_the_trainers_family_cannot_build_is_refused(tmp_path, tiny):
    folder = teacher_folder(tmp_path, tiny, config={"model_type": "llama"})
    with pytest.raises(ConfigError, match=rf"^teacher\.model='{folder}' \(built as trainer\.family='qwen3'\): "
                                          r"config\.json model_type='llama' is not family 'qwen3'"):
        load(f"teacher.model={folder}")


def test_a_warm_start_teacher_is_the_students_warm_start_trained_to_the_teachers_accuracy(monkeypatch):
    import apps.grpo.rollouts as rollouts
    from apps.grpo.launch import make_task

    trained = []

    def warm_start_on_task(model, model_cache, task, config, **kwargs):
        trained.append(config)
        return f"warm-{config.target_accuracy}", config.target_accuracy

    monkeypatch.setattr(rollouts, "warm_start_on_task", warm_start_on_task)
    cfg = load("warm_start.enabled=false", "teacher.warm_start_accuracy=0.7")
    task = make_task(cfg)
    assert rollouts.teacher_model(cfg, task) == ("warm-0.7", 0.7)
    assert rollouts.warm_started_model(cfg, task) == (cfg.model, None)  # the student is not warm-started here
    (settings,) = trained
    assert settings.enabled and (settings.lr, settings.batch_size) == (cfg.warm_start.lr, cfg.warm_start.batch_size)


def test_a_teacher_folder_is_used_as_given(tmp_path, tiny):
    from apps.grpo.launch import make_task
    from apps.grpo.rollouts import teacher_model

    folder = teacher_folder(tmp_path, tiny)
    cfg = load(f"teacher.model={folder}")
    assert teacher_model(cfg, make_task(cfg)) == (str(folder), None)


def test_a_tensor_parallel_vllm_teacher_counts_its_gpus_in_the_layout(monkeypatch):
    import torch

    from apps.grpo.cli import check_resources

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # one short of the layout, on any host
    cfg = load("resources.with_gpus=true", "generator.device=cuda", "trainer.device=cuda", "teacher.engine=vllm",
               "rollout.temperature=1", "+teacher.engine_args.tensor_parallel_size=2", *SAMPLED_KL)
    assert cfg.scorer_gpus == 2
    with pytest.raises(ConfigError, match=r"needs 4 GPUs \(generator_replicas=1 x generator_procs=1 \+ trainer_procs=1 "
                                          r"\+ the vllm teacher's 2\) but 3 are visible"):
        check_resources(cfg)
