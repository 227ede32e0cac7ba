"""`stream=true`: a finished chat completion as OpenAI's server-sent events.

The engines return whole completions, so the events come once the completion is sampled: the assistant role,
the content (with its log-probs when asked), the finish reason with forge's record of the interaction, the usage
when `stream_options.include_usage`, then `[DONE]`. Errors (a bad key, no capacity) are answered before the
stream starts, as ordinary JSON errors with their status codes.
"""

from __future__ import annotations

from collections.abc import Iterator

from apps.gateway.schemas import ChatCompletionChunk, ChatCompletionResponse, ChunkChoice, ChunkDelta


def completion_events(response: ChatCompletionResponse, *, include_usage: bool) -> Iterator[str]:
    choice = response.choices[0]
    head = dict(id=response.id, created=response.created, model=response.model,
                system_fingerprint=response.system_fingerprint)
    chunks = [
        ChatCompletionChunk(**head, choices=[ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""))]),
        ChatCompletionChunk(**head, choices=[ChunkChoice(index=0, delta=ChunkDelta(content=choice.message.content),
                                                         logprobs=choice.logprobs)]),
        ChatCompletionChunk(**head, choices=[ChunkChoice(index=0, delta=ChunkDelta(),
                                                         finish_reason=choice.finish_reason)],
                            forge=response.forge),
    ]
    if include_usage:
        chunks.append(ChatCompletionChunk(**head, choices=[], usage=response.usage))
    for chunk in chunks:
        yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
    yield "data: [DONE]\n\n"
