"""`environment.chat_template` from the command line: read as a bool, checked with the job before anything starts."""

import json

import pytest

from apps.grpo.cli import load_job_config
from forge.config import ConfigError
from rl.tiny_model import write_tiny_config


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    return str(write_tiny_config(tmp_path_factory.mktemp("tiny")))  # config.json only: no checkpoint is built


@pytest.fixture(scope="module")
def chat_config(tmp_path_factory) -> str:
    """The tiny model's config.json with a tokenizer_config.json that has a chat template."""
    folder = write_tiny_config(tmp_path_factory.mktemp("chat"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return str(folder)


def job(tiny_config: str, *overrides: str):
    cfg, _ = load_job_config(["--config", "configs/multiturn_tiny.yaml", f"model={tiny_config}", *overrides])
    return cfg


def test_chat_mode_is_off_unless_asked_and_reads_from_the_command_line(tiny_config, chat_config):
    assert not job(tiny_config).environment.chat_template
    cfg = job(chat_config, "environment.chat_template=true", "warm_start.enabled=false",
              "environment.system_prompt=Ask for the digit, then add.")
    assert cfg.environment.chat_template and cfg.environment.system_prompt == "Ask for the digit, then add."


@pytest.mark.parametrize("overrides, message", [
    (["environment.chat_template=maybe"], "environment.chat_template='maybe': expected bool"),
    (["environment.system_prompt=hi"], "environment.system_prompt='hi': a system message needs chat_template=true"),
    (["environment.chat_template=true"], "environment.chat_template=true: the multi-turn warm start trains and "
                                         "evaluates the task's plain-text transcripts"),
])
def test_bad_chat_settings_are_refused_naming_the_key(tiny_config, overrides, message):
    with pytest.raises(ConfigError) as error:
        job(tiny_config, *overrides)
    assert message in str(error.value)


def test_chat_mode_with_a_tokenizer_without_a_chat_template_is_refused_before_anything_starts(tiny_config):
    """forge's tiny tokenizer has no chat template: found when the config is read, not after every actor started."""
    with pytest.raises(ConfigError) as error:
        job(tiny_config, "environment.chat_template=true", "warm_start.enabled=false")
    assert f"environment.chat_template=true: the tokenizer of model={tiny_config!r} has no chat template" in str(
        error.value)
