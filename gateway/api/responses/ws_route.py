"""Responses API WebSocket mode on ``/v1/responses`` (the protocol is in :mod:`gateway.api.responses.ws`).

Each ``response.create`` runs as a response stream of the delivery core, read by this socket through
:class:`gateway.api.responses.stream.ResponsesWs`; lanes (``stream_id``) run concurrently, FIFO within a lane
(:class:`gateway.api.responses.ws.Lanes`). A write blocked past ``--send-timeout`` cuts the socket with close
1013 and aborts every response on it, as on every other path; a client that leaves aborts its
responses too (WebSocket-mode responses are never background).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
from starlette.websockets import WebSocket

from gateway.api.edge import gateway_of
from gateway.api.lanes import Lanes, WsClientError
from gateway.api.responses.chat import Message
from gateway.api.responses.events import ResponseEvents
from gateway.api.responses.request import build_request, new_response_id
from gateway.api.responses.routes import history, start_response
from gateway.api.responses.stream import ResponsesWs
from gateway.api.responses.ws import (
    TranscriptCache,
    WsCreate,
    client_error_event,
    parse_client_message,
    ws_error,
)
from gateway.api.ws_session import WsSession
from gateway.core.delivery import read, release
from gateway.errors import APIError, TokenfanError, to_api_error
from gateway.state import Gateway

log = logging.getLogger(__name__)


class ResponsesSession(WsSession):
    """One WebSocket-mode connection."""

    def __init__(self, gw: Gateway, ws: WebSocket) -> None:
        super().__init__(gw, ws)
        cfg = gw.config
        self.lanes: Lanes[WsCreate] = Lanes(cfg.responses_ws_max_active, cfg.responses_ws_max_lanes,
                                            cfg.responses_ws_max_pending)
        self.cache = TranscriptCache(cfg.responses_ws_cache_entries, cfg.responses_ws_cache_chars)
        self._n = 0
        self.timing = ws.query_params.get("tokenfan_timing") in ("1", "true")  # benchmarks: see ResponsesSse

    def on_message(self, raw: bytes) -> None:
        try:
            create = parse_client_message(raw)
            started = self.lanes.submit(create.stream_id, create)
        except WsClientError as exc:
            self.send_event(client_error_event(exc), exc.error)
            return
        self._start(started)

    def _start(self, started: list[tuple[str | None, WsCreate]]) -> None:
        for lane, create in started:
            self._n += 1
            self.spawn(self._n, self.respond(lane, create), f"responses-ws-{lane}")

    def send_event(self, event: dict[str, Any], err: APIError | None = None) -> None:
        self.send_text(orjson.dumps(event).decode(), err)

    async def _history(self, previous: str | None) -> list[Message]:
        cached = self.cache.get(previous) if previous else None
        return list(cached) if cached is not None else await history(self.gw, previous)

    async def respond(self, lane: str | None, create: WsCreate) -> None:
        gw = self.gw
        stream = None
        cut = False
        try:
            previous = await self._history(create.request.previous_response_id)
            rr = build_request(create.request, gw.config.limits, previous)
            if not create.generate:  # warmup: state for a later previous_response_id, no output
                events = ResponseEvents(new_response_id(), gw.check_model(rr.chat.model), request=rr)
                framing = ResponsesWs(lane, self.timing)
                for pl in events.created() + events.in_progress() + events.finish("stop", None):
                    await self.write(framing.build_payload(pl))
                self.cache.put(events.id, rr.transcript(None))
                return
            stream, events = await start_response(gw, rr, self.ws.scope, lane=lane)
            outcome = await read(gw.delivery, stream, ResponsesWs(lane, self.timing), -1, self.conn)
            cut = outcome.cut
            if cut:
                await self.cut_now(outcome.ending.close_code, outcome.ending.reason)
                return
            if isinstance(outcome.ending.frame, str):
                await self.write(outcome.ending.frame)
            if events.status in ("completed", "incomplete"):
                self.cache.put(events.id, rr.transcript(events.turn()))
            elif create.request.previous_response_id:
                self.cache.evict(create.request.previous_response_id)
        except TokenfanError as exc:
            err = to_api_error(exc)
            self.send_event(ws_error(err, lane), err)
        finally:
            if stream is not None:
                release(stream, cut)
            if not self.cut.is_set():
                with contextlib.suppress(RuntimeError):
                    self._start(self.lanes.finished(lane))


async def responses_ws_endpoint(ws: WebSocket) -> None:
    gw: Gateway = gateway_of(ws)
    await ws.accept()
    gw.metrics.requests.labels("/v1/responses (ws)", "101").inc()
    await ResponsesSession(gw, ws).run()
