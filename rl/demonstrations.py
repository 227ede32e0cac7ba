"""A task's demonstrations as supervised examples: what a model should write for a problem, and the token ids of a
demonstration with which of them are learned. apps.sft trains on them; the warm start (apps/warm_start/) does too.

Masks are chosen by token ids, never by searching text:
- prompt-completion: the prompt encoded as the generators encode a prompt, the completion encoded on its own and
  followed by the end token; exactly the ids the model sees and writes at inference (`completion_example`).
- a multi-turn task's correct episode: its segments encoded one by one, the model's learned (`transcript_example`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl.tasks.protocol import Task, TaskProblem


@dataclass(frozen=True)
class Example:
    """One row: its token ids and, for each, whether the loss learns it."""

    ids: tuple[int, ...]
    learned: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.ids)


def reference_completion(task: Task, problem: TaskProblem) -> str:
    """What a model should write for `problem`: its answer, or for a reasoning-gym problem (whose `answer` is the
    key its scorer needs) the entry's reference answer, tagged as the task's instruction asks."""
    from rl.tasks.reasoning_gym import ReasoningGymTask

    if isinstance(task, ReasoningGymTask):
        return f"<answer>{task.reference_answer(problem.answer)}</answer>"
    return problem.answer


def completion_example(tokenizer: Any, prompt: str, completion: str, end_id: int) -> Example:
    """`prompt` as the generators encode it (with the tokenizer's special tokens), then the completion's ids and
    `end_id` (EOS, or a chat template's end of turn), learned."""
    prompt_ids = tokenizer.encode(prompt)
    answer = tokenizer.encode(completion, add_special_tokens=False) + [end_id]
    return Example(tuple(prompt_ids + answer), (False,) * len(prompt_ids) + (True,) * len(answer))


def transcript_example(tokenizer: Any, segments: list[tuple[str, bool]]) -> Example:
    """A multi-turn task's correct episode, (text, written by the model) segments: each encoded on its own and the ids
    concatenated, as the rollout appends observations by id, EOS after the last model segment; the model's segments
    (and that EOS) learned."""
    ids, learned = [], []
    last_model = max(i for i, (_, by_model) in enumerate(segments) if by_model)
    for i, (text, by_model) in enumerate(segments):
        piece = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if i == last_model else [])
        ids += piece
        learned += [by_model] * len(piece)
    return Example(tuple(ids), tuple(learned))
