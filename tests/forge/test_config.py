"""Tests for forge.config: YAML + overrides, interpolation, and validation against a dataclass schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from omegaconf import MISSING, OmegaConf

from forge.config import ConfigError, load_config, parse_args, to_yaml, validate


# An example schema, shaped like an app's (the real app schemas live with the apps).
@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class TrainerConfig:
    steps: int = MISSING
    lr: float = 1e-3
    compile: bool = False
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


@dataclass
class ReplayBufferConfig:
    max_policy_age: int = 1

    def __post_init__(self) -> None:
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age={self.max_policy_age}: must be >= 0 (0 = on-policy)")


@dataclass
class GeneratorConfig:
    engine: Literal["hf", "vllm"] = "hf"
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class AppConfig:
    model: str
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    generators: list[GeneratorConfig] = field(default_factory=lambda: [GeneratorConfig()])


YAML = """
model: tiny
trainer:
  steps: 10
  lr: 1e-3
  optimizer:
    lr: ${trainer.lr}
replay_buffer:
  max_policy_age: 1
generators:
  - engine: hf
    stop_token_ids: [0, 2]
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "app.yaml"
    path.write_text(YAML)
    return path


def check(raw: dict):
    return validate(OmegaConf.create(raw), AppConfig)


def error_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        check(raw)
    return str(info.value)


# ---- loading and overrides -------------------------------------------------------------------------


def test_load_builds_nested_dataclasses_with_interpolation_resolved(config_file):
    cfg = validate(load_config(config_file), AppConfig)
    assert isinstance(cfg.trainer.optimizer, OptimizerConfig)
    assert cfg.trainer.steps == 10 and cfg.trainer.optimizer.lr == pytest.approx(1e-3)
    assert cfg.trainer.optimizer.betas == [0.9, 0.999]
    assert cfg.generators == [GeneratorConfig(engine="hf", stop_token_ids=[0, 2])]


def test_override_changes_value_and_interpolation_follows_it(config_file):
    cfg = load_config(config_file, ["trainer.lr=3e-4", "replay_buffer.max_policy_age=0"])
    assert cfg.trainer.optimizer.lr == pytest.approx(3e-4)
    assert cfg.replay_buffer.max_policy_age == 0


def test_plus_adds_a_key_and_tilde_deletes_one(config_file):
    cfg = load_config(config_file, ["+trainer.warmup=5", "+logging.dir=/tmp/x", "~replay_buffer.max_policy_age"])
    assert cfg.trainer.warmup == 5 and cfg.logging.dir == "/tmp/x"
    assert "max_policy_age" not in cfg.replay_buffer
    # The deleted key falls back to the schema default.
    del cfg.trainer.warmup, cfg.logging
    assert validate(cfg, AppConfig).replay_buffer.max_policy_age == 1


def test_a_missing_value_counts_as_an_existing_key():
    cfg = load_config(None, ["+model=m", "+trainer.steps=???"])
    assert OmegaConf.is_missing(cfg.trainer, "steps")
    cfg = load_config(None, ["+model=m", "+trainer.steps=???", "trainer.steps=4"])
    assert validate(cfg, AppConfig).trainer.steps == 4


