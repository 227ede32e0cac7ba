"""How a task's instruction becomes a model's prompt, and which tokens end the model's answer.

A chat model answers well only inside its chat template, and ends its turn with its own token (Qwen's
`<|im_end|>`, Llama 3's `<|eot_id|>`), which is not always the tokenizer's EOS. With a tokenizer that has a
chat template, prompts are rendered with it (`apply_chat_template`, generation prompt added) and generation
stops on the end-of-turn token as well as EOS; without one, prompts are the plain text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Stands for an answer when rendering a whole exchange: what the template writes after it ends the turn.
_ANSWER = "forge answer probe"


class PromptFormat:
    """`format(instruction)` -> the prompt text; `stop_token_ids`: the tokens that end the answer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer if tokenizer is not None and tokenizer.chat_template else None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.stop_token_ids = end_of_turn_ids(tokenizer, self.chat_template_kwargs) if tokenizer is not None else []

    @property
    def uses_chat_template(self) -> bool:
        return self.tokenizer is not None

    def format(self, instruction: str) -> str:
        if self.tokenizer is None:
            return instruction
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                                  add_generation_prompt=True, **self.chat_template_kwargs)
        # Generators encode the text with the tokenizer's special tokens; a BOS the template already wrote
        # would then appear twice.
        bos = self.tokenizer.bos_token
        if bos and text.startswith(bos) and self.tokenizer("").input_ids[:1] == [self.tokenizer.bos_token_id]:
            text = text[len(bos):]
        return text


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """EOS, and the special token the chat template writes right after an assistant's answer."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if not tokenizer.chat_template:
        return ids
    exchange = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _ANSWER}]
    try:
        text = tokenizer.apply_chat_template(exchange, tokenize=False, **(chat_template_kwargs or {}))
    except (TemplateError, ValueError):  # a template that cannot render an answer: EOS alone
        return ids
    after = text.rpartition(_ANSWER)[2]
    following = tokenizer(after, add_special_tokens=False).input_ids[:1] if _ANSWER in text else []
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return ids + [t for t in following if t in special and t not in ids]
