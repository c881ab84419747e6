"""Adoption: continuing a listed stream whose owner gateway is gone (killed, or redeployed with SIGTERM).

A replica mirroring the stream (``--broker``: its log is in Redis) finds the owner's lease expired
(:class:`gateway.scaleout.mirror.Mirror`) and offers the stream here. The one replica that claims it
(``SET NX`` of its adoption key, :meth:`gateway.scaleout.broker.Broker.claim`) continues the generation from
the log: the engine request the owner wrote in the stream's header, plus the output token ids its events
carry, as a continuation (``Submit.resume``, as a migration does: docs/failures.md) on its own engines. The
mirror's :class:`~gateway.core.streams.Stream` becomes a local one: the same id, ``seq`` continuing from the
log, the same Redis key (under a new header naming this gateway), its readers reading on without a gap.

What is adopted: streams of the plain path whose API can render the rest from the log: fan-out chat and
completions streams, background responses (their event builder folded back from the log) and ``/api/chat``
answers (the UI message renderer's open part and part ids). A stream of a request served by vLLM's OpenAI
layer (tools, reasoning, structured outputs, logprobs, ``n`` > 1) keeps its engine steps in the log
(:func:`engine_worker.protocol.pack_steps`) and continues from them (``Submit.resume_steps``: the engine
replays them through its parsers and grammar), as a migration does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from engine_worker import protocol as p
from gateway.api.chat_render import ChatRenderer, EngineChunkRenderer
from gateway.api.chat_request import ChunkBuilder
from gateway.api.responses.events import ResponseEvents
from gateway.api.responses.render import ResponseRenderer
from gateway.api.responses.routes import ENDPOINT as RESPONSES
from gateway.api.ui_chat.render import UiMessageRenderer
from gateway.api.ui_chat.routes import ENDPOINT as UI_CHAT
from gateway.core.delivery import pump
from gateway.core.generation import Generation, Renderer
from gateway.errors import TokenfanError

if TYPE_CHECKING:
    from gateway.core.streams import Stream
    from gateway.scaleout.broker_codec import Header
    from gateway.scaleout.mirror import Adoption, Claims
    from gateway.state import Gateway

log = logging.getLogger(__name__)


def responses_renderer(stream: Stream, options: dict[str, Any]) -> Renderer:
    """The rest of a Responses stream (a background response): its event builder folded back from the log
    (the same items, ``sequence_number`` continuing); ``GET /v1/responses/{id}`` reads it as on the owner."""
    events = ResponseEvents.from_events(e.payload for e in stream.events)
    stream.meta["events"] = events
    return ResponseRenderer(events)


def chat_renderer(stream: Stream, options: dict[str, Any]) -> Renderer:
    """The rest of a chat or completions stream: the same chunk id, ``created`` and usage setting (vLLM's
    OpenAI layer: the engine's chunks, which keep the generation's id)."""
    if options.get("openai"):
        return EngineChunkRenderer()
    builder = ChunkBuilder(stream.endpoint, stream.id, stream.model,  # type: ignore[arg-type]
                           bool(options.get("include_usage")), created=options.get("created"))
    return ChatRenderer(builder, started=bool(stream.events))


def ui_chat_renderer(stream: Stream, options: dict[str, Any]) -> Renderer:
    """The rest of a ``/api/chat`` answer: the same message id, its part ids continuing."""
    return UiMessageRenderer.from_log((e.payload for e in stream.events), bool(options.get("openai")))


# endpoint -> the renderer of the rest of an adopted stream (its API's)
RENDERERS: dict[str, Callable[[Stream, dict[str, Any]], Renderer]] = {
    "chat.completions": chat_renderer, "completions": chat_renderer, RESPONSES: responses_renderer,
    UI_CHAT: ui_chat_renderer}


class Adopter:
    """The ``adopt`` of a gateway's mirrors (see the module docstring); ``claims``: the broker (Redis) or,
    for ``--workers`` without one, the peers; ``refuse``: why a stream cannot be adopted by anyone, beyond
    what its log says (``--workers``: its owner gave its standby up), or None."""

    def __init__(self, gw: Gateway, claims: Claims,
                 refuse: Callable[[Stream, Header], str | None] | None = None) -> None:
        self.gw, self.claims, self.refuse = gw, claims, refuse
        self._n = 0

    async def __call__(self, stream: Stream, header: Header) -> Adoption:
        gw = self.gw
        if gw.draining:  # stopping: adopt nothing, keep mirroring (another gateway may adopt it)
            return "elsewhere"
        make = RENDERERS.get(stream.endpoint)
        why = None if make is not None else f"its API ({stream.endpoint}) cannot render the rest from the log"
        if why is None and self.refuse is not None:
            why = self.refuse(stream, header)
        submit = msgspec.msgpack.decode(header.request, type=p.Submit) if header.request else None
        options = header.options or {}
        openai = bool(options.get("openai"))
        ids = [i for e in stream.events for i in e.ids]
        steps: p.EngineSteps = []
        if submit is None:
            why = why or "its header has no engine request"
        elif "openai" not in options:
            why = why or "its header does not say how the engine serves it (an older gateway's)"
        elif openai:  # vLLM's OpenAI layer: the log's ids are its engine steps, packed
            try:
                steps = p.unpack_steps(ids)
            except p.WireError as exc:
                why = why or f"its log's engine steps are unreadable ({exc})"
        elif len(ids) >= submit.sampling.max_tokens:
            why = why or "its token budget is spent"
        if why is not None or submit is None or make is None:
            gw.metrics.adoptions.labels("refused").inc()
            log.warning("stream %s lost its owner %s: not adopted (%s)", stream.id, header.owner, why)
            return "no"
        if not await self.claims.claim(stream, header):
            gw.metrics.adoptions.labels("elsewhere").inc()
            return "elsewhere"
        self._n += 1
        chars = sum(len(e.text) for e in stream.events)
        trace = None
        if gw.tracer is not None and submit.trace_headers:  # the rest joins the owner's trace (stream.adopt span)
            trace = gw.tracer.joined(dict(submit.trace_headers), stream_id=stream.id, endpoint=stream.endpoint,
                                     model=stream.model, adopted_from=header.owner,
                                     adopted_by=str(getattr(self.claims, "gateway_id", "")), events=len(stream.events))
            submit = msgspec.structs.replace(submit, trace_headers=trace.carrier())
        try:
            if openai:
                handle = gw.engine.submit(msgspec.structs.replace(
                    submit, request_id=f"{stream.id}.a{self._n}", resume_steps=steps))
                handle.steps = list(steps)
            else:
                handle = gw.engine.submit(msgspec.structs.replace(
                    submit, request_id=f"{stream.id}.a{self._n}", resume=ids, resume_chars=chars))
                handle.output_ids, handle.output_chars = list(ids), chars
            handle.trace = trace
            await handle.wait_accepted(gw.config.accept_timeout)
        except TokenfanError as exc:
            if trace is not None:
                trace.failed(exc)
                trace.end()
            gw.metrics.adoptions.labels("failed").inc()
            log.error("stream %s lost its owner %s: adoption failed (%s)", stream.id, header.owner, exc)
            return "no"
        renderer = make(stream, options)
        # never splice: a reader here already past this log (it read, elsewhere, what the store lost since) ends
        # with stream_rolled_back before the first event of the continuation
        stream.continue_at(len(stream.events))
        stream.mirrored = False
        stream.request, stream.options = header.request, header.options or {}
        stream.trace = trace or stream.trace
        self.claims.adopted(stream)
        generation = Generation(stream, handle, renderer, gw.metrics.hot.tokens, gw.publisher)
        handle.attach(generation)
        stream.task = asyncio.get_running_loop().create_task(pump(gw.delivery, generation), name=f"pump-{stream.id}")
        gw.metrics.adoptions.labels("adopted").inc()
        last_ns = stream.events[-1].timing.get("sent_ns", 0) if stream.events else 0
        log.warning("adopted stream %s from lost gateway %s after %d events (%d output tokens); continuing on "
                    "engine %s", stream.id, header.owner, len(stream.events), len(ids), handle.owner.address)
        asyncio.get_running_loop().create_task(self._gap(stream, len(stream.events), last_ns))
        return "adopted"

    async def _gap(self, stream: Stream, had: int, last_ns: int) -> None:
        """Observe the gap a reader saw: the owner's last event to this gateway's first."""
        deadline = time.monotonic() + 60
        while len(stream.events) <= had and not stream.finished and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if len(stream.events) > had and last_ns:
            sent = stream.events[had].timing.get("sent_ns", 0)
            self.gw.metrics.adoption_gap.observe(max(0.0, (sent - last_ns) / 1e9))
