"""One generation: engine deltas in, the stream's events out, in the engine step that produced them.

The engine link (:meth:`gateway.core.engine_client.EngineClient._on_batch`) hands each delta of a
``DeltaBatch`` to its request's :class:`Generation` (``on_delta``), synchronously: the generation renders
the step's payloads (:class:`ChatRenderer`: OpenAI chunks from a per-generation byte template with only
the text spliced in; vLLM's layer's whole chunks; or an API module's renderer, e.g. the Responses
events, their text deltas from a template too), appends them to its :class:`gateway.core.streams.Stream`,
which writes them to every caught-up reader in the same pass. No queue, task wake-up or generator chain
per token.

:func:`chunk_events` is the same rendering as an async iterator over a request's deltas, for what reads a
generation whole (non-streaming responses).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from engine_worker import protocol as p
from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.api.openai_api import ChunkBuilder
    from gateway.core.conn import Step
    from gateway.core.engine_client import RequestHandle
    from gateway.core.metrics import HotCounter
    from gateway.core.streams import Event, Stream

log = logging.getLogger(__name__)


class Template(Protocol):
    """A generation's payload as pre-encoded bytes with holes (:class:`ChunkTemplate`, the Responses API's
    ``TextDeltaTemplate``): rendering splices in an event's text and, for a payload that numbers itself (a
    Responses event's ``sequence_number``), its ``seq`` in the stream's log."""

    def render(self, text: str, seq: int) -> bytes: ...


class ChunkEvent:
    """One payload to append: its dict (``chunk``), or its ``template`` and text (the template renders the
    JSON; the dict is parsed only if asked for), the engine emit time of the delta behind it, and its
    accounting. ``seq``: the log position a payload that numbers itself names (the stream checks it)."""

    __slots__ = ("emit_ns", "finish_reason", "payload", "seq", "template", "text", "tokens", "usage")

    def __init__(self, chunk: dict[str, Any] | None, emit_ns: int, text: str, tokens: int,
                 finish_reason: str | None = None, usage: p.Usage | None = None, *,
                 template: Template | None = None, seq: int | None = None) -> None:
        self.payload = chunk  # None when rendered from a template
        self.template = template
        self.seq = seq
        self.emit_ns = emit_ns  # engine emit time of the delta behind this chunk
        self.text = text  # the content text it carries ("" for role/usage chunks)
        self.tokens = tokens
        self.finish_reason = finish_reason
        self.usage = usage

    @property
    def chunk(self) -> dict[str, Any] | None:
        """The payload as a dict (rendered and parsed if it comes from a template)."""
        if self.payload is None and self.template is not None:
            self.payload = orjson.loads(self.template.render(self.text, self.seq or 0))
        return self.payload


class Renderer(Protocol):
    """An API's payloads for one generation (``step`` includes the closing payloads of the last delta)."""

    def opening(self) -> list[ChunkEvent]:
        """Payloads appended as soon as the generation starts (the Responses lifecycle events)."""
        ...

    def step(self, d: p.Delta) -> list[ChunkEvent]:
        """The payloads of one engine step's delta."""
        ...

    def closing(self, err: APIError | None) -> list[ChunkEvent]:
        """Payloads appended when the generation fails (``err``) or is cancelled (None)."""
        ...


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

    def __init__(self, builder: ChunkBuilder) -> None:
        self.builder = builder
        self.template = ChunkTemplate(builder)
        self._role = builder.role_chunk()

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
    """How OpenAI chunks merge for a lagging reader (:class:`gateway.core.streams.MergeRules`): a chunk whose
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


class Publisher(Protocol):
    """Where a listed stream's events also go (the broker); see :mod:`gateway.scaleout.broker`."""

    def published(self, stream: Stream, event: Event) -> None: ...


class Generation:
    """One running generation: the engine link calls :meth:`on_delta` for each delta, inside its step;
    the rendered payloads are appended to ``stream`` (written to caught-up readers in the same pass).

    ``ended`` resolves when the generation is over: with None after its last delta, with the error it
    failed with. A cancel (:meth:`cancel`) appends the renderer's closing payloads and ends the stream."""

    __slots__ = ("ended", "handle", "publisher", "renderer", "stream", "tokens")

    def __init__(self, stream: Stream, handle: RequestHandle, renderer: Renderer, tokens: HotCounter,
                 publisher: Publisher | None = None) -> None:
        self.stream = stream
        self.handle = handle
        self.renderer = renderer
        self.tokens = tokens
        self.publisher = publisher
        self.ended: asyncio.Future[APIError | None] = asyncio.get_running_loop().create_future()

    def start(self) -> None:
        """Append the opening payloads and take the request's deltas from now on."""
        for ev in self.renderer.opening():
            self._publish(ev, None)
        self.handle.attach(self)

    def on_delta(self, d: p.Delta, step: Step | None) -> None:
        """One engine step's delta: its payloads appended and written; the end after the last one."""
        if self.ended.done():
            return
        for ev in self.renderer.step(d):
            self._publish(ev, step)
        if d.finish_reason is not None:
            self.stream.finish("done")
            self.ended.set_result(None)

    def on_failure(self, err: APIError) -> None:
        """The engine failed the request (or the gateway failed every request, e.g. at shutdown)."""
        if self.ended.done():
            return
        for ev in self.renderer.closing(err):
            self._publish(ev, None)
        self.stream.finish("error", err)
        self.ended.set_result(err)

    def cancel(self) -> None:
        """Cancelled (no reader left, an explicit cancel): the closing payloads, then the end."""
        if self.ended.done():
            return
        for ev in self.renderer.closing(None):
            self._publish(ev, None)
        self.stream.finish("cancelled")
        self.ended.cancel()

    def _publish(self, ev: ChunkEvent, step: Step | None) -> None:
        event = self.stream.publish(ev, step)
        if self.publisher is not None:
            self.publisher.published(self.stream, event)
        if ev.tokens:
            self.tokens.inc(ev.tokens)
