"""SFT examples: the token ids of a demonstration and which of them are learned, from a task's reference answers,
prompt-completion rows or chat conversations; and the trainer's batch of them.

Masks are chosen by token ids, never by searching text:
- a task's reference answers and a multi-turn task's correct episodes, and prompt-completion rows: rl/demonstrations.py
  (`completion_example`, `transcript_example`), shared with the warm start.
- chat: each assistant message k is the ids the template adds between `messages[:k]` rendered with the generation
  prompt and `messages[:k+1]` rendered whole, up to and including the template's end-of-turn token. Where each
  such rendering is a prefix of the whole conversation's, the conversation is one row and every assistant message
  is learned in it. A template that renders history otherwise (Qwen3 drops the thinking of earlier turns, as its
  model card says the history must be given) gives one row per assistant message: its history as the template
  shows it, that message learned, as the model sees it when it writes that message.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from rl.demonstrations import Example, completion_example
from rl.types import TrainBatch

ROLES = ("system", "user", "assistant", "tool")


class ChatRenderer:
    """Conversations in `tokenizer`'s chat template, assistant messages learned (the module's docstring).

    The template is checked once, by forge's chat mode (rl.environments.chat.ChatTemplate): it must render a
    user/assistant conversation and be prefix-stable, else nothing the template writes could be told from what the
    model writes; its end-of-turn token ends each learned message."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any], field: str) -> None:
        from rl.environments.chat import ChatTemplate

        try:
            chat = ChatTemplate(tokenizer, chat_template_kwargs=chat_template_kwargs)
        except ValueError as e:  # its messages name chat mode's own switch; here the data asked for the template
            raise ValueError(f"{field}: chat rows need the model's chat template: "
                             f"{str(e).removeprefix('environment.chat_template=true: ')}") from None
        self.tokenizer, self.kwargs, self.end_of_turn = tokenizer, dict(chat_template_kwargs), chat.end_of_turn_id

    def _ids(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template writes its own BOS

    def examples(self, messages: list[dict], tools: list | None, where: str) -> list[Example]:
        turns = []  # (the conversation's ids up to the end of assistant message k, where message k starts)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            context, whole = self._ids(messages[:k], tools, True), self._ids(messages[: k + 1], tools, False)
            if whole[: len(context)] != context:
                raise ValueError(f"{where}: the chat template is not prefix-stable at message {k}: the conversation "
                                 "before it, rendered with the generation prompt, is not how the whole renders "
                                 f"it (ids ending {context[-4:]} vs {whole[max(0, len(context) - 4):len(context)]}), "
                                 "so the assistant's tokens cannot be told from the template's")
            turns.append((whole[: self._turn_end(whole, len(context))], len(context)))
        full = self._ids(messages, tools, False)
        if all(full[: len(ids)] == ids for ids, _ in turns):  # one row, every assistant message learned in it
            ids = turns[-1][0]
            learned = [False] * len(ids)
            for turn, start in turns:
                learned[start : len(turn)] = [True] * (len(turn) - start)
            return [Example(tuple(ids), tuple(learned))]
        # The template shows earlier turns otherwise than it wrote them (Qwen3's thinking): a row per turn.
        return [Example(tuple(ids), (False,) * start + (True,) * (len(ids) - start)) for ids, start in turns]

    def _turn_end(self, ids: list[int], start: int) -> int:
        """Where the assistant's message that starts at `start` ends: after the template's end-of-turn token (what
        follows it, e.g. a newline, is the template's, not the model's), or at the end of the rendering."""
        if self.end_of_turn is not None and self.end_of_turn in ids[start:]:
            return len(ids) - ids[::-1].index(self.end_of_turn)
        return len(ids)


def check_messages(messages: Any, where: str) -> None:
    """A chat row's `messages`: {role, content} dicts, roles from ROLES, at least one assistant message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages={messages!r:.80}: must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"{where}: messages[{i}].role={role!r:.40}: must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m.get("tool_calls"))):
            raise ValueError(f"{where}: messages[{i}].content={content!r:.40}: must be a string (null only with "
                             "tool_calls)")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message: nothing to learn")


def row_examples(row: Any, where: str, tokenizer: Any, chat: ChatRenderer | None) -> list[Example]:
    """A data row's examples: `{prompt, completion}` strings or `{messages[, tools]}` (needs `chat`)."""
    if isinstance(row, dict) and "messages" in row:
        check_messages(row["messages"], where)
        if chat is None:
            raise ValueError(f"{where}: a chat row, but the data's format is prompt_completion")
        return chat.examples(row["messages"], row.get("tools"), where)
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return [completion_example(tokenizer, row["prompt"], row["completion"], tokenizer.eos_token_id)]
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise ValueError(f"{where}: a row must have 'prompt' and 'completion' (strings) or 'messages' (a list of "
                     f"{{role, content}}); it has {keys}")


def read_jsonl(path: str | Path, field: str) -> list[tuple[str, Any]]:
    """Each line's object and where it is (`field=path line N`), blank lines skipped."""
    rows = []
    with open(path) as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                where = f"{field}={str(path)!r} line {number}"
                try:
                    rows.append((where, json.loads(line)))
                except ValueError as e:
                    raise ValueError(f"{where}: not JSON ({e})") from None
    return rows


def json_dataset_options() -> dict[str, Any]:
    """`load_dataset("json", ...)` options (forge.compat 42): the mixed-type field check of datasets >= 4.7 off, as it
    fails on a blank line; nothing on a release without that check."""
    from datasets.packaged_modules.json.json import JsonConfig

    return {"on_mixed_types": None} if "on_mixed_types" in JsonConfig.__dataclass_fields__ else {}


def read_dataset(path: str, config: str | None, split: str, field: str) -> list[tuple[str, Any]]:
    """A `datasets` dataset's rows: a local data file (.jsonl, .json, .parquet, .csv), a folder or a hub id."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetsError

    try:
        if Path(path).is_file():
            builder = Path(path).suffix.lstrip(".").replace("jsonl", "json")
            options = json_dataset_options() if builder == "json" else {}
            dataset = load_dataset(builder, data_files=path, split="train", **options)
        else:
            dataset = load_dataset(path, config, split=split)
    except (OSError, ValueError, DatasetsError) as e:  # no such file or dataset, no hub, a bad split or config
        raise ValueError(f"{field}={path!r}: `datasets` cannot load it (a local data file or folder, or a hub id; "
                         f"{type(e).__name__}: {e})") from None
    return [(f"{field}={path!r} row {i}", row) for i, row in enumerate(dataset)]


def split_held_out(rows: list, held_out: int, seed: int) -> tuple[list, list]:
    """(training rows, `held_out` rows drawn with `seed`): disjoint."""
    order = list(range(len(rows)))
    random.Random(f"{seed}-sft-held-out").shuffle(order)
    return [rows[i] for i in sorted(order[held_out:])], [rows[i] for i in sorted(order[:held_out])]


class Epochs:
    """A finite list of examples served `count` at a time, reshuffled (from `seed`) every epoch; its position is its
    state, so a resumed run continues with the examples the stopped one would have taken next."""

    def __init__(self, examples: list[Example], seed: int) -> None:
        if not examples:
            raise ValueError("no training examples")
        self.examples, self.seed = examples, seed
        self.epoch = self.position = 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}-sft-epoch-{self.epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[Example]:
        taken = []
        while len(taken) < count:
            if self.position == len(self.order):
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self._order()
            step = min(count - len(taken), len(self.order) - self.position)
            taken += [self.examples[i] for i in self.order[self.position : self.position + step]]
            self.position += step
        return taken

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.order = self._order()


def train_batch(examples: list[Example], pad_id: int, *, pack_to: int | None = None, minibatches: int = 1,
                ranks: int = 1) -> TrainBatch:
    """The trainer's batch of `examples`: one right-padded row each, or with `pack_to` several per row
    (`pack_rows`). `response_mask[t]` is whether token t+1 is learned (rl.types' alignment); the loss sees the same
    learned tokens either way, so a token-mean loss is the same. The fields a policy loss reads and SFT has none of
    are zeros (behaviour log-probs, advantages, rewards) and -1 (versions).

    Packed, the examples are split into `minibatches` successive groups as the trainer splits rows (each its own
    optimizer step on the same examples as unpacked), each group is packed on its own and filled with empty rows
    to the same count, a multiple of `ranks` (every data-parallel rank takes an equal share of rows)."""
    if pack_to is None:
        return _batch([[e] for e in examples], pad_id, packed=False)
    if len(examples) % minibatches:
        raise ValueError(f"{len(examples)} examples: must split evenly into {minibatches} minibatches")
    size = len(examples) // minibatches
    groups = [pack_rows(examples[s : s + size], pack_to) for s in range(0, len(examples), size)]
    count = -(-max(map(len, groups)) // ranks) * ranks
    return _batch([row for group in groups for row in group + [[]] * (count - len(group))], pad_id, packed=True)


def pack_rows(examples: list[Example], length: int) -> list[list[Example]]:
    """Rows of examples, each row's tokens at most `length` (an example longer than that alone in its row): first
    fit, longest first. Examples are never split: a split one would lose the context of its second part."""
    rows: list[list[Example]] = []
    free: list[int] = []
    for example in sorted(examples, key=len, reverse=True):
        row = next((r for r, space in enumerate(free) if len(example) <= space), None)
        if row is None:
            rows.append([])
            free.append(length)
            row = len(rows) - 1
        rows[row].append(example)
        free[row] -= len(example)
    return rows


def _batch(rows: list[list[Example]], pad_id: int, packed: bool) -> TrainBatch:
    """Each row's examples one after another, right-padded; with `packed`, `document_ids` numbers them in the row
    (the padding after them one more) so that each attends only to itself."""
    length = max(2, max(sum(map(len, row)) for row in rows))
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1)
    documents = torch.zeros(len(rows), length, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for document, example in enumerate(row):
            end = start + len(example)
            ids[r, start:end] = torch.tensor(example.ids)
            # Within the example only: its last token predicts the next example's first, which is not learned.
            mask[r, start : end - 1] = torch.tensor(example.learned[1:], dtype=torch.float32)
            documents[r, start:end] = document
            start = end
        documents[r, start:] = len(row)
    zeros = torch.zeros(len(rows))
    return TrainBatch(input_ids=ids, response_mask=mask, behaviour_logprobs=torch.zeros_like(mask),
                      policy_versions=torch.full_like(mask, -1, dtype=torch.long), advantages=zeros,
                      rewards=zeros.clone(), document_ids=documents if packed else None)


def __getattr__(name: str) -> Any:
    """`transcript_example` moved to rl.demonstrations (shared with the warm start): importable from here for one
    release."""
    if name != "transcript_example":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    from rl import demonstrations

    warnings.warn(f"{__name__}.{name} is deprecated: use rl.demonstrations.{name}", DeprecationWarning, stacklevel=2)
    return demonstrations.transcript_example
