"""Chat messages -> prompt token ids, and a generated completion -> an OpenAI chat-completion response."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from apps.gateway.schemas import (
    AssistantMessage,
    ChatCompletionResponse,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ForgeInteraction,
    TokenLogprob,
    Usage,
)
from apps.http.errors import field_error
from rl.types import Completion


# Stands in for the reply when a chat template renders a continued conversation: what the template puts after it
# is what the model has not seen yet.
REPLY_MARK = "\u27e6forge-reply\u27e7"


@dataclass(frozen=True)
class ChatContext:
    """A session's conversation as the model saw it: the messages (role, text), the reply the gateway answered last,
    and the exact ids the model read and wrote for them (prompt + generated tokens, the end token included)."""

    messages: tuple[tuple[str, str], ...]
    ids: tuple[int, ...]
    stop_text: str | None  # the generated end token's text (a template may render it after the reply); None: cut


def _turns(messages: list[ChatMessage]) -> tuple[tuple[str, str], ...]:
    return tuple((m.role, m.text()) for m in messages)


class PromptEncoder:
    """Messages -> prompt ids. A request that re-sends the session's conversation verbatim (every message and the
    reply the gateway answered, then new messages) continues from the exact ids the model read and wrote, so the
    conversation stays one token-exact episode: re-encoding the history would drop an end token plain text cannot
    carry, or re-render a reply as the template shows history (e.g. without its thinking block), not as sampled."""

    def __init__(self, tokenizer: Any, fmt: str, max_model_len: int) -> None:
        if fmt == "template" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat.format='template': the model's tokenizer has no chat template; use 'plain'")
        self.tokenizer = tokenizer
        self.format = fmt
        self.max_model_len = max_model_len

    def encode(self, messages: list[ChatMessage], context: ChatContext | None = None) -> list[int]:
        """The prompt ids: `context.ids` + the new messages when `messages` continue `context`, else all rendered."""
        after = self._after(messages, context) if context is not None else None
        ids = list(context.ids) + after if after is not None else self._render(messages)
        if not ids:
            raise field_error(["messages"], "", "the messages hold no text: a prompt needs at least one token")
        if len(ids) >= self.max_model_len:  # 400 naming `messages` (the error's `param`), as OpenAI answers it
            raise field_error(["messages"], f"{len(ids)} tokens", f"the prompt has {len(ids)} tokens; the model's "
                              f"window is {self.max_model_len} (at most {self.max_model_len - 1} prompt tokens leave "
                              "room to generate)", status=400)
        return ids

    def context(self, messages: list[ChatMessage], completion: Completion) -> ChatContext:
        """The conversation after `completion` answered `messages`, for the session's next request."""
        stop_text = self.token_text(completion.token_ids[-1]) if completion.finish_reason == "stop" and \
            completion.token_ids else None
        return ChatContext(_turns(messages) + (("assistant", completion.text),),
                           tuple(completion.prompt_ids) + tuple(completion.token_ids), stop_text)

    def _render(self, messages: list[ChatMessage]) -> list[int]:
        if self.format == "template":
            rendered = [{"role": role, "content": text} for role, text in _turns(messages)]
            return list(self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, return_dict=False))
        return self.tokenizer.encode("".join(m.text() for m in messages), add_special_tokens=False)

    def _after(self, messages: list[ChatMessage], context: ChatContext) -> list[int] | None:
        """The ids that follow `context.ids` for `messages`, or None when they do not continue the conversation."""
        turns, seen = _turns(messages), len(context.messages)
        if len(turns) <= seen or turns[:seen] != context.messages:
            return None
        if self.format == "plain":
            return self.tokenizer.encode("".join(text for _, text in turns[seen:]), add_special_tokens=False)
        # The template renders the whole conversation with a mark for the reply; what follows the mark (the end of
        # the reply's turn, the new messages, the generation prompt) is new to the model, less the end token it
        # generated itself. A template that rewrites the reply (drops or repeats the mark) cannot be continued.
        rendered = [{"role": role, "content": text} for role, text in turns]
        rendered[seen - 1]["content"] = REPLY_MARK
        text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        if text.count(REPLY_MARK) != 1:
            return None
        after = text.split(REPLY_MARK)[1]
        if context.stop_text and after.startswith(context.stop_text):
            after = after[len(context.stop_text):]
        return self.tokenizer.encode(after, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def completion_response(completion: Completion, *, interaction_id: str, session_id: str, model: str,
                        trainable: bool, with_logprobs: bool, encoder: PromptEncoder) -> ChatCompletionResponse:
    logprobs = None
    if with_logprobs:
        tokens = [encoder.token_text(t) for t in completion.token_ids]
        logprobs = ChoiceLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                                           for t, lp in zip(tokens, completion.logprobs)])
    finish = "stop" if completion.finish_reason == "stop" else "length"
    versions = list(completion.policy_versions)
    return ChatCompletionResponse(
        id=interaction_id, created=int(time.time()), model=model,
        choices=[Choice(index=0, message=AssistantMessage(content=completion.text), finish_reason=finish,
                        logprobs=logprobs)],
        usage=Usage(prompt_tokens=len(completion.prompt_ids), completion_tokens=len(completion.token_ids),
                    total_tokens=len(completion.prompt_ids) + len(completion.token_ids)),
        system_fingerprint=f"forge-policy-v{max(versions) if versions else 0}",
        forge=ForgeInteraction(session_id=session_id, interaction_id=interaction_id, policy_versions=versions,
                               trainable=trainable))
