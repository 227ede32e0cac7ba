"""SFT examples (apps/sft/data.py): which token ids are learned, checked token by token against the rendering written
out segment by segment, for prompt-completion rows, multi-turn chat, tool calls and Qwen3's history; the batch's
alignment; the data order's state. Character-level tokenizers with real templates, built here (no hub)."""

from __future__ import annotations

import json

import pytest

from apps.sft.data import ChatRenderer, Epochs, Example, read_dataset, read_jsonl, row_examples, \
    split_held_out, train_batch
from rl.tiny_model import build_tokenizer
from tests.rl.environments.test_chat import QWEN3_LIKE
from tests.rl.tasks.test_chat import CHATML, chat_tokenizer
from tests.support import tokenizer_merging_across_turns

# ChatML with tool calls and tool results, as Qwen's templates lay them out (simplified).
CHATML_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def reference(tokenizer, segments: list[tuple[str, bool]]) -> Example:
    """The example written out by hand: each (text, learned) segment's ids, one after another."""
    all_ids, learned = [], []
    for text, on in segments:
        piece = ids(tokenizer, text)
        all_ids += piece
        learned += [on] * len(piece)
    return Example(tuple(all_ids), tuple(learned))


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer(CHATML, SPECIALS)


def test_a_prompt_completion_row_learns_the_completion_and_its_end_only():
    tokenizer = build_tokenizer()
    (example,) = row_examples({"prompt": "12+34=", "completion": "64"}, "row 1", tokenizer, None)
    eos = tokenizer.eos_token_id
    assert example == Example(tuple(tokenizer.encode("12+34=") + ids(tokenizer, "64") + [eos]),
                              (False,) * 6 + (True,) * 3)


def test_the_batch_marks_the_position_that_predicts_each_learned_token():
    short, long = Example((5, 6, 7), (False, True, True)), Example((5, 6, 7, 8, 9), (False, False, True, True, False))
    batch = train_batch([short, long], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]]
    # response_mask[t] is 1 when token t+1 is learned (rl.types' alignment); padding is never learned.
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [0, 1, 1, 0]]
    assert batch.policy_versions.tolist() == [[-1] * 4] * 2 and batch.advantages.tolist() == [0, 0]


def test_a_multi_turn_conversation_is_one_row_learning_every_assistant_message(chatml):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+c="},
                {"role": "assistant", "content": "c?"}, {"role": "user", "content": "c=7"},
                {"role": "assistant", "content": "19"}, {"role": "user", "content": "thanks"}]
    (example,) = ChatRenderer(chatml, {}, "data").examples(messages, None, "row 1")
    assert example == reference(chatml, [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n12+c=<|im_end|>\n<|im_start|>assistant\n", False),
        ("c?<|im_end|>", True),
        ("\n<|im_start|>user\nc=7<|im_end|>\n<|im_start|>assistant\n", False),
        ("19<|im_end|>", True),  # the template's newline after it and the last user message: not in the row
    ])
    assert chatml.apply_chat_template(messages[:5], return_dict=False)[: len(example.ids)] == list(example.ids)


def test_the_template_arguments_reach_the_rendering(chatml):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert len(ChatRenderer(chatml, {}, "data").examples(messages, None, "row 1")) == 1
    # With enable_thinking=false this template's generation prompt writes an empty thinking block that its rendering of
    # an answer lacks: what the model would be trained to follow is not what it is prompted with, so it is refused.
    with pytest.raises(ValueError, match="not prefix-stable at message 1"):
        ChatRenderer(chatml, {"enable_thinking": False}, "data").examples(messages, None, "row 1")


