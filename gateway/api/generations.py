"""Starting a generation, for every API: admission, the engine's accept, then the delivery core's stream;
and finding one by id (:func:`find_stream`), here or on the gateway that runs it.

An API turns its request into a :class:`~gateway.api.chat_request.ParsedRequest` (the engine's
``Submit``) and a renderer of its payloads; :func:`open_request` admits and submits it and waits for the
engine's accept; :func:`start_generation` then hands the accepted request and the API's renderer to the
core (:func:`gateway.core.delivery.start`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from engine_worker import protocol as p
from gateway.api.chat_render import chat_renderer
from gateway.api.chat_request import ChunkBuilder, ParsedRequest, new_id
from gateway.core import delivery
from gateway.core.generation import Renderer
from gateway.core.tracing import CURRENT
from gateway.errors import APIError, ClientError, EngineError

if TYPE_CHECKING:
    from gateway.core.request import RequestHandle
    from gateway.core.streams import Stream
    from gateway.state import Gateway

# (handle, builder) -> the renderer of one generation's payloads; the default gives OpenAI chunks.
Source = Callable[["RequestHandle", ChunkBuilder], Renderer]


async def open_request(gw: Gateway, parsed: ParsedRequest, scope: Any = None, *,
                       listed: bool = False) -> tuple[RequestHandle, ChunkBuilder]:
    """Admit, submit to the engine and wait until it accepted (prompt validated).

    Raises APIError or EngineError. ``scope`` (of the HTTP request or WebSocket) supplies the API key
    for per-key limits, the request id the engine logs as ``trace`` and the W3C ``traceparent`` the
    generation's span joins (``--otlp-traces-endpoint``); the generation id and its trace and span ids are
    recorded for the access log."""
    state = scope.setdefault("state", {}) if scope is not None else {}
    key = state.get("api_key")
    client = state.get("client") or "internal"  # set by gateway.http.clients.ClientLimitMiddleware
    model = gw.check_model(parsed.model)
    gw.admit(client, key)
    rid = new_id(parsed.endpoint)
    submit = parsed.to_submit(rid, trace_id=state.get("request_id", rid))
    trace = None
    if gw.tracer is not None:
        trace = gw.tracer.generation(scope.get("headers") if scope is not None else None, request_id=rid,
                                     endpoint=parsed.endpoint, model=model, max_tokens=submit.sampling.max_tokens,
                                     listed=listed)
        submit = msgspec.structs.replace(submit, trace_headers=trace.carrier())
        state["trace_id"], state["span_id"] = trace.trace_id, trace.span_id
        CURRENT.set(trace)
    try:
        handle = gw.engine.submit(submit)
    except BaseException:
        if trace is not None:
            trace.end()
        raise
    handle.trace = trace
    state["generation_id"] = rid
    gw.clients.acquire("generations", client)
    handle.on_close.append(lambda: gw.clients.release("generations", client))
    try:
        prompt_tokens = await handle.wait_accepted(gw.config.accept_timeout)
        if trace is not None:
            trace.accepted(prompt_tokens, handle.owner.address)
        limit = gw.config.max_prompt_tokens
        if limit and prompt_tokens > limit:
            raise ClientError(400, f"The prompt has {prompt_tokens} tokens; this server accepts at most {limit}.",
                           param="messages" if parsed.endpoint == "chat.completions" else "prompt",
                           code="prompt_too_long")
    except EngineError as exc:
        handle.close()
        if exc.code == "engine_overloaded":
            gw.metrics.refusals.labels(exc.code).inc()
        raise
    except BaseException:
        handle.close()
        raise
    return handle, ChunkBuilder(parsed.endpoint, rid, model, parsed.include_usage)


async def start_generation(
    gw: Gateway, parsed: ParsedRequest, scope: Any, *, listed: bool, detached: bool | None = None,
    source: Source = chat_renderer, stream_id: str | None = None, endpoint: str | None = None,
    local_fallback: bool = False,
) -> Stream:
    """Admit, submit and wait for the engine's accept; then the stream exists and its pump runs.

    ``listed``: findable by id and retained after it ends; ``detached`` (default: ``listed``): the
    generation outlives its readers; ``local_fallback``: a listed stream the broker cannot take is kept on this gateway only
    (:func:`gateway.core.delivery.start`). Raises :class:`APIError` (admission, validation, broker) or
    :class:`EngineError`."""
    if listed:
        try:
            gw.hub.check_capacity()
        except APIError as err:
            raise gw.refused(err) from None
    handle, builder = await open_request(gw, parsed, scope, listed=listed)
    return await delivery.start(gw.delivery, handle, source(handle, builder), endpoint=endpoint or parsed.endpoint,
                                model=builder.model, listed=listed, detached=detached, stream_id=stream_id,
                                local_fallback=local_fallback,
                                options={"include_usage": builder.include_usage, "created": builder.created,
                                         "openai": handle.openai})


async def find_stream(gw: Gateway, stream_id: str) -> Stream:
    """The local stream, else (with a broker) a mirror of another replica's; APIError 404 / 410 / 503."""
    try:
        return gw.hub.get(stream_id)
    except APIError:
        if gw.remote is None:
            raise
        stream = await gw.remote.mirror(stream_id)
    if gw.tracer is not None and stream.trace is None and stream.request:
        # a mirror's readers join the owner's trace: its engine request carries the generation's context
        try:
            carrier = msgspec.msgpack.decode(stream.request, type=p.Submit).trace_headers
        except msgspec.MsgspecError:  # not a request this release can read: its readers are not traced
            carrier = {}
        if carrier:
            stream.trace = gw.tracer.joined(carrier, stream_id=stream.id, endpoint=stream.endpoint, model=stream.model)
    return stream
