"""The served model: forge's tiny checkpoint warm-started the way apps.grpo does it, and its tokenizer's facts.

Shared by the training service and the online-RL gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.tasks.arithmetic import ArithmeticTask
from rl.tiny_model import TINY_CHECKPOINT_DIR
from apps.warm_start.config import WarmStartConfig
from apps.warm_start.supervised import warm_start_on_task


def is_tiny(model: str, model_cache: str) -> bool:
    return Path(model).resolve() == (Path(model_cache) / TINY_CHECKPOINT_DIR).resolve()


def model_to_serve(model: str, model_cache: str, config: WarmStartConfig, *, seed: int,
                   max_tokens: int = 4, reverse_answer: bool = False) -> tuple[str, float | None]:
    """The checkpoint to serve: for forge's tiny model with `config.enabled`, its supervised warm start on 2-digit
    addition (`warm_start_on_task`, as apps.grpo runs it, cached by its inputs in `model_cache/warm_start`; with
    `reverse_answer` the answers are written least-significant digit first, as configs/grpo_tiny.yaml's task);
    otherwise `model` itself. Returns (path, warm-start accuracy or None)."""
    if not (config.enabled and is_tiny(model, model_cache)):
        return (str(Path(model).resolve()) if Path(model).exists() else model), None
    task = ArithmeticTask(seed=seed, num_digits=2, held_out=500, reverse_answer=reverse_answer)
    path, accuracy = warm_start_on_task(model, model_cache, task, config, seed=seed, max_tokens=max_tokens)
    return str(Path(path).resolve()), accuracy


@dataclass(frozen=True)
class TokenizerInfo:
    """What a client needs to build token sequences (and the server to check them), with the tokenizer itself."""

    tokenizer: Any
    pad_id: int
    eos_id: int
    vocab_size: int
    max_model_len: int


def tokenizer_info(model_path: str) -> TokenizerInfo:
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = json.loads((Path(model_path) / "config.json").read_text()) if Path(model_path, "config.json").is_file() else {}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TokenizerInfo(tokenizer=tokenizer, pad_id=pad, eos_id=tokenizer.eos_token_id, vocab_size=len(tokenizer),
                         max_model_len=int(config.get("max_position_embeddings", tokenizer.model_max_length)))
