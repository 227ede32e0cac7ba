"""apps.eval's config: every error names the key, the value and what is allowed, before anything starts (pure)."""

import pytest

from apps.eval.cli import load_eval_config, main
from apps.eval.sources import checkpoint_version, run_checkpoints
from forge.config import ConfigError
from tests.apps.grpo.test_cli import probe  # `python -m` in a subprocess: its exit code and heavy imports

CONFIG = "configs/eval_tiny.yaml"


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_eval_config(["--config", CONFIG, *overrides])
    return str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["sampling.temperature=0"], "sampling.num_samples=8: with temperature=0 (greedy) every sample is the same"),
    (["sampling.pass_k=[1,9]"], "sampling.pass_k=[1, 9]: each k must be from 1 to num_samples=8"),
    (["sampling.top_p=0"], "sampling.top_p=0.0: must be in (0, 1]"),
    (["concurrency=0"], "concurrency=0: must be >= 1"),
    (["num_prompts=0"], "num_prompts=0: must be >= 1"),
    (["concurency=3"], "concurency=3: unknown key. Did you mean 'concurrency'?"),
    (["tasks=[{name: arithmetic}, {name: lookup}]", "+endpoint.base_url=http://127.0.0.1:1/v1"],
     "tasks[1]: source='forge', name='lookup' is a multi-turn task and endpoint.base_url='http://127.0.0.1:1/v1' is "
     "set: its episodes are played token in / token out through forge's generator service"),
    (["tasks=[{name: lookup}]", "environment.chat_template=true"],
     "environment.chat_template=true: the tokenizer of model="),
    (["environment.max_turns=0"], "environment.max_turns=0: must be >= 1"),
    (["tasks=[{name: nope}]"], "tasks[0].name='nope': must be one of 'arithmetic', 'gsm8k', 'lookup'"),
    (["tasks=[]"], "tasks=[]: name at least one task"),
    (["model=/nonexistent/model"], "model='/nonexistent/model': must be 'tiny', a Hugging Face checkpoint folder with "
                                   "config.json, or a hub id 'org/name'"),
    (["run_dir=/nonexistent/run"], "run_dir='/nonexistent/run': no such folder"),
    (["checkpoint=/nonexistent/step_000010"], "checkpoint='/nonexistent/step_000010': no such folder"),
    (["+endpoint.base_url=ftp://host"], "endpoint.base_url='ftp://host': must be an http:// or https:// URL"),
    (["+endpoint.api=grpc"], "endpoint.api='grpc': must be one of 'completions', 'chat'"),
    (["+endpoint.model=m"], "endpoint.base_url: required value is missing"),
    (["generator.model=/elsewhere"], "generator.model='/elsewhere': the generator serves `model`"),
    (["generator.engine=tgi"], "generator.engine='tgi': must be one of hf, vllm"),
    (["generator.engine=vllm", "+generator.engine_args.foo=1"],
     "generator.engine_args: unknown vLLM engine argument(s) ['foo']"),
])
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(overrides, message):
    assert message in refused(*overrides)


def test_building_the_config_reads_no_file_its_check_step_does():
    """EvalJobConfig's construction looks at no folder: the model and the run directory are `EvalJobConfig.check`'s
    (run by the cli before anything starts), its errors naming the key and the value."""
    from apps.eval.config import EvalJobConfig
    from forge.config import load_config, validate

    cfg = validate(load_config(CONFIG, ["model=/nonexistent/model", "run_dir=/nonexistent/run"]), EvalJobConfig)
    with pytest.raises(ValueError, match=r"^model='/nonexistent/model': must be 'tiny', a Hugging Face checkpoint"):
        cfg.check()
    cfg.model = "org/name"  # a hub id: the run directory is looked at next
    with pytest.raises(ValueError, match=r"^run_dir='/nonexistent/run': no such folder"):
        cfg.check()


def test_two_sources_are_refused_naming_both(tmp_path):
    assert refused(f"checkpoint={tmp_path}", "+endpoint.base_url=http://127.0.0.1:1/v1") == (
        f"checkpoint='{tmp_path}', endpoint.base_url='http://127.0.0.1:1/v1': set at most one of checkpoint, run_dir "
        "and endpoint (none: evaluate `model`)")


def test_tasks_are_required():
    with pytest.raises(ConfigError, match=r"tasks: required value is missing"):
        load_eval_config([])


def test_a_run_dir_without_complete_checkpoints_is_refused(tmp_path):
    (tmp_path / "checkpoints" / "step_000010.partial" / "trainer").mkdir(parents=True)  # a save that never finished
    (tmp_path / "checkpoints" / "step_000020" / "trainer").mkdir(parents=True)  # no checksums.json: incomplete
    message = refused(f"run_dir={tmp_path}")
    assert f"run_dir='{tmp_path}': holds no complete step checkpoint" in message


def test_checkpoint_layouts(tmp_path):
    step = tmp_path / "checkpoints" / "step_000020"
    (step / "trainer").mkdir(parents=True)
    (step / "trainer" / "checksums.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_000005" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000005" / "trainer" / "checksums.json").write_text("{}")
    assert checkpoint_version(str(step)) == checkpoint_version(str(step / "trainer"))
    assert checkpoint_version(str(step)).step == 20 and checkpoint_version(str(step)).kind == "checkpoint"
    assert [v.label for v in run_checkpoints(str(tmp_path))] == ["step_000005", "step_000020"]
    assert [v.step for v in run_checkpoints(str(tmp_path / "checkpoints"))] == [5, 20]  # the folder itself
    lora = tmp_path / "hf_lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"checkpoint='.*hf_lora': a LoRA adapter \(peft\) folder"):
        checkpoint_version(str(lora))
    with pytest.raises(ValueError, match=r"neither a step checkpoint"):
        checkpoint_version(str(tmp_path))


def test_a_config_error_exits_2_before_torch_or_monarch_is_imported():
    outcome, result = probe("--config", CONFIG, "sampling.max_tokens=0", module="apps.eval")
    assert outcome == {"exit": 2, "heavy": []}, result.stderr
    assert result.stderr.strip() == "config error: sampling.max_tokens=0: must be >= 1"


def test_help_prints_every_key(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for key in ("`sampling.num_samples`", "`run_dir`", "`endpoint.base_url`", "`tasks[i].name`", "`concurrency`"):
        assert key in text