def test_double_plus_sets_whether_or_not_the_key_exists(config_file):
    cfg = load_config(config_file, ["++trainer.lr=0.5", "++trainer.new=1"])
    assert cfg.trainer.lr == 0.5 and cfg.trainer.new == 1


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.lr", "has no '='"),
        ("=3", "'' is not a key"),
        ("~trainer.lr=1", "'~' deletes a key and takes no value"),
        ("+trainer.steps", "has no '='"),
        ("trainer..lr=1", "'trainer..lr' is not a key"),
    ],
)
def test_bad_override_syntax(config_file, override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(config_file, [override])
    assert expected in str(info.value) and repr(override) in str(info.value)


def test_override_of_unknown_key_is_caught_by_validation_with_a_suggestion(config_file):
    cfg = load_config(config_file, ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match=r"trainer.lrr=1: unknown key. Did you mean 'trainer.lr'\?"):
        validate(cfg, AppConfig)


def test_plain_override_sets_a_key_the_file_leaves_to_its_default(config_file):
    cfg = load_config(config_file, ["replay_buffer.max_policy_age=3"])
    assert validate(cfg, AppConfig).replay_buffer.max_policy_age == 3


def test_tuple_fields_are_checked_by_length_and_item_type():
    @dataclass
    class Betas:
        betas: tuple[float, float] = (0.9, 0.99)

    assert validate({"betas": [0.5, 1]}, Betas).betas == (0.5, 1.0)
    with pytest.raises(ConfigError, match=r"betas"):
        validate({"betas": [0.5]}, Betas)
    with pytest.raises(ConfigError, match=r"betas\[1\]"):
        validate({"betas": [0.5, "x"]}, Betas)


def test_adding_an_existing_key_and_deleting_an_absent_one_fail(config_file):
    with pytest.raises(ConfigError, match=r"'trainer.lr' already exists; to change it write trainer.lr=2"):
        load_config(config_file, ["+trainer.lr=2"])
    with pytest.raises(ConfigError, match=r"there is no key 'trainer.nope'"):
        load_config(config_file, ["~trainer.nope"])


def test_override_value_that_is_not_yaml(config_file):
    with pytest.raises(ConfigError, match=r"override 'generators=\[1, 2': cannot set 'generators'"):
        load_config(config_file, ["generators=[1, 2"])


def test_unresolvable_interpolation_names_the_key(config_file):
    with pytest.raises(ConfigError, match=r"trainer.optimizer.lr: cannot resolve interpolation: .*'trainer.rate'"):
        load_config(config_file, ["trainer.optimizer.lr=${trainer.rate}"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml' is not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections, not a ListConfig"):
        load_config(listing)


# ---- validation ------------------------------------------------------------------------------------


def test_unknown_key_names_path_value_suggestion_and_allowed_keys():
    message = error_of({"model": "m", "trainer": {"steps": 1, "lrr": 0.1}})
    assert message.startswith("trainer.lrr=0.1: unknown key")
    assert "Did you mean 'trainer.lr'?" in message
    assert "Allowed keys in trainer: steps, lr, compile, optimizer" in message


def test_unknown_key_inside_a_list_of_dataclasses_has_the_index():
    message = error_of({"model": "m", "trainer": {"steps": 1}, "generators": [{}, {"engin": "hf"}]})
    assert message.startswith("generators[1].engin='hf': unknown key. Did you mean 'generators[1].engine'?")


@pytest.mark.parametrize(
    "trainer, expected",
    [
        ({"steps": "abc"}, "trainer.steps='abc': expected int, got str"),
        ({"steps": 1.5}, "trainer.steps=1.5: expected int, got float"),
        ({"steps": True}, "trainer.steps=True: expected int, got bool"),
        ({"steps": 1, "compile": 1}, "trainer.compile=1: expected bool, got int"),
        ({"steps": 1, "compile": "yes"}, "trainer.compile='yes': expected bool, got str"),
        ({"steps": 1, "lr": "fast"}, "trainer.lr='fast': expected float, got str"),
        ({"steps": None}, "trainer.steps=None: expected int, got NoneType"),
        ({"steps": 1, "optimizer": 3}, "trainer.optimizer=3: expected a mapping of OptimizerConfig fields, got int"),
    ],
)
def test_wrong_type_names_path_value_and_expected_type(trainer, expected):
    assert error_of({"model": "m", "trainer": trainer}) == expected


def test_int_is_accepted_for_a_float_field():
    cfg = check({"model": "m", "trainer": {"steps": 1, "lr": 1}})
    assert cfg.trainer.lr == 1.0 and isinstance(cfg.trainer.lr, float)


def test_missing_required_values():
    # No default at all.
    assert error_of({"trainer": {"steps": 1}}).startswith("model: required value is missing (expected str)")
    # "???" default, with the section absent from the config.
    assert error_of({"model": "m"}).startswith("trainer.steps: required value is missing (expected int)")
    # "???" written in the config.
    message = error_of({"model": "m", "trainer": {"steps": "???"}})
    assert message == "trainer.steps: required value is missing (expected int); set it with trainer.steps=VALUE"


def test_post_init_error_carries_the_full_key_path():
    message = error_of({"model": "m", "trainer": {"steps": 1}, "replay_buffer": {"max_policy_age": -1}})
    assert message == "replay_buffer.max_policy_age=-1: must be >= 0 (0 = on-policy)"


@dataclass
class Sampling:
    n: int = 1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"Sampling.n={self.n}: must be >= 1")


@dataclass
class Generator:
    sampling: Sampling = field(default_factory=Sampling)


def test_post_init_error_prefixed_with_class_name_gets_the_path_instead():
    with pytest.raises(ConfigError) as info:
        validate({"sampling": {"n": 0}}, Generator, path="generator")
    assert str(info.value) == "generator.sampling.n=0: must be >= 1"


def test_literal_lists_the_allowed_choices():
    message = error_of({"model": "m", "trainer": {"steps": 1}, "generators": [{"engine": "sglang"}]})
    assert message == "generators[0].engine='sglang': must be one of 'hf', 'vllm'"


def test_list_of_ints_checks_each_item():
    message = error_of({"model": "m", "trainer": {"steps": 1}, "generators": [{"stop_token_ids": [1, "x"]}]})
    assert message == "generators[0].stop_token_ids[1]='x': expected int, got str"
    message = error_of({"model": "m", "trainer": {"steps": 1}, "generators": [{"stop_token_ids": 3}]})
    assert message == "generators[0].stop_token_ids=3: expected list[int], got int"


def test_optional_and_dict_fields():
    raw = {"model": "m", "trainer": {"steps": 1}, "generators": [{"seed": None, "extra": {"a": 1, "b": 0.5}}]}
    generator = check(raw).generators[0]
    assert generator.seed is None and generator.extra == {"a": 1.0, "b": 0.5}
    raw["generators"][0]["extra"]["b"] = "high"
    assert error_of(raw) == "generators[0].extra.b='high': expected float, got str"


def test_path_prefixes_messages_when_validating_one_section():
    with pytest.raises(ConfigError, match=r"^trainer.steps='x': expected int"):
        validate({"steps": "x"}, TrainerConfig, path="trainer")


# ---- CLI and logging -------------------------------------------------------------------------------


def test_parse_args_splits_config_flags_and_overrides():
    path, overrides, args = parse_args(["--config", "c.yaml", "trainer.lr=1", "--resume", "~a.b", "+c=2"])
    assert path == Path("c.yaml") and args.resume is True
    assert overrides == ["trainer.lr=1", "~a.b", "+c=2"]
    assert parse_args([])[:2] == (None, [])


def test_parse_args_help_prints_usage(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["-h"], description="Run GRPO.")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--config PATH" in out and "Run GRPO." in out and "+key=value adds a key" in out


def test_to_yaml_round_trips_a_validated_config(config_file):
    cfg = validate(load_config(config_file, ["trainer.lr=0.25"]), AppConfig)
    text = to_yaml(cfg)
    assert validate(OmegaConf.create(text), AppConfig) == cfg
    assert "lr: 0.25" in text


def test_to_yaml_never_prints_a_credential():
    """Apps print their config at start (into logs others read): keys named *api_key / *secret are redacted."""
    text = to_yaml({"http": {"api_key": "s3cret-key-1", "port": 8000}, "rl": {"admin_api_key": "adm1n-key-2"},
                    "relay": [{"job_secret": "abc123"}], "open": {"api_key": None}})
    assert "s3cret-key-1" not in text and "adm1n-key-2" not in text and "abc123" not in text
    assert text.count("<redacted>") == 3 and "port: 8000" in text and "api_key: null" in text
