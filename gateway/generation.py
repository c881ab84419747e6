"""One generation as a sequence of OpenAI chunks: engine deltas in, chunk objects out.

Every transport (POST SSE, ``/v1/ws``, fan-out streams, non-streaming) consumes this one
iterator, so they all carry exactly the same chunk objects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from engine_worker import protocol as p
from gateway.engine_client import RequestHandle
from gateway.openai_api import ChunkBuilder


@dataclass(slots=True)
class ChunkEvent:
    chunk: dict[str, Any]
    emit_ns: int  # engine emit time of the delta behind this chunk
    text: str  # the content text it carries ("" for role/usage chunks)
    tokens: int
    finish_reason: str | None = None
    usage: p.Usage | None = None


async def chunk_events(
    handle: RequestHandle, builder: ChunkBuilder, idle: float | None = None
) -> AsyncIterator[ChunkEvent | None]:
    """Chunks of one accepted request, in order; ``None`` is a keep-alive tick.

    Raises :class:`gateway.errors.APIError` if the engine fails the request. A request the engine serves
    with vLLM's OpenAI layer (``handle.openai``) arrives as whole chunks: they pass through unchanged.
    """
    if handle.openai:
        async for d in handle.deltas(idle):
            if d is None:
                yield None
            elif d.chunk:
                yield engine_chunk(d)
        return
    # The role chunk goes out with the first token, as vllm serve sends it: a client's TTFT and first
    # inter-token gap then measure the engine, not the accept.
    role = builder.role_chunk()
    usage: p.Usage | None = None
    async for d in handle.deltas(idle):
        if d is None:
            yield None
            continue
        if not d.text and not d.token_count and d.finish_reason is None:
            continue  # nothing generated (an empty engine step)
        # A step whose text the detokenizer holds back (an incomplete UTF-8 sequence, a possible stop
        # string) still gets its chunk with empty content, as vllm serve sends it: one chunk per engine
        # step, so token counts and a client's inter-token gaps mean the same on both.
        if role is not None:
            yield ChunkEvent(role, d.emit_ns, "", 0)
            role = None
        usage = d.usage
        yield ChunkEvent(builder.delta_chunk(d.text, d.finish_reason), d.emit_ns, d.text, d.token_count,
                         d.finish_reason, d.usage)
    if builder.include_usage and usage is not None:
        yield ChunkEvent(builder.usage_chunk(usage), p.now_ns(), "", 0, None, usage)


def engine_chunk(d: p.Delta) -> ChunkEvent:
    """An event for a whole chunk from the engine (vLLM's OpenAI layer): its text and finish reason are
    read from its only choice, for retention and the broker; nothing in it is rebuilt."""
    chunk = orjson.loads(d.chunk)
    choices: list[Any] = chunk.get("choices") or []
    text, finish = "", None
    if len(choices) == 1:
        choice = choices[0]
        finish = choice.get("finish_reason")
        delta = choice.get("delta")
        value = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text = value if isinstance(value, str) else ""
    return ChunkEvent(chunk, d.emit_ns, text, d.token_count, finish, d.usage)
