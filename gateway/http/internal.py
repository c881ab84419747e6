"""The ``--workers`` internal routes, served only on a worker's private Unix socket: its streams' logs
(:class:`gateway.scaleout.workers.PeerFraming`), cancels, transcripts, metrics and readiness, for its peers
(:mod:`gateway.scaleout.peers`)."""

from __future__ import annotations

import os
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.edge import gateway_of
from gateway.api.responses.chat import encode_transcript
from gateway.api.responses.routes import retained_transcript
from gateway.core import sse
from gateway.core.delivery import SseResponse, cancel, resume_point
from gateway.errors import ClientError
from gateway.http.service import refresh_metrics
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.peers import owner_name
from gateway.scaleout.workers import PEER, worker_index
from gateway.state import Gateway


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
    return SseResponse(gw.delivery, stream, PEER, after, preamble=sse.event(codec.pack(header)))


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
