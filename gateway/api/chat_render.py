"""The chat and completions chunks of a generation, as vllm serve sends them (the renderers the API hands
the delivery core), and how they merge for a lagging reader.

- :class:`ChatRenderer`: tokenfan's plain path: each chunk from the generation's byte template
  (:class:`ChunkTemplate`) with only the text spliced in; role, finish and usage chunks as dicts.
- :class:`EngineChunkRenderer`: a request served by vLLM's OpenAI layer: the engine's whole chunks.
- :func:`chunk_events`: the same rendering over a request's deltas, for what reads a generation whole.
- :data:`CHUNK_MERGE`: the merge rules of OpenAI chunks (:class:`gateway.core.merge.MergeRules`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

from engine_worker import protocol as p
from gateway.core.generation import Renderer
from gateway.core.streams import ChunkEvent
from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.api.chat_request import ChunkBuilder
    from gateway.core.request import RequestHandle
    from gateway.core.streams import Event


class ChunkTemplate:
    """An OpenAI content chunk of one generation as bytes with a hole for the text: rendering a token is
    ``prefix + orjson.dumps(text) + suffix`` (~0.3 µs; building the dict and serializing it whole costs
    ~2.5 µs here). The template is cut from the builder's own chunk, so both give the same bytes."""

    __slots__ = ("prefix", "suffix")

    _HOLE = "\x00tokenfan-text\x00"

    def __init__(self, builder: ChunkBuilder) -> None:
        whole = orjson.dumps(builder.delta_chunk(self._HOLE, None))
        self.prefix, self.suffix = whole.split(orjson.dumps(self._HOLE))

    def render(self, text: str, seq: int = 0) -> bytes:
        """The chunk carrying ``text`` (a chunk does not number itself: ``seq`` is not in it)."""
        return self.prefix + orjson.dumps(text) + self.suffix


class ChatRenderer:
    """Chat and completions chunks of tokenfan's plain path, as vllm serve sends them: the role chunk with
    the first step, one chunk per engine step (empty content while the detokenizer holds text back; a
    client's inter-token gaps then mean the same on both), the usage chunk last if asked for."""

    def __init__(self, builder: ChunkBuilder, *, started: bool = False) -> None:
        """``started``: the role chunk went out already (a stream another gateway adopted mid-answer)."""
        self.builder = builder
        self.template = ChunkTemplate(builder)
        self._role = None if started else builder.role_chunk()

    def opening(self) -> list[ChunkEvent]:
        return []

    def step(self, d: p.Delta) -> list[ChunkEvent]:
        if not d.text and not d.token_count and d.finish_reason is None:
            return []  # nothing generated (an empty engine step)
        out: list[ChunkEvent] = []
        if self._role is not None:
            # The role chunk goes out with the first token, as vllm serve sends it: a client's TTFT and
            # first inter-token gap then measure the engine, not the accept.
            out.append(ChunkEvent(self._role, d.emit_ns, "", 0))
            self._role = None
        if d.finish_reason is None:
            out.append(ChunkEvent(None, d.emit_ns, d.text, d.token_count, template=self.template))
            return out
        out.append(ChunkEvent(self.builder.delta_chunk(d.text, d.finish_reason), d.emit_ns, d.text, d.token_count,
                              d.finish_reason, d.usage))
        if self.builder.include_usage and d.usage is not None:
            out.append(ChunkEvent(self.builder.usage_chunk(d.usage), d.emit_ns, "", 0, None, d.usage))
        return out

    def closing(self, err: APIError | None) -> list[ChunkEvent]:
        return []


class EngineChunkRenderer:
    """A request served by vLLM's OpenAI layer: the engine's whole chunks pass through unchanged."""

    def opening(self) -> list[ChunkEvent]:
        return []

    def step(self, d: p.Delta) -> list[ChunkEvent]:
        return [engine_chunk(d)] if d.chunk else []

    def closing(self, err: APIError | None) -> list[ChunkEvent]:
        return []


def chat_renderer(handle: RequestHandle, builder: ChunkBuilder) -> Renderer:
    """The OpenAI chunks of an accepted request (whole chunks from the engine under vLLM's layer)."""
    return EngineChunkRenderer() if handle.openai else ChatRenderer(builder)


async def chunk_events(
    handle: RequestHandle, builder: ChunkBuilder, idle: float | None = None
) -> AsyncIterator[ChunkEvent | None]:
    """Chunks of one accepted request, in order; ``None`` is a keep-alive tick.

    Raises :class:`gateway.errors.APIError` if the engine fails the request."""
    renderer = chat_renderer(handle, builder)
    async for d in handle.deltas(idle):
        if d is None:
            yield None
            continue
        for ev in renderer.step(d):
            yield ev


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


class ChunkMerge:
    """How OpenAI chunks merge for a lagging reader (:class:`gateway.core.merge.MergeRules`): a chunk whose
    one choice (index 0) carries only text; tool-call, reasoning and logprob deltas and the choices of
    ``n`` > 1 are never merged (their own event each, so nothing in them is rebuilt)."""

    def group(self, payload: dict[str, Any]) -> object | None:
        choices = payload.get("choices")
        if not choices or len(choices) != 1:
            return None
        choice = choices[0]
        if choice.get("index", 0) != 0 or choice.get("logprobs") is not None:
            return None
        delta = choice.get("delta")
        text_only = delta.keys() <= {"role", "content"} if isinstance(delta, dict) else "text" in choice
        return 0 if text_only else None

    def merged(self, run: list[Event], text: str) -> dict[str, Any]:
        last = run[-1]
        payload = dict(last.payload)
        choice = dict(payload["choices"][0])
        if "delta" in choice:
            delta: dict[str, Any] = {}
            role = next((e.payload["choices"][0]["delta"].get("role") for e in run
                         if e.payload["choices"][0]["delta"].get("role")), None)
            if role:
                delta["role"] = role
            if text or role or last.finish_reason is None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        payload["choices"] = [choice]
        return payload


CHUNK_MERGE = ChunkMerge()
