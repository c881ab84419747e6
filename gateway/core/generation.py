"""One generation: engine deltas in, the stream's events out, in the engine step that produced them.

The engine link (:meth:`gateway.core.engine_link.EngineLink.deliver`) hands each delta of a
``DeltaBatch`` to its request's :class:`Generation` (``on_delta``), synchronously: the generation asks its
API's :class:`Renderer` for the step's payloads (chat chunks, Responses events, … — the core knows no
payload shape), appends them to its :class:`gateway.core.streams.Stream`, which writes them to every
caught-up reader in the same pass. No queue, task wake-up or generator chain per token.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from engine_worker import protocol as p
from gateway.core.streams import ChunkEvent
from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.core.metrics import HotCounter
    from gateway.core.ports import Publisher
    from gateway.core.request import RequestHandle
    from gateway.core.step import Step
    from gateway.core.streams import Stream

log = logging.getLogger(__name__)

NO_IDS: list[int] = []  # never appended to: what an unlisted stream's events carry


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


class Generation:
    """One running generation: the engine link calls :meth:`on_delta` for each delta, inside its step;
    the rendered payloads are appended to ``stream`` (written to caught-up readers in the same pass).

    ``ended`` resolves when the generation is over: with None after its last delta, with the error it
    failed with. A cancel (:meth:`cancel`) appends the renderer's closing payloads and ends the stream."""

    __slots__ = ("_ids", "ended", "handle", "publisher", "renderer", "stream", "tokens")

    def __init__(self, stream: Stream, handle: RequestHandle, renderer: Renderer, tokens: HotCounter,
                 publisher: Publisher | None = None) -> None:
        self.stream = stream
        self.handle = handle
        self.renderer = renderer
        self.tokens = tokens
        self.publisher = publisher
        self.ended: asyncio.Future[APIError | None] = asyncio.get_running_loop().create_future()
        self._ids: list[int] = []  # token ids of deltas that rendered no payload yet

    def start(self) -> None:
        """Append the opening payloads and take the request's deltas from now on."""
        for ev in self.renderer.opening():
            self._publish(ev, None)
        self.handle.attach(self)

    def on_delta(self, d: p.Delta, step: Step | None) -> None:
        """One engine step's delta: its payloads appended and written; the end after the last one."""
        if self.ended.done():
            return
        events = self.renderer.step(d)
        # what an adopter resumes from: the token ids, or the engine steps of vLLM's OpenAI layer (packed);
        # only a listed stream is adopted (an unlisted one's request keeps its ids for a migration)
        ids: list[int] = (d.token_ids or (p.pack_steps(d.steps) if d.steps else d.token_ids)) \
            if self.stream.listed else NO_IDS
        if ids or self._ids:
            if not events:
                self._ids += ids
            else:
                events[-1].ids = self._ids + ids if self._ids else ids
                self._ids = []
        if events and self.handle.rejoined:
            self.handle.rejoined = False
            events[0].migrated = True
        for ev in events:
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
        if self.handle.trace is not None:
            self.handle.trace.cancelled()
        for ev in self.renderer.closing(None):
            self._publish(ev, None)
        self.stream.finish("cancelled")
        self.ended.cancel()

    def move(self) -> None:
        """Handed over to another gateway (it continues from the log): no closing payloads, the stream ends
        ``moved`` here (its readers are told to resume elsewhere), nothing is written to the broker."""
        if self.ended.done():
            return
        self.stream.finish("moved")
        self.ended.cancel()

    def _publish(self, ev: ChunkEvent, step: Step | None) -> None:
        event = self.stream.publish(ev, step)
        if self.publisher is not None:
            self.publisher.published(self.stream, event)
        if ev.tokens:
            self.tokens.inc(ev.tokens)
