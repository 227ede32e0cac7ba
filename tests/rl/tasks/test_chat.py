"""Prompts in the model's chat template, answers stopped at its end of turn (tokenizers built here, no hub)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

from rl.tasks.chat import PromptFormat, end_of_turn_ids
from rl.tasks.gsm8k import GSM8KTask
from rl.tiny_model import CHARACTERS, build_tokenizer

# A ChatML-style template (the layout Qwen models use), with Qwen3's switch for an empty thinking block.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# Llama-3 style: the template writes BOS itself and turns end with their own token, not EOS.
BOS_TEMPLATE = (
    "<s>{% for m in messages %}[{{ m.role }}]{{ m.content }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def chat_tokenizer(template: str, specials: tuple[str, ...], *, add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with the chat template's special tokens, EOS distinct from the end of turn."""
    vocab = {token: i for i, token in enumerate(("<|pad|>", "<|endoftext|>", "<|unk|>", *CHARACTERS))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                        unk_token="<|unk|>", additional_special_tokens=list(specials))
    if add_bos:
        tokenizer.bos_token = "<s>"
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.convert_tokens_to_ids("<s>"))])
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer(CHATML, ("<|im_start|>", "<|im_end|>"))


def test_prompt_is_rendered_in_the_chat_template_and_stops_at_the_end_of_turn(chatml):
    prompts = PromptFormat(chatml)
    assert prompts.format("1+1?") == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert prompts.stop_token_ids == [chatml.eos_token_id, im_end] and im_end != chatml.eos_token_id
    # The rendered prompt encodes to the template's own tokens: the special tokens are single tokens.
    messages = [{"role": "user", "content": "1+1?"}]
    assert chatml(prompts.format("1+1?")).input_ids == chatml.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def test_chat_template_arguments_reach_the_template(chatml):
    prompts = PromptFormat(chatml, {"enable_thinking": False})
    assert prompts.format("q").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_tokenizer_without_a_chat_template_keeps_the_plain_prompt():
    tokenizer = build_tokenizer()
    prompts = PromptFormat(tokenizer)
    assert not prompts.uses_chat_template
    assert prompts.format("12+34=") == "12+34="
    assert prompts.stop_token_ids == [tokenizer.eos_token_id]
    assert PromptFormat().stop_token_ids == [] and PromptFormat().format("x") == "x"


def test_a_template_that_writes_bos_does_not_get_it_twice():
    tokenizer = chat_tokenizer(BOS_TEMPLATE, ("<s>", "<|eot|>"), add_bos=True)
    assert tokenizer("x").input_ids[0] == tokenizer.bos_token_id  # encoding adds BOS itself
    prompts = PromptFormat(tokenizer)
    messages = [{"role": "user", "content": "q"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tokenizer(prompts.format("q")).input_ids == rendered
    assert end_of_turn_ids(tokenizer) == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot|>")]


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    rows = [{"question": f"Tom has {n} apples and buys 2. How many?", "answer": f"{n}+2={n + 2}\n#### {n + 2}"}
            for n in range(5)]
    path = tmp_path_factory.mktemp("gsm8k") / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


def test_gsm8k_asks_in_the_chat_template_and_names_its_stop_tokens(gsm8k_file, chatml):
    task = GSM8KTask(str(gsm8k_file), held_out=2, tokenizer=chatml, chat_template_kwargs={"enable_thinking": False})
    held = task.held_out()
    n = int(held[0].answer.rsplit("#### ", 1)[1]) - 2
    assert len(held) == 2
    assert held[0].prompt == (f"<|im_start|>user\nTom has {n} apples and buys 2. How many?\nThink step by step, then "
                              "give the final answer after '####'.<|im_end|>\n"
                              "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert task.stop_token_ids == [chatml.eos_token_id, chatml.convert_tokens_to_ids("<|im_end|>")]


def test_gsm8k_without_a_tokenizer_uses_the_plain_prompt(gsm8k_file):
    task = GSM8KTask(str(gsm8k_file), held_out=1)
    n = int(task.held_out()[0].answer.rsplit("#### ", 1)[1]) - 2
    assert task.held_out()[0].prompt == (f"Question: Tom has {n} apples and buys 2. How many?\nThink step by step, "
                                         "then give the final answer after '####'.\nAnswer:")
    assert task.stop_token_ids == []
