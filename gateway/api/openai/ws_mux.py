"""``/v1/ws``: many generations multiplexed on one WebSocket by client-chosen ids.

Client -> server messages (parsed by the pure :func:`parse_message`):
  ``{"type":"request","id":ID,"endpoint":"chat.completions"|"completions","body":{OpenAI request}}``
  ``{"type":"cancel","id":ID}``
Server -> client: ``{"type":"chunk","id","data"}``, ``{"type":"done","id"[,"cancelled":true]}``,
``{"type":"error","id","error"}``. ``/v1/ws?tokenfan_timing=1`` (benchmarks): each chunk's ``data`` also carries
tokenfan's timing object (``"tokenfan"``), as fan-out chunks do.

Each request is a single-reader view of an unlisted stream (:mod:`gateway.core.delivery`); all of them
write to the one socket. A write blocked past ``--send-timeout`` cuts the whole socket with close 1013
and aborts every generation on it.

Per connection, ``--ws-max-in-flight`` requests generate at once and ``--ws-max-queued`` more wait their
turn (FIFO; the Responses WebSocket mode's :class:`gateway.api.responses.ws.Lanes`, one lane per request id);
each request beyond gets its own ``error`` (429 ``connection_queue_limit``) and the socket stays open.
A cancel of a waiting request answers ``done`` with ``"cancelled": true`` at once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, cast

import orjson
from starlette.websockets import WebSocket

from gateway.api.chat_request import Endpoint, parse_request
from gateway.api.edge import gateway_of
from gateway.api.generations import start_generation
from gateway.api.lanes import Lanes, WsClientError
from gateway.api.openai.framing import MuxWs, MuxWsTiming, mux_cancelled
from gateway.api.openai.routes import wants_timing
from gateway.api.ws_session import WsSession
from gateway.core.delivery import read, release
from gateway.errors import APIError, ClientError, Refusal, TokenfanError, to_api_error
from gateway.state import Gateway

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    endpoint: Endpoint
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Cancel:
    id: str


class BadMessage(Exception):
    """A message that cannot be served; ``id`` is the request it names, if any."""

    def __init__(self, id: str | None, error: APIError) -> None:
        super().__init__(error.message)
        self.id = id
        self.error = error


def parse_message(raw: bytes) -> Request | Cancel:
    """One client message -> :class:`Request` or :class:`Cancel`; raises :class:`BadMessage`."""
    try:
        msg = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadMessage(None, ClientError(400, "WebSocket message is not valid JSON.", code="invalid_json")) from None
    if not isinstance(msg, dict):
        raise BadMessage(None, ClientError(400, "WebSocket message must be a JSON object.", code="invalid_value"))
    cid = msg.get("id")
    if not isinstance(cid, str) or not cid or len(cid) > 256:
        raise BadMessage(None, ClientError(400, "`id` must be a non-empty string (max 256 chars).", param="id",
                                        code="invalid_value"))
    kind = msg.get("type")
    if kind == "cancel":
        return Cancel(cid)
    if kind != "request":
        raise BadMessage(cid, ClientError(400, '`type` must be "request" or "cancel".', param="type",
                                       code="invalid_value"))
    endpoint = msg.get("endpoint", "chat.completions")
    if endpoint not in ("chat.completions", "completions"):
        raise BadMessage(cid, ClientError(400, '`endpoint` must be "chat.completions" or "completions".',
                                       param="endpoint", code="invalid_value"))
    body = msg.get("body")
    if not isinstance(body, dict):
        raise BadMessage(cid, ClientError(400, "`body` must be an OpenAI request object.", param="body",
                                       code="invalid_value"))
    return Request(cid, endpoint, body)


def queue_full(lanes: Lanes[Request]) -> APIError:
    """The error of a request that finds its connection's generations and queue full."""
    return Refusal(429, f"This connection already has {lanes.active} generations in flight and {lanes.pending} "
                         f"requests waiting (limits: --ws-max-in-flight {lanes.max_active}, --ws-max-queued "
                         f"{lanes.max_pending}); send it again when one has finished.", type="rate_limit_error",
                    code="connection_queue_limit")


