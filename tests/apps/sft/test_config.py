"""`python -m apps.sft`'s config checks: every error names the key, the value and what is allowed, before any process
starts (exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apps.sft.cli import load_sft_config
from forge.config import ConfigError
from tests.apps.grpo.test_cli import probe  # `python -m` in a subprocess: its exit code and heavy imports

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/sft_tiny.yaml")


def test_the_tiny_config_loads():
    cfg, resume = load_sft_config(["--config", TINY])
    assert not resume and cfg.trainer.loss == "losses.nll:nll" and cfg.trainer.max_steps == cfg.steps
    assert cfg.measures_accuracy and cfg.resources.trainer_procs == 2


@pytest.mark.parametrize(("override", "message"), [
    ("batch_size=63", r"^batch_size=63: must be a positive multiple of resources.trainer_procs=2"),
    ("trainer.loss=grpo", r"^trainer.loss='grpo': SFT trains with the nll loss; set it to 'losses.nll:nll'"),
    ("trainer.temperature=0.7", r"^trainer.temperature=0.7: must be 1"),
    ("trainer.max_steps=10", r"^trainer.max_steps=10: must be >= steps=400"),
    ("environment.chat_template=true", r"^environment.chat_template=true: SFT trains a multi-turn task's plain-text "
                                       "transcripts"),
    ("data.source=jsonl", r"^data.path=None: source=jsonl needs the rows' path"),
    ("data.path=x.jsonl", r"^data.path='x.jsonl': source=task reads the task section"),
    ("eval.num_prompts=0", r"^eval.num_prompts=0: must be >= 1"),
    ("data.sorce=task", r"^data.sorce='task': unknown key"),
])
def test_a_bad_key_is_refused_naming_it(override, message):
    with pytest.raises(ConfigError, match=message):
        load_sft_config(["--config", TINY, override])


def test_a_layout_the_model_cannot_take_is_refused_before_the_trainer_starts():
    with pytest.raises(ConfigError, match=r"^trainer.model_path='.*tiny-qwen3' with resources.trainer_procs=3: "
                                          r"tensor_parallel_degree=3: must divide config.json num_attention_heads=4"):
        load_sft_config(["--config", TINY, "resources.trainer_procs=3", "batch_size=66",
                         "trainer.tensor_parallel_degree=3"])


def test_a_missing_jsonl_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=rf"^data.path='{tmp_path}/none.jsonl': no such file \(source=jsonl\)"):
        load_sft_config(["--config", TINY, "data.source=jsonl", f"data.path={tmp_path}/none.jsonl",
                         "eval.accuracy=false"])


def test_building_the_config_reads_no_file_its_check_step_does(tmp_path, monkeypatch):
    """SFTConfig's construction does no I/O: a missing JSONL file and the model's config.json are `SFTConfig.check`'s
    (run by the cli before anything starts)."""
    from actors import model_files
    from apps.sft.config import SFTConfig
    from forge.config import load_config, validate

    reads = []
    monkeypatch.setattr(model_files, "read_checkpoint_file", lambda model, name: reads.append((model, name)))
    cfg = validate(load_config(TINY, ["model=Qwen/Qwen3-1.7B", "data.source=jsonl", f"data.path={tmp_path}/x.jsonl",
                                      "eval.accuracy=false"]), SFTConfig)
    assert reads == []
    with pytest.raises(ValueError, match=rf"^data.path='{tmp_path}/x.jsonl': no such file"):
        cfg.check()
    (tmp_path / "x.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"^model='Qwen/Qwen3-1.7B': has no config.json"):
        cfg.check()
    assert reads == [("Qwen/Qwen3-1.7B", "config.json")]


def test_a_bad_row_exits_2_naming_its_line_before_monarch_is_imported(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    outcome, result = probe("--config", TINY, "data.source=jsonl", f"data.path={path}", "eval.accuracy=false",
                            f"run_dir={tmp_path}/run", module="apps.sft")
    assert outcome["exit"] == 2, result.stderr[-2000:]
    assert f"config error: data.path='{path}' line 2: a row must have 'prompt' and 'completion'" in result.stderr
    # Read with the tokenizer (torch, transformers), before the training stack: seconds, not a Monarch start-up.
    assert not {"monarch", "torchtitan", "torchstore", "vllm"} & set(outcome["heavy"]), outcome


def test_help_lists_every_section_and_imports_no_torch():
    code = ("import sys; from apps.sft.cli import reference; text = reference(); "
            "assert '`data.task.name`' in text and '`trainer.lr`' in text and '`eval.every`' in text, text[:300]; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
