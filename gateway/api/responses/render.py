"""The Responses API's renderer: what the delivery core calls per engine step of a response."""

from __future__ import annotations

from collections.abc import Callable

import orjson

from engine_worker import protocol as p
from gateway.api.responses.events import ResponseEvents, chunk_text, delta_text
from gateway.core.streams import ChunkEvent
from gateway.errors import APIError


class ResponseRenderer:
    """Engine deltas -> Responses events (a :class:`gateway.core.generation.Renderer`): the lifecycle events,
    the items' events per engine step (from the text of the plain path or the chat chunk of vLLM's layer),
    the end; ``response.failed`` or the cancel's events if it ends otherwise. A step that only adds text
    to the open message item (the steady state; a chat chunk of only content under vLLM's layer) is its
    item's byte template (:meth:`ResponseEvents.text_delta`); every other event is a dict. Each event
    names its ``sequence_number`` to the stream, which checks it is the log's ``seq``."""

    def __init__(self, events: ResponseEvents, on_finish: Callable[[], None] | None = None) -> None:
        self.events = events
        self.on_finish = on_finish  # called in the pass that finishes the response, before its last events
        self.held = 0  # tokens of steps that added no event (text held back by the detokenizer, a tool
        # call's name before its arguments): counted with the next event, as OpenAI sends no empty deltas

    def opening(self) -> list[ChunkEvent]:
        now = p.now_ns()
        return [ChunkEvent(pl, now, "", 0, seq=pl["sequence_number"]) for pl in self.events.start()]

    def step(self, d: p.Delta) -> list[ChunkEvent]:
        events = self.events
        self.held += d.token_count
        chunk = orjson.loads(d.chunk) if d.chunk else None
        if d.finish_reason is None:
            text = d.text if chunk is None else chunk_text(chunk)
            if text and (numbered := events.text_delta(text)) is not None:
                held, self.held = self.held, 0
                return [ChunkEvent(None, d.emit_ns, text, held, template=numbered[0], seq=numbered[1])]
        out: list[ChunkEvent] = []
        for pl in events.chunk(chunk) if chunk is not None else events.delta(d.text):
            out.append(ChunkEvent(pl, d.emit_ns, delta_text(pl), self.held, seq=pl["sequence_number"]))
            self.held = 0
        if d.finish_reason is not None:
            payloads = events.finish(d.finish_reason, d.usage)
            if self.on_finish is not None:
                self.on_finish()  # continuable before any reader sees response.completed
            for pl in payloads:
                out.append(ChunkEvent(pl, d.emit_ns, "", self.held, d.finish_reason, d.usage,
                                      seq=pl["sequence_number"]))
                self.held = 0
        return out

    def closing(self, err: APIError | None) -> list[ChunkEvent]:
        if self.events.done:
            return []
        payloads = self.events.fail(err) if err is not None else self.events.cancel()
        now = p.now_ns()
        return [ChunkEvent(pl, now, "", 0, seq=pl["sequence_number"]) for pl in payloads]