def test_tool_calls_and_tool_results_learn_the_call_not_the_result():
    tokenizer = chat_tokenizer(CHATML_TOOLS, SPECIALS)
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 7}'}}
    messages = [{"role": "user", "content": "12+7?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "19"}, {"role": "assistant", "content": "19"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    (example,) = ChatRenderer(tokenizer, {}, "data").examples(messages, tools, "row 1")
    assert example == reference(tokenizer, [
        ("<|im_start|>user\n12+7?<|im_end|>\n<|im_start|>assistant\n", False),
        ('<tool_call>add {"a": 12, "b": 7}</tool_call><|im_end|>', True),
        ("\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n", False),
        ("19<|im_end|>", True),
    ])


def test_qwen3_history_without_thinking_gives_a_row_per_assistant_message():
    # Qwen3's template shows an earlier answer without its thinking (its model card: history carries no thinking), so
    # the first answer is learned as the model wrote it, thinking and all, in a row of its own; the second answer's
    # row has the first one as the template shows history.
    tokenizer = chat_tokenizer(QWEN3_LIKE, SPECIALS)
    messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "<think>one</think>2"},
                {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "<think>two</think>4"}]
    first, second = ChatRenderer(tokenizer, {}, "data").examples(messages, None, "row 1")
    assert first == reference(tokenizer, [("<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n", False),
                                          ("<think>one</think>2<|im_end|>", True)])
    assert second == reference(tokenizer, [
        ("<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("<think>two</think>4<|im_end|>", True),
    ])


def test_a_template_that_is_not_prefix_stable_is_refused_with_the_reason():
    # A BPE merge across the end of the assistant's text: chat mode's own check (rl.environments.chat) refuses it.
    tokenizer = tokenizer_merging_across_turns()
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}!\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match=r"^data.path='x.jsonl': chat rows need the model's chat template: the "
                                         r"model's chat template is not prefix-stable"):
        ChatRenderer(tokenizer, {}, "data.path='x.jsonl'")


def test_a_generation_prompt_unlike_the_assistants_rendering_is_refused_at_its_row():
    tokenizer = chat_tokenizer("{% for m in messages %}[{{ m.role }}]{{ m.content }}<|im_end|>{% endfor %}"
                               "{% if add_generation_prompt %}[bot]{% endif %}", SPECIALS)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match=r"^row 3: the chat template is not prefix-stable at message 1"):
        ChatRenderer(tokenizer, {}, "data").examples(messages, None, "row 3")


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^data.path='x.jsonl': chat rows need the model's chat template: the "
                                         r"model's tokenizer .* has no chat template"):
        ChatRenderer(build_tokenizer(), {}, "data.path='x.jsonl'")


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "q"}, r"a row must have 'prompt' and 'completion' \(strings\) or 'messages' .*; it has \['prompt'\]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role='robot': must be one of system, user, "
                                                         r"assistant, tool"),
    ({"messages": [{"role": "user", "content": "q"}]}, r"no assistant message: nothing to learn"),
    ({"messages": [{"role": "assistant", "content": 3}]}, r"messages\[0\].content=3: must be a string"),
    ({"messages": []}, r"messages=\[\]: must be a non-empty list"),
])
def test_a_bad_row_is_refused_naming_where_it_is(chatml, row, message):
    with pytest.raises(ValueError, match=rf"^data.path='d.jsonl' line 2: {message}"):
        row_examples(row, "data.path='d.jsonl' line 2", chatml, ChatRenderer(chatml, {}, "data"))


def test_jsonl_and_the_datasets_library_read_the_same_rows(tmp_path, chatml):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert [row for _, row in read_jsonl(path, "data.path")] == rows
    assert [row for _, row in read_dataset(str(path), None, "train", "data.path")] == rows
    path.write_text('{"prompt": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=rf"^data.path='{path}' line 2: not JSON"):
        read_jsonl(path, "data.path")


def test_a_dataset_the_datasets_library_cannot_load_is_refused_naming_the_field(tmp_path):
    missing = str(tmp_path / "no_such_dataset")
    with pytest.raises(ValueError, match=rf"^data.path='{missing}': `datasets` cannot load it .*FileNotFound"):
        read_dataset(missing, None, "train", "data.path")


def test_held_out_rows_are_disjoint_from_training_and_seeded():
    rows = list(range(20))
    train, held = split_held_out(rows, 5, seed=0)
    assert sorted(train + held) == rows and len(held) == 5
    assert split_held_out(rows, 5, seed=0) == (train, held) and split_held_out(rows, 5, seed=1) != (train, held)


def test_epochs_serve_each_example_once_per_epoch_and_resume_where_they_stopped():
    examples = [Example((i,), (True,)) for i in range(10)]
    epochs = Epochs(examples, seed=0)
    first = epochs.take(4) + epochs.take(4)
    state = epochs.state_dict()
    following = epochs.take(6)  # the epoch's last 2, then 4 of the next (reshuffled)
    assert sorted(e.ids for e in first + following[:2]) == [(i,) for i in range(10)]
    resumed = Epochs(examples, seed=0)
    resumed.load_state_dict(state)
    assert resumed.take(6) == following