class Session(WsSession):
    """One ``/v1/ws`` connection."""

    def __init__(self, gw: Gateway, ws: WebSocket) -> None:
        super().__init__(gw, ws)
        cfg = gw.config
        active, queued = cfg.ws_max_in_flight, cfg.ws_max_queued
        self.lanes: Lanes[Request] = Lanes(active, active + queued + 1, queued, keep_idle=False,
                                           pending_error=queue_full)
        self.framing = MuxWsTiming if wants_timing(ws) else MuxWs  # ?tokenfan_timing=1: benchmarks

    def on_message(self, raw: bytes) -> None:
        try:
            msg = parse_message(raw)
        except BadMessage as exc:
            self.send_error(exc.id, exc.error)
            return
        if isinstance(msg, Cancel):
            task = self.tasks.get(msg.id)
            if task is not None:
                if inspect.getcoroutinestate(cast(Coroutine[Any, Any, None], task.get_coro())) == inspect.CORO_CREATED:
                    self._send_cancelled(msg.id)  # started but not yet run: it ends before sending anything
                task.cancel()
            elif self.lanes.cancel(msg.id):
                self._send_cancelled(msg.id)
            else:
                self.send_error(msg.id, ClientError(404, f"No active request with id {msg.id!r}.", param="id",
                                                 code="not_found"))
            return
        if msg.id in self.lanes:
            self.send_error(msg.id, ClientError(400, f"Request id {msg.id!r} is already active.", param="id",
                                             code="invalid_value"))
            return
        try:
            started = self.lanes.submit(msg.id, msg)
        except WsClientError as exc:
            self.send_error(msg.id, self.gw.refused(exc.error))
            return
        self._start(started)

    def _start(self, started: list[tuple[str | None, Request]]) -> None:
        for _, req in started:
            task = self.spawn(req.id, self.generate(req), f"ws-{req.id}")
            if task is not None:  # its slot frees when the task ends, even one cancelled before it ran
                task.add_done_callback(functools.partial(self._finished, req.id))

    def _finished(self, request_id: str, _task: object = None) -> None:
        started = self.lanes.finished(request_id)
        if not self.closing and not self.cut.is_set():
            self._start(started)

    def _send_cancelled(self, request_id: str) -> None:
        self.send_text(mux_cancelled(request_id))

    def send_error(self, cid: str | None, err: APIError) -> None:
        self.send_text(orjson.dumps({"type": "error", "id": cid, "error": err.body()["error"]}).decode(), err)

    async def generate(self, req: Request) -> None:
        gw = self.gw
        framing = self.framing(req.id)
        stream = None
        cut = False
        try:
            parsed = parse_request(req.endpoint, {**req.body, "stream": True}, gw.config.limits)  # always chunks
            stream = await start_generation(gw, parsed, self.ws.scope, listed=False)
            outcome = await read(gw.delivery, stream, framing, -1, self.conn)
            cut = outcome.cut
            if cut:
                await self.cut_now(outcome.ending.close_code, outcome.ending.reason)
            elif isinstance(outcome.ending.frame, str):
                await self.write(outcome.ending.frame)
        except TokenfanError as exc:
            self.send_error(req.id, to_api_error(exc))
        except asyncio.CancelledError:  # the client's cancel (or the session's end: nobody left to tell)
            if not self.closing and not self.conn.closed and not self.cut.is_set():
                await asyncio.shield(self.write(mux_cancelled(req.id)))
            raise
        finally:
            if stream is not None:
                release(stream, cut)


async def ws_endpoint(ws: WebSocket) -> None:
    gw: Gateway = gateway_of(ws)
    await ws.accept()
    gw.metrics.requests.labels("/v1/ws", "101").inc()
    await Session(gw, ws).run()
