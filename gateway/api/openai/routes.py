"""The OpenAI HTTP endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A streaming request is a single-reader view of an unlisted stream (:mod:`gateway.core.delivery`); errors
before the response starts are raised and framed once by :func:`gateway.http.middleware.api_error_handler`.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from engine_worker import protocol as p
from gateway.api.chat_render import chunk_events
from gateway.api.chat_request import ChunkBuilder, Endpoint, dumps, parse_request
from gateway.api.edge import error_response, gateway_of, read_body
from gateway.api.generations import open_request, start_generation
from gateway.api.openai.framing import OPENAI_SSE, OPENAI_SSE_TIMING
from gateway.core.delivery import SseResponse
from gateway.errors import TokenfanError, engine_unavailable, to_api_error
from gateway.state import Gateway


def completions_route(endpoint: Endpoint) -> Any:
    name = "/v1/" + endpoint.replace(".", "/")

    async def handler(request: Request) -> Any:
        t0 = time.monotonic()
        gw = gateway_of(request)
        body = await read_body(request, gw.config.max_body_bytes)
        parsed = parse_request(endpoint, body, gw.config.limits)
        if not parsed.stream:
            handle, builder = await open_request(gw, parsed, request.scope)
            gw.metrics.requests.labels(name, "200").inc()
            return await full_response(handle, builder)
        stream = await start_generation(gw, parsed, request.scope, listed=False)
        gw.metrics.requests.labels(name, "200").inc()
        return SseResponse(gw.delivery, stream, OPENAI_SSE_TIMING if wants_timing(request) else OPENAI_SSE, -1, t0=t0)

    return handler


def wants_timing(conn: HTTPConnection) -> bool:
    """``?tokenfan_timing=1``: chunks carry tokenfan's timing object (benchmarks; OpenAI clients ignore it). The
    query string is parsed only if it names the parameter."""
    return b"tokenfan_timing" in conn.scope.get("query_string", b"") and \
        conn.query_params.get("tokenfan_timing") in ("1", "true")


async def full_response(handle: Any, builder: ChunkBuilder) -> Response:
    """A non-streaming answer: the whole text once the generation ended (no reader, nothing to be slow).
    From vLLM's OpenAI layer (``handle.openai``) the engine's one chunk is the whole response, as is."""
    if handle.openai:
        return await _engine_response(handle)
    texts: list[str] = []
    finish: str | None = None
    usage: p.Usage | None = None
    try:
        async for ev in chunk_events(handle, builder):
            assert ev is not None
            texts.append(ev.text)
            if ev.finish_reason is not None:
                finish, usage = ev.finish_reason, ev.usage
    except TokenfanError as exc:
        return error_response(to_api_error(exc))
    finally:
        handle.close()
    assert usage is not None
    return Response(dumps(builder.full_response("".join(texts), finish, usage)), media_type="application/json")


async def _engine_response(handle: Any) -> Response:
    whole = b""
    try:
        async for d in handle.deltas():
            whole = d.chunk or whole
    except TokenfanError as exc:
        return error_response(to_api_error(exc))
    finally:
        handle.close()
    return Response(whole, media_type="application/json")


async def models(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    hb = gw.engine.last_heartbeat
    if hb is None or gw.model_id is None:
        return error_response(engine_unavailable())
    entry: dict[str, Any] = {"id": gw.model_id, "object": "model", "created": 0, "owned_by": "tokenfan",
                             "root": hb.model, "max_model_len": hb.max_model_len, "backend": hb.backend}
    if hb.backend == "synthetic":
        entry["description"] = "synthetic token source for transport tests and benchmarks: NOT a model"
    return JSONResponse({"object": "list", "data": [entry]})
