"""`python -m apps.grpo`'s command line: the usage line names the module, and `--help`, YAML and override errors
and the schema's checks answer before torch, Monarch, TorchTitan or vLLM is imported (checked in `sys.modules`,
not timed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.monarch  # starts Monarch processes: `make test` runs it in its own pytest process

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "monarch", "torchtitan", "transformers", "torchstore", "vllm")

# Runs `python -m MODULE ARGS` in this interpreter and reports its exit code and the heavy modules it imported.
PROBE = """
import json, runpy, sys
module, sys.argv = sys.argv[1], [sys.argv[1], *json.loads(sys.argv[2])]
code = None
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print(json.dumps({"exit": code, "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def probe(*args: str, module: str = "apps.grpo") -> tuple[dict, subprocess.CompletedProcess]:
    result = subprocess.run([sys.executable, "-c", PROBE, module, json.dumps(args)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    return json.loads(result.stdout.strip().splitlines()[-1]), result


def test_the_usage_line_names_the_module():
    result = subprocess.run([sys.executable, "-m", "apps.grpo", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m apps.grpo [-h] [--config PATH] [--resume]"), result.stdout
    assert "__main__" not in result.stdout


def test_help_imports_nothing_heavy():
    outcome, result = probe("--help")
    assert outcome == {"exit": 0, "heavy": []}, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/no_such.yaml"], "config error: config file 'configs/no_such.yaml' does not exist"),
    (["--config", "configs/grpo_tiny.yaml", "steps"], "config error: override 'steps' has no '='"),
    (["--config", "configs/grpo_tiny.yaml", "~no_such_key"], "config error: override '~no_such_key': there is no key"),
])
def test_yaml_and_override_errors_answer_before_the_heavy_imports(args, message):
    outcome, result = probe(*args)
    assert outcome == {"exit": 2, "heavy": []}, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("override, message", [
    ("trainer.lr=-1", "config error: trainer.lr=-1.0: must be a number > 0"),
    ("rollout.group_size=1", "config error: rollout.group_size=1: must be from 2"),
    ("trainer.loss=ppo", "config error: trainer.loss='ppo': unknown; must be one of grpo, dapo, gspo, cispo, dr_grpo"),
    ("++trainer.loss_params.clip_eps=0", "clip_eps=0: must be a number > 0"),
    ("++trainer.loss_params.nope=1", "['nope'] not taken by loss 'grpo'"),
    ("warm_start.lr=0", "config error: warm_start.lr=0"),
    ("generator.engine=sglang", "config error: generator.engine='sglang'"),
    ("trainer.max_steps=5", "config error: trainer.max_steps=5: must be >= steps="),
    ("task.reward=no_such_module:score", "cannot import module 'no_such_module'"),
    ("generator.engine=vllm ++generator.engine_args.max_model_length=256",
     "config error: generator.engine_args: unknown vLLM engine argument(s) ['max_model_length']"),
    ("hosts.addresses=[hostA]", "config error: hosts.addresses[0]='hostA': must be an IP address"),
    ("trainer.tensor_parallel_degree=3", "config error: resources.trainer_procs=1: world_size=1: must be a multiple of "
                                         "tensor_parallel_degree=3"),  # the model's layout, checked last
])
def test_schema_errors_answer_before_the_heavy_imports(override, message):
    outcome, result = probe("--config", "configs/grpo_tiny.yaml", *override.split())
    assert outcome == {"exit": 2, "heavy": []}, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("module, config, override, message", [
    ("apps.grpo", "configs/grpo_tiny.yaml", "trainer.lr=-1", "config error: trainer.lr=-1.0: must be a number > 0"),
    ("apps.grpo", "configs/grpo_tiny.yaml", "trainer.tensor_parallel_degree=3", "tensor_parallel_degree=3"),
    ("apps.server", "configs/server_tiny.yaml", "generator_replicas=0", "config error: generator_replicas=0"),
    ("apps.gateway", "configs/gateway_tiny.yaml", "generator_replicas=0", "config error: generator_replicas=0"),
])
def test_a_first_run_checks_the_config_before_building_the_tiny_model(tmp_path, module, config, override, message):
    """With nothing in `model_cache` yet, the job is checked against the tiny model's config.json alone; the
    checkpoint (torch, transformers, seconds) is built only for a config that passed."""
    cache = tmp_path / "cache"
    outcome, result = probe("--config", config, f"model_cache={cache}", override, module=module)
    assert outcome == {"exit": 2, "heavy": []}, result.stderr
    assert message in result.stderr
    assert not (cache / "tiny-qwen3").exists()


def test_the_probe_sees_heavy_imports():
    outcome, result = probe(module="losses.grpo")  # a loss is torch code
    assert outcome == {"exit": None, "heavy": ["torch"]}, result.stderr
