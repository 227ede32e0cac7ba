"""Chat mode of the multi-turn rollout (`environment.chat_template: true`): each turn wrapped by the model's chat
template, applied once, by token ids.

    <|im_start|>user\\n12+c=<|im_end|>\\n<|im_start|>assistant\\n     first prompt: the reset observation, rendered
    c?<|im_end|>                                                     the model's turn, ended by its end-of-turn token
    \\n<|im_start|>user\\n7;<|im_end|>\\n<|im_start|>assistant\\n     after_turn: the template's tokens, by id
    91<|im_end|>                                                     ...

The ids that follow a model turn are what the template writes after an assistant's answer, a user message with the
observation and the generation prompt: the template renders a conversation whose answer is a probe, and the ids after
the probe's are taken (the rendering up to the probe must encode to a prefix of the whole, else the template's tokens
would not be its own). Nothing the model wrote is rendered or re-encoded, so a template that shows earlier turns
differently (Qwen3 drops their thinking) changes nothing here: the trainer scores the sequence the model saw. The
template's end-of-turn token ends a model turn, not the episode; when a turn has none (cut by `max_tokens`) the
template's own is appended with the observation, as an environment token.
"""

from __future__ import annotations

import functools
from typing import Any

from jinja2.exceptions import TemplateError

from rl.environments.protocol import Observation

# Stands for the model's turn in a rendered conversation: what the template writes after it is new to the model.
_PROBE = "forge model turn probe"
# The earlier user message of the probe conversation (a template may insist that a conversation opens with a user).
_ASKED = "forge question probe"


class ChatTemplate:
    """`first_prompt(observation)` and `after_turn(observation, last_token)` as token ids, in `tokenizer`'s chat
    template (with `chat_template_kwargs`, e.g. Qwen3's enable_thinking, and an optional system message)."""

    def __init__(self, tokenizer: Any, *, system_prompt: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"environment.chat_template=true: the model's tokenizer "
                             f"({getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}) has no chat "
                             "template; set environment.chat_template=false to play episodes in plain text")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        # Prompts and observations repeat (a group's G episodes, a tool's short replies): each is rendered once.
        self._first = functools.lru_cache(maxsize=1 << 16)(self._render_first)
        self._after = functools.lru_cache(maxsize=1 << 16)(self._render_after)
        # The token the template writes right after an answer, when it is a special token: the model's end of turn.
        between = self._after("")
        following = between[0] if between else None
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self.end_of_turn_id: int | None = following if following in special else None

    def first_prompt(self, observation: Observation) -> list[int]:
        """The reset observation as the conversation's first user message, with the generation prompt. Token ids are
        the environment's own prompt, used as they are."""
        return list(observation) if not isinstance(observation, str) else list(self._first(observation))

    def after_turn(self, observation: Observation, last_token: int | None) -> list[int]:
        """The ids that follow a model turn that ended with `last_token`: the end of its turn (unless the model wrote
        it), the observation as a user message, and the generation prompt. Token ids are appended as they are: an
        environment that gives ids writes its own template tokens."""
        if not isinstance(observation, str):
            return list(observation)
        ids = self._after(observation)
        return list(ids[1:] if ids and ids[0] == last_token else ids)

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(self.system + messages, tokenize=False,
                                                      add_generation_prompt=True, **self.kwargs)
        except TemplateError as e:
            raise ValueError(f"environment.chat_template=true: the model's chat template cannot render a "
                             f"{'system message and ' if self.system else ''}user/assistant conversation ({e})"
                             + ("; leave environment.system_prompt unset" if self.system else "")) from None

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))  # the template writes its own BOS

    def _render_first(self, observation: str) -> tuple[int, ...]:
        return self._encode(self._render([{"role": "user", "content": observation}]))

    def _render_after(self, observation: str) -> tuple[int, ...]:
        text = self._render([{"role": "user", "content": _ASKED}, {"role": "assistant", "content": _PROBE},
                             {"role": "user", "content": observation}])
        if text.count(_PROBE) != 1:
            raise ValueError("environment.chat_template=true: the model's chat template does not write an assistant "
                             "message's text once, as it is; the tokens between turns cannot be told apart")
        head = text[: text.index(_PROBE) + len(_PROBE)]
        whole, prefix = self._encode(text), self._encode(head)
        if whole[: len(prefix)] != prefix:
            inside = list(whole[max(0, len(prefix) - 4) : len(prefix)])
            raise ValueError("environment.chat_template=true: the model's chat template is not prefix-stable: the "
                             "conversation up to the model's turn encodes to other ids alone (ending "
                             f"{list(prefix[-4:])}) than inside the whole conversation ({inside}), so the tokens the "
                             "template writes after a turn are not its own")
        return whole[len(prefix):]
