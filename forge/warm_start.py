"""A short supervised warm start: teach a fresh model the answer format, then stop early.

GRPO needs some reward signal to begin with: a randomly initialised model never emits a correct answer,
so every group has zero variance and nothing is learned. A few hundred teacher-forced steps on
(prompt, answer + EOS) pairs bring greedy accuracy to a low threshold (~20%); GRPO does the rest.
The result is saved as an ordinary HF checkpoint directory, cached by its inputs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.tasks import Problem


@dataclass
class WarmStartConfig:
    enabled: bool = True
    target_accuracy: float = 0.2  # stop as soon as greedy accuracy on `eval_prompts` reaches this
    lr: float = 1e-3
    batch_size: int = 64
    max_steps: int = 3000
    eval_every: int = 20
    eval_prompts: int = 200

    def __post_init__(self) -> None:
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy={self.target_accuracy}: must be in (0, 1]")
        for name in ("batch_size", "max_steps", "eval_every", "eval_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr}: must be > 0")


def greedy_accuracy(model, tokenizer, problems: list[Problem], reward: Callable[[str, str], float], max_tokens: int) -> float:
    """Exact-answer accuracy of greedy decoding (one left-padded batch)."""
    from actors.engines.hf import HFEngine
    from forge.types import SamplingParams

    engine = HFEngine.from_model(model, tokenizer)  # decodes with the training model itself, no copy
    outputs = engine.generate([p.prompt for p in problems], SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0))
    return sum(reward(out[0].text, p.answer) for p, out in zip(problems, outputs)) / len(problems)


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    train_problems: Callable[[int], list[Problem]],
    eval_problems: list[Problem],
    reward: Callable[[str, str], float],
    config: WarmStartConfig,
    seed: int,
    max_tokens: int,
    log: Callable[[str], None] = print,
) -> tuple[Path, float]:
    """Train on `train_problems(n)` until greedy accuracy on `eval_problems` reaches the target.

    Returns the saved checkpoint directory and the accuracy reached. A checkpoint made earlier with the
    same inputs is reused.
    """
    out_dir = Path(out_dir)
    key = hashlib.sha256(
        json.dumps({"model": str(Path(model_dir).resolve()), "seed": seed, "config": asdict(config),
                    "eval": [tuple(p) for p in eval_problems[:20]]}, sort_keys=True).encode()
    ).hexdigest()[:12]
    target = out_dir / f"warm-{key}"
    if (target / "warm_start.json").exists():
        info = json.loads((target / "warm_start.json").read_text())
        log(f"warm start: reusing {target} (accuracy {info['accuracy']:.1%})")
        return target, info["accuracy"]

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    eos = tokenizer.eos_token_id
    start, accuracy, step = time.perf_counter(), 0.0, 0
    for step in range(1, config.max_steps + 1):
        model.train()
        problems = train_problems(config.batch_size)
        input_ids, labels = _teacher_forcing_batch(tokenizer, problems, eos)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % config.eval_every == 0:
            model.eval()
            with torch.no_grad():
                accuracy = greedy_accuracy(model, tokenizer, eval_problems, reward, max_tokens)
            log(f"warm start: step {step} loss {loss.item():.3f} greedy accuracy {accuracy:.1%} "
                f"({time.perf_counter() - start:.0f}s)")
            if accuracy >= config.target_accuracy:
                break
    tmp = out_dir / f".warm-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for extra in ("generation_config.json",):
        if (Path(model_dir) / extra).exists() and not (tmp / extra).exists():
            shutil.copy(Path(model_dir) / extra, tmp / extra)
    (tmp / "warm_start.json").write_text(json.dumps({"accuracy": accuracy, "steps": step}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log(f"warm start: {step} steps, greedy accuracy {accuracy:.1%}, saved {target}")
    return target, accuracy


def _teacher_forcing_batch(tokenizer, problems: list[Problem], eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+EOS; labels only on the answer and EOS (-100 elsewhere)."""
    rows, label_rows = [], []
    for p in problems:
        prompt = tokenizer.encode(p.prompt)
        answer = tokenizer.encode(p.answer) + [eos]
        rows.append(prompt + answer)
        label_rows.append([-100] * len(prompt) + answer)
    length = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    input_ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (length - len(r)) for r in label_rows])
    return input_ids, labels
