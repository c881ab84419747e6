"""The OpenAI Responses API over HTTP: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``.

A response *is* a stream of the delivery core: its events (``response.created`` … ``response.completed``)
are the stream's log, ``sequence_number`` is the log's ``seq``, and ``starting_after=N`` resumes after
``seq`` N, so resume, retention (TTL, byte budget, 404 versus 410), slow readers and the broker are the
fan-out streams' own. Stored responses (``store`` true, the default) are listed and retained; a
``store: false`` response is an unlisted stream, gone when it ends. A background response is detached:
it runs on when its client leaves; any other response is aborted when its last reader leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.edge import gateway_of, read_body
from gateway.api.generations import find_stream, start_generation
from gateway.api.responses.chat import Message, decode_transcript, encode_transcript, responses_param
from gateway.api.responses.events import ResponseEvents, response_from_events
from gateway.api.responses.render import ResponseRenderer
from gateway.api.responses.request import (
    ResponsesRequest,
    build_request,
    decode_create,
    new_response_id,
    previous_response_not_found,
    response_expired,
    response_not_found,
)
from gateway.api.responses.stream import RESPONSES_SSE, RESPONSES_SSE_TIMING, ResponsesSse
from gateway.core.delivery import SseResponse, resume_point, settled, stop
from gateway.core.streams import Stream, StreamHub
from gateway.errors import APIError, ClientError, TokenfanError, owner_fenced
from gateway.state import Gateway

ENDPOINT = "responses"
RESPONSE_ID_PREFIX = "resp_"  # gateway.api.responses_api.new_response_id


def retained_transcript(hub: StreamHub, response_id: str) -> list[Message] | None:
    """The transcript of a finished response this gateway ran and still retains (see :func:`keep_transcript`)."""
    s = hub.streams.get(response_id)
    return s.meta.get("transcript") if s is not None and s.endpoint == ENDPOINT and not s.mirrored else None


async def history(gw: Gateway, previous_response_id: str | None) -> list[Message]:
    """The transcript a ``previous_response_id`` continues: while that response is retained here, or, with
    ``--broker``, kept in Redis by the replica that ran it."""
    if not previous_response_id:
        return []
    transcript = retained_transcript(gw.hub, previous_response_id)
    if transcript is not None:
        return list(transcript)
    # Only response ids: the broker's store also holds other APIs' entries (gateway.api.ui_chat.chats).
    if gw.remote is not None and previous_response_id.startswith(RESPONSE_ID_PREFIX) \
            and (data := await gw.remote.transcript(previous_response_id)) is not None:
        return decode_transcript(data)
    raise previous_response_not_found(previous_response_id)


async def start_response(gw: Gateway, rr: ResponsesRequest, scope: Any, *, lane: str | None = None) -> tuple[
        Stream, ResponseEvents]:
    """Submit a parsed create request; the response's stream exists and runs when this returns."""
    rid = new_response_id()
    model = gw.check_model(rr.chat.model)
    events = ResponseEvents(rid, model, request=rr)

    def keep() -> None:
        if (s := gw.hub.streams.get(rid)) is not None and "transcript" not in s.meta:
            keep_transcript(gw, s, rr.transcript(events.turn()), rr.store)

    try:
        # a foreground response is served while the broker is away, stored on this gateway only
        stream = await start_generation(gw, rr.chat, scope, listed=rr.store, detached=rr.background,
                                        local_fallback=not rr.background,
                                        source=lambda _handle, _builder: ResponseRenderer(events, keep),
                                        stream_id=rid, endpoint=ENDPOINT)
    except TokenfanError as exc:
        exc.param = responses_param(exc.param)  # the engine validated the chat body: name the Responses field
        raise
    stream.meta["events"] = events
    if stream.task is not None:
        stream.task.add_done_callback(lambda _t: keep())  # failed or cancelled: kept at the end
    return stream, events


def keep_transcript(gw: Gateway, stream: Stream, transcript: list[Message], store: bool) -> None:
    """A finished response can be continued (``previous_response_id``) here, and, if stored, on every replica."""
    stream.meta["transcript"] = transcript
    if store and gw.publisher is not None:
        gw.publisher.put_transcript(stream.id, encode_transcript(transcript), gw.config.retention.finished_ttl)


async def create_response(request: Request) -> Any:
    t0 = time.monotonic()
    gw: Gateway = gateway_of(request)
    body = await read_body(request, gw.config.max_body_bytes)
    req = decode_create(body)
    rr = build_request(req, gw.config.limits, await history(gw, req.previous_response_id))
    if rr.background and not rr.store:
        raise ClientError(400, "background responses must be stored: remove store=false or background.",
                       param="store", code="invalid_value")
    stream, events = await start_response(gw, rr, request.scope)
    gw.metrics.requests.labels("/v1/responses", "200").inc()
    if rr.stream:
        return SseResponse(gw.delivery, stream, _sse_framing(request), -1, t0=t0)
    if rr.background:
        return JSONResponse(events.response())
    assert stream.task is not None
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(stream.task)
    await settled(stream)  # --broker: its end is in Redis (what another replica serves is what this says)
    if not stream.over:
        raise owner_fenced(stream.id)
    return JSONResponse(response_from_events(e.payload for e in stream.events))


async def _find(gw: Gateway, response_id: str) -> Stream:
    """The response's stream, here or (with a broker) mirrored from the replica that runs it; 404 / 410 in
    the Responses API's words."""
    try:
        s = await find_stream(gw, response_id)
    except APIError as exc:
        if exc.status == 410:
            raise response_expired(response_id) from exc
        if exc.status == 404:
            raise response_not_found(response_id) from exc
        raise
    if s.endpoint != ENDPOINT:
        raise response_not_found(response_id)
    return s


def _sse_framing(request: Request) -> ResponsesSse:
    """``?tokenfan_timing=1`` adds tokenfan's timing object to every event (benchmarks; SDKs ignore it)."""
    return RESPONSES_SSE_TIMING if request.query_params.get("tokenfan_timing") in ("1", "true") else RESPONSES_SSE


async def retrieve_response(request: Request) -> Any:
    gw: Gateway = gateway_of(request)
    s = await _find(gw, request.path_params["id"])
    if request.query_params.get("stream") in ("true", "1"):
        after = resume_point(request.query_params.get("starting_after") or request.headers.get("last-event-id"),
                             "starting_after")
        return SseResponse(gw.delivery, s, _sse_framing(request), after)
    if not s.events:  # its pump has not run yet: the builder knows the response as created
        events = s.meta.get("events")
        if events is None:
            raise response_not_found(s.id)
        return JSONResponse(events.response())
    return JSONResponse(response_from_events(e.payload for e in s.events))


async def cancel_response(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    s = await _find(gw, request.path_params["id"])
    if not s.detached:
        raise ClientError(400, "Only background responses can be cancelled.", param="response_id",
                       code="invalid_value")
    await stop(gw.delivery, s)
    return JSONResponse(response_from_events(e.payload for e in s.events))


async def delete_response(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    s = await _find(gw, request.path_params["id"])
    await stop(gw.delivery, s)
    gw.hub.drop(s.id)
    return JSONResponse({"id": s.id, "object": "response.deleted", "deleted": True})
