"""Chat messages -> prompt token ids, and a generated completion -> an OpenAI chat-completion response."""

from __future__ import annotations

import time
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
from apps.server.errors import ServiceError, field_error
from forge.types import Completion


class PromptEncoder:
    def __init__(self, tokenizer: Any, fmt: str, max_model_len: int) -> None:
        if fmt == "template" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat.format='template': the model's tokenizer has no chat template; use 'plain'")
        self.tokenizer = tokenizer
        self.format = fmt
        self.max_model_len = max_model_len

    def encode(self, messages: list[ChatMessage]) -> list[int]:
        if self.format == "template":
            rendered = [{"role": m.role, "content": m.text()} for m in messages]
            ids = list(self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True))
        else:
            ids = self.tokenizer.encode("".join(m.text() for m in messages), add_special_tokens=False)
        if not ids:
            raise field_error(["messages"], "", "the messages hold no text: a prompt needs at least one token")
        if len(ids) >= self.max_model_len:
            raise ServiceError(400, f"the prompt has {len(ids)} tokens; the model's window is {self.max_model_len} "
                                    f"(at most {self.max_model_len - 1} prompt tokens leave room to generate)")
        return ids

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
