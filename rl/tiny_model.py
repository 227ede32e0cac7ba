"""A tiny Qwen3 model and character-level tokenizer, saved as an ordinary Hugging Face checkpoint.

Tests and the CPU default config need a model without a hub. This one is loaded by the very code that
loads `Qwen/Qwen3-8B` (`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`), so nothing downstream
has a tiny-model special case.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

TINY_MODEL = "tiny"  # `model: tiny` in an app's config names this checkpoint (apps/app_config.py)
TINY_CHECKPOINT_DIR = "tiny-qwen3"  # its folder in an app's `model_cache`

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
# Every printable ASCII character (digits, letters, '+', '-', '=', ' ', punctuation) plus newline.
CHARACTERS = tuple(string.digits + string.ascii_letters + string.punctuation + " \n")

# About 0.4M parameters: large enough to learn 2-digit addition, small enough for CPU tests.
DEFAULT_MODEL_ARGS: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# The fields a config may set to give the tiny model another shape (`tiny_shape` in apps.sft's config).
SHAPE_FIELDS = tuple(DEFAULT_MODEL_ARGS)


def check_shape(shape: dict[str, Any], field: str = "tiny_shape") -> None:
    """A shape is some of SHAPE_FIELDS, positive integers (tie_word_embeddings a bool); plain Python, no torch.
    Whether heads and sizes fit together is checked later against the written config.json."""
    for key, value in shape.items():
        if key not in SHAPE_FIELDS:
            raise ValueError(f"{field}.{key}={value!r}: not a shape field of the tiny model; allowed: "
                             f"{', '.join(SHAPE_FIELDS)}")
        if key == "tie_word_embeddings":
            if not isinstance(value, bool):
                raise ValueError(f"{field}.{key}={value!r}: must be true or false")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}.{key}={value!r}: must be a positive integer")
    heads, kv_heads = ({**DEFAULT_MODEL_ARGS, **shape}[k] for k in ("num_attention_heads", "num_key_value_heads"))
    if heads % kv_heads:  # grouped-query attention shares each key/value head among a whole group
        raise ValueError(f"{field}: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")


def checkpoint_dir(shape: dict[str, Any] | None = None) -> str:
    """The checkpoint's folder name in a `model_cache`: the default shape's, or one per shape (a digest of it), so
    checkpoints of different shapes never share a folder."""
    if not shape:
        return TINY_CHECKPOINT_DIR
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    return f"{TINY_CHECKPOINT_DIR}-{digest}"


def tiny_config(**model_overrides: Any) -> dict[str, Any]:
    """The tiny checkpoint's `Qwen3Config` fields, in plain Python: a job is checked against them before
    the checkpoint is built (building imports torch and transformers, seconds on a first run)."""
    return dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS),  # the tokenizer's: special tokens first
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        bos_token_id=None,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},  # transformers 5's form
        **{**DEFAULT_MODEL_ARGS, **model_overrides},
    )


def write_tiny_config(path: str | Path, **model_overrides: Any) -> Path:
    """Write only the tiny checkpoint's config.json to `path` (no weights, no torch)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_config(**model_overrides), indent=2))
    return path


def is_built(path: str | Path) -> bool:
    return all((Path(path) / name).is_file() for name in _CHECKPOINT_FILES)


def build_tokenizer(max_length: int = DEFAULT_MODEL_ARGS["max_position_embeddings"]) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, special tokens first."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    # BPE with no merges splits text into single characters; no pre-tokenizer keeps spaces as tokens.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    # Fuse concatenates tokens on decode; the default decoder would join them with spaces.
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=max_length,
    )


def build_tiny_checkpoint(path: str | Path, *, seed: int = 0, **model_overrides: Any) -> Path:
    """Build a randomly initialised tiny Qwen3 model and its tokenizer and save both to `path`.

    `model_overrides` replace `Qwen3Config` fields (e.g. `num_hidden_layers=4`); the vocabulary always
    comes from the tokenizer.
    """
    # Imported here: `ensure_tiny_checkpoint` finding the checkpoint built must not cost a torch import (the
    # GRPO command line checks its config with `model: tiny` before the training stack is imported).
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    allowed = set(Qwen3Config().to_dict()) - {"vocab_size"}
    unknown = sorted(set(model_overrides) - allowed)
    if unknown:
        raise ValueError(
            f"build_tiny_checkpoint: unknown model override(s) {unknown}; allowed: Qwen3Config fields except vocab_size"
        )
    fields = tiny_config(**model_overrides)
    tokenizer = build_tokenizer(fields["max_position_embeddings"])
    if (len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id) != (
            fields["vocab_size"], fields["pad_token_id"], fields["eos_token_id"]):
        raise RuntimeError("tiny_config's vocabulary disagrees with build_tokenizer")
    config = Qwen3Config(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    # Seed a forked RNG so building a checkpoint does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ensure_tiny_checkpoint(path: str | Path, **model_overrides: Any) -> Path:
    """Return `path`, building the tiny checkpoint (default shape, or `model_overrides`) there first if it is not
    there yet.

    The checkpoint is built in a temporary sibling folder and renamed into place, so concurrent callers
    (several actors starting at once) never see a half-written checkpoint.
    """
    path = Path(path)
    if is_built(path):
        return path
    if path.exists() and any(path.iterdir()):
        raise ValueError(
            f"ensure_tiny_checkpoint: {path} exists but is not a complete checkpoint (needs {list(_CHECKPOINT_FILES)})"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.building-"))
    try:
        build_tiny_checkpoint(staging, **model_overrides)
        os.rename(staging, path)
    except OSError:
        # Another process renamed its finished copy into place first; use that one.
        if not is_built(path):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
