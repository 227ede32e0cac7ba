"""Where a job's examples come from (`data.source`): a task's reference answers, endlessly drawn, or a file's or a
dataset's rows, epoch after epoch; and the held-out examples (and, for a task, problems) it is evaluated on."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from actors.model_files import read_hf_config
from apps.sft.config import SFTConfig
from apps.sft.data import ChatRenderer, Epochs, read_dataset, read_jsonl, row_examples, split_held_out
from rl import tasks as rl_tasks
from rl.demonstrations import Example, completion_example, reference_completion, transcript_example
from rl.tasks.protocol import MultiTurnTask, Task, TaskProblem


class TaskStream:
    """A task's training problems with their reference completions (a multi-turn task's correct episodes), drawn
    from a generator seeded by the job (its state is checkpointed, so a resumed run draws what the stopped one would
    have)."""

    def __init__(self, task: Task, tokenizer: Any, seed: int) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.rng = random.Random(f"{seed}-sft")
        # The end of an answer: the chat template's end of turn when the task asks in one, else EOS.
        self.end_id = task.stop_token_ids[-1] if task.stop_token_ids else tokenizer.eos_token_id

    def example(self, problem: TaskProblem) -> Example:
        if isinstance(self.task, MultiTurnTask):  # its correct episode, the model's turns learned
            return transcript_example(self.tokenizer, self.task.transcript(problem))
        return completion_example(self.tokenizer, problem.prompt, reference_completion(self.task, problem),
                                  self.end_id)

    def take(self, count: int) -> list[Example]:
        return [self.example(p) for p in self.task.sample_prompts(count, self.rng)]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])


@dataclass
class SFTData:
    train: TaskStream | Epochs
    held_out: list[Example]
    task: Task | None = None  # a task source's task: its held-out problems and reward score the accuracy
    problems: list[TaskProblem] = field(default_factory=list)  # those problems, in the order of `held_out`
    dropped: int = 0  # rows left out as longer than data.max_length


def load_job_data(cfg: SFTConfig) -> tuple[Any, SFTData]:
    """The model's tokenizer and the job's data, every row read and checked (a bad one: a ValueError naming where it
    is); apps/sft/cli.py calls it before the training stack (Monarch, TorchTitan) is imported, so it fails fast."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.model_path)
    positions = read_hf_config(cfg.trainer.model_path).get("max_position_embeddings")
    return tokenizer, load_data(cfg, tokenizer, cfg.data.max_length or positions or 1 << 30)


def load_data(cfg: SFTConfig, tokenizer: Any, max_length: int) -> SFTData:
    """The job's training stream and held-out examples; a bad row raises a ValueError naming where it is."""
    data, count = cfg.data, cfg.eval.num_prompts
    if data.source == "task":
        task = rl_tasks.make_task(data.task, seed=cfg.seed, model=cfg.trainer.model_path)
        stream = TaskStream(task, tokenizer, cfg.seed)
        problems = task.held_out()[:count]
        return SFTData(stream, [stream.example(p) for p in problems], task, problems)
    field_name = "data.path"
    rows = (read_jsonl(data.path, field_name) if data.source == "jsonl"
            else read_dataset(data.path, data.dataset_config, data.split, field_name))
    if data.held_out >= len(rows):
        raise ValueError(f"data.held_out={data.held_out}: must be less than the {len(rows)} rows of "
                         f"data.path={data.path!r}")
    chat = None
    if any(isinstance(row, dict) and "messages" in row for _, row in rows):
        chat = ChatRenderer(tokenizer, data.chat_template_kwargs, f"data.path={data.path!r}")
    train_rows, held_rows = split_held_out(rows, data.held_out, cfg.seed)

    def examples(part: list) -> tuple[list[Example], int]:
        made = [e for where, row in part for e in row_examples(row, where, tokenizer, chat)]
        kept = [e for e in made if len(e) <= max_length]
        return kept, len(made) - len(kept)

    train, dropped = examples(train_rows)
    held_out, dropped_held = examples(held_rows)
    if not train:
        raise ValueError(f"data.path={data.path!r}: no training example of at most data.max_length={max_length} "
                         f"tokens ({dropped} longer)")
    return SFTData(Epochs(train, cfg.seed), held_out[:count], dropped=dropped + dropped_held)
