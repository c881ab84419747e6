"""The ``--workers`` internal routes, served only on a worker's private Unix socket: its streams' logs
(:class:`gateway.scaleout.workers.PeerFraming`), cancels, transcripts, metrics and readiness, for its peers
(:mod:`gateway.scaleout.peers`)."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.edge import gateway_of
from gateway.api.responses.chat import encode_transcript
from gateway.api.responses.routes import retained_transcript
from gateway.core import sse
from gateway.core.conn import HttpConn
from gateway.core.delivery import Outcome, SseResponse, cancel, read, release, resume_point, until_disconnect
from gateway.errors import ClientError
from gateway.http.service import refresh_metrics
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.peers import owner_name
from gateway.scaleout.workers import PEER, STANDBY, worker_index
from gateway.state import Gateway

if TYPE_CHECKING:
    from gateway.core.step import Step
    from gateway.core.streams import Stream
    from gateway.scaleout.peers import Peers


def _over_unix_socket(request: Request) -> bool:
    server = request.scope.get("server")
    return isinstance(server, tuple | list) and len(server) == 2 and server[1] is None


async def internal_stream(request: Request) -> Any:
    if not _over_unix_socket(request):
        raise ClientError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    stream = gw.hub.get(request.path_params["id"])  # 404 / 410
    if stream.mirrored:  # a standby or a reader's mirror: it may adopt the stream if its owner is gone
        raise ClientError(409, "This worker mirrors the stream; it does not own it.", code="stream_mirrored")
    after = resume_point(request.query_params.get("after"), "after")
    header = codec.encode_header(stream.endpoint, stream.model, owner_name(worker_index()), detached=stream.detached,
                                 held=len(stream.events) + stream.finished, request=stream.request,
                                 options=stream.options)
    preamble = sse.event(codec.pack(header))
    if request.method == "POST" and gw.peers is not None:  # the stream's standby
        return StandbyRelay(gw, gw.peers, stream, after, preamble)
    return SseResponse(gw.delivery, stream, PEER, after, preamble=preamble)


class StandbyRelay:
    """The relay to a stream's standby (``POST /internal/streams/{id}``): its log, pending events too
    (:data:`gateway.scaleout.workers.STANDBY`), and on the request's body the standby's acknowledgements, one
    line each (how many records it holds: :meth:`Peers.acked` commits them). After the end record the response
    stays open until the standby holds the end too, or is given up (:class:`gateway.scaleout.peers.Peers`)."""

    def __init__(self, gw: Gateway, peers: Peers, stream: Stream, after: int, preamble: bytes) -> None:
        self.gw, self.peers, self.stream, self.after, self.preamble = gw, peers, stream, after, preamble

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        delivery, peers, stream = self.gw.delivery, self.peers, self.stream
        rest = b""

        async def acks() -> Any:
            """``receive``, each line of the body handed to the gate as it comes."""
            nonlocal rest
            msg = await receive()
            if msg["type"] == "http.request" and msg.get("body"):
                *lines, rest = (rest + msg["body"]).split(b"\n")
                if lines and lines[-1].isdigit():
                    peers.acked(stream, int(lines[-1]))
            return msg

        delay = self.gw.config.relay_delay
        conn = HttpConn(scope, send, delivery.policy.linger) if not delay else \
            DelayedConn(scope, send, delivery.policy.linger, delay)
        await send({"type": "http.response.start", "status": 200, "headers": SseResponse.headers})
        gate = peers.relay(stream, opened=True)
        outcome: Outcome | None = None
        try:
            await conn.write(self.preamble)
            outcome = await until_disconnect(read(delivery, stream, STANDBY, self.after, conn), acks)
            if outcome is None:
                return  # the standby left
            frame = outcome.ending.frame
            data = frame.encode() if isinstance(frame, str) else frame
            if outcome.cut:
                await conn.cut(data)
                return
            await conn.write(data or b"")
            while gate is not None and stream.gated and not stream.sealed:  # until it holds the end
                gate.settled.clear()
                if await until_disconnect(gate.settled.wait(), acks) is None:
                    return  # the standby left (the gate gives it up)
            await conn.end(b"")
        finally:
            release(stream, cut=bool(outcome and outcome.cut))
            peers.relay(stream, opened=False)


class DelayedConn(HttpConn):
    """DIAGNOSTIC (``--relay-delay``, tests): a standby relay whose every write waits ``delay`` s first and is
    never written in the publisher's pass, so the standby lags behind this worker's readers."""

    __slots__ = ("delay",)

    def __init__(self, scope: Any, send: Any, linger: float, delay: float) -> None:
        super().__init__(scope, send, linger)
        self.delay = delay

    def write_now(self, data: bytes, step: Step | None = None) -> bool:
        return False

    async def write(self, data: bytes) -> None:
        await asyncio.sleep(self.delay)
        await super().write(data)


async def internal_cancel(request: Request) -> Response:
    if not _over_unix_socket(request):
        raise ClientError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    s = gw.hub.streams.get(request.path_params["id"])
    return JSONResponse({"cancelled": bool(s is not None and not s.mirrored and cancel(s))})


async def internal_transcript(request: Request) -> Response:
    """A retained response's transcript (msgpack), for a peer resolving ``previous_response_id``."""
    if not _over_unix_socket(request):
        raise ClientError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    transcript = retained_transcript(gw.hub, request.path_params["id"])
    if transcript is None:  # or what this worker keeps for its peers (e.g. which stream answers a ui chat)
        kept = gw.peers.kept(request.path_params["id"]) if gw.peers is not None else None
        return Response(kept, media_type="application/octet-stream") if kept else Response(status_code=404)
    return Response(encode_transcript(transcript), media_type="application/msgpack")


async def internal_metrics(request: Request) -> Response:
    if not _over_unix_socket(request):
        raise ClientError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    refresh_metrics(gw)
    return Response(gw.metrics.render(), media_type=gw.metrics.content_type)


async def internal_ready(request: Request) -> Response:
    """Whether this worker listens on the shared port and whether it can serve: its engine link is up and it is
    not draining (for peers' ``/health`` and ``/readyz``)."""
    if not _over_unix_socket(request):
        raise ClientError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    return JSONResponse({"listening": gw.listening, "ready": gw.engine.healthy and not gw.draining, "pid": os.getpid()})


async def internal_standby(request: Request) -> Response:
    """Mirror a peer's new listed stream here at once (its standby: see :mod:`gateway.scaleout.peers`)."""
    if not _over_unix_socket(request):
        raise ClientError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    if gw.peers is None:
        raise ClientError(404, "This gateway has no peers.", code="not_found")
    await gw.peers.mirror(request.path_params["id"])
    return JSONResponse({"standby": True})
