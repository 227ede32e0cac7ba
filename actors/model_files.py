"""A Hugging Face checkpoint's small files (config.json, the tokenizer's), read from its folder or fetched alone from
the hub, and the checks that need them: a chat template is there, two checkpoints share a tokenizer.

Plain Python (no torch): apps call these from their config's check step, before anything starts; model_layout.py
judges the config.json read here. Every error names the model, the file and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_hf_config(model: str) -> dict:
    """The checkpoint's config.json: from its folder, or for a hub id fetched alone (no weights)."""
    text = read_checkpoint_file(model, "config.json")
    if text is None:
        raise ValueError(f"model={model!r}: has no config.json; use a Hugging Face checkpoint folder or hub id")
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"model={model!r}: its config.json is not JSON ({e})") from None


def read_checkpoint_file(model: str, name: str) -> str | None:
    """One small file of the checkpoint (None where it has none): from its folder, or fetched alone from the hub."""
    if Path(model).exists():
        path = Path(model) / name
        return path.read_text() if path.exists() else None
    from huggingface_hub import file_exists, hf_hub_download

    try:
        return Path(hf_hub_download(model, name)).read_text() if file_exists(model, name) else None
    except OSError as e:  # the hub's errors are OSErrors
        raise ValueError(f"model={model!r}: cannot read its {name} to check the job before anything starts "
                         f"({type(e).__name__}: {e}); use a reachable hub id or a local checkpoint folder") from None


def check_chat_template(model: str) -> None:
    """`environment.chat_template=true` needs a tokenizer with a chat template (in tokenizer_config.json or a
    chat_template.jinja file beside it): refused now, not when the rollouts start after every actor has."""
    if read_checkpoint_file(model, "chat_template.jinja") is not None:
        return
    tokenizer_config = read_checkpoint_file(model, "tokenizer_config.json")
    if tokenizer_config is None or not json.loads(tokenizer_config).get("chat_template"):
        raise ValueError(f"environment.chat_template=true: the tokenizer of model={model!r} has no chat template "
                         "(none in tokenizer_config.json, no chat_template.jinja); set environment.chat_template=false "
                         "to play episodes in plain text, or use a model with a chat template")


def _vocabulary(tokenizer_json: str) -> dict[int, str]:
    """id -> token text of a `tokenizer.json`: its model's vocabulary (BPE/WordPiece: a dict, Unigram: a list of
    [piece, score]) and its added tokens."""
    spec = json.loads(tokenizer_json)
    vocab = spec.get("model", {}).get("vocab") or {}
    ids = ({i: token for token, i in vocab.items()} if isinstance(vocab, dict)
           else {i: piece for i, (piece, _) in enumerate(vocab)})
    ids.update({t["id"]: t["content"] for t in spec.get("added_tokens", [])})
    return ids


def check_same_tokenizer(student: str, teacher: str) -> None:
    """Distillation compares log-probs of the same token ids: the teacher's tokenizer.json must map every id to the
    student's text (only `vocab_size` is compared where either checkpoint has no tokenizer.json)."""
    why = ("distillation compares the two models' log-probs of the same token ids; use a teacher with the student's "
           "tokenizer")
    student_json, teacher_json = (read_checkpoint_file(model, "tokenizer.json") for model in (student, teacher))
    if student_json is None or teacher_json is None:
        sizes = read_hf_config(student).get("vocab_size"), read_hf_config(teacher).get("vocab_size")
        if sizes[0] != sizes[1]:
            raise ValueError(f"vocab_size={sizes[1]}, the student's (model={student!r}) is {sizes[0]}: {why}")
        return
    ours, theirs = _vocabulary(student_json), _vocabulary(teacher_json)
    differ = sorted(i for i in ours.keys() | theirs.keys() if ours.get(i) != theirs.get(i))
    if differ:
        first = differ[0]
        raise ValueError(f"its tokenizer differs from the student's (model={student!r}) on {len(differ)} token ids "
                         f"(id {first}: {theirs.get(first)!r}, the student's {ours.get(first)!r}): {why}")
