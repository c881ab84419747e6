"""A test-only Responses API server over the pure modules, to check the SDK harnesses themselves.

It is not the gateway: no engine (deltas are ``tok0 tok1 ...`` at a fixed pace), no stream hub (each
response's events are a list plus a condition), no limits. It runs the same wire contract the gateway
routes must (``gateway.api.responses.request`` / ``gateway.api.responses.ws``), so the official Python and Node
SDK harnesses in ``test_responses_sdk.py`` are known to work before they are pointed at the gateway.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine_worker import protocol as p
from gateway.api.edge import error_response
from gateway.api.lanes import Lanes, WsClientError
from gateway.api.responses.chat import Message
from gateway.api.responses.events import ResponseEvents
from gateway.api.responses.request import (
    ResponsesRequest,
    build_request,
    decode_create,
    new_response_id,
    previous_response_not_found,
    response_not_found,
)
from gateway.api.responses.ws import (
    TranscriptCache,
    WsCreate,
    client_error_event,
    parse_client_message,
    ws_error,
    ws_text,
)
from gateway.config import Limits
from gateway.core import sse
from gateway.core.delivery import resume_point
from gateway.errors import APIError

MODEL = "stub-model"
MAX_DELTAS = 40

@dataclass
class Entry:
    req: ResponsesRequest
    builder: ResponseEvents
    log: list[dict[str, Any]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def append(self, events: list[dict[str, Any]]) -> None:
        self.log += events
        self.changed.set()
        self.changed = asyncio.Event()

    async def follow(self, after: int) -> Any:
        """Replay and live tail are one loop: a cursor into the log."""
        i = after + 1
        while True:
            while i < len(self.log):
                yield self.log[i]
                i += 1
            if self.builder.done:
                return
            await self.changed.wait()

class Stub:
    def __init__(self, delta_interval: float = 0.03) -> None:
        self.interval = delta_interval
        self.entries: dict[str, Entry] = {}
        self.transcripts: dict[str, list[Message]] = {}
        self.limits = Limits(default_max_tokens=16, max_tokens_cap=4096)

    def start(self, req: ResponsesRequest, generate: bool = True) -> Entry:
        rid = new_response_id()
        e = Entry(req, ResponseEvents(rid, req.chat.model or MODEL, request=req))
        e.append(e.builder.created())
        if req.store:
            self.entries[rid] = e
        e.task = asyncio.create_task(self._generate(e, generate))
        return e

    async def _generate(self, e: Entry, generate: bool) -> None:
        if not generate:
            e.append(e.builder.in_progress() + e.builder.finish("stop", p.Usage(1, 0)))
            self.transcripts[e.builder.id] = e.req.transcript(None)
            return
        n = min(e.req.max_tokens, MAX_DELTAS)
        e.append(e.builder.in_progress())
        for i in range(n):
            await asyncio.sleep(self.interval)
            e.append(e.builder.delta(f"tok{i} "))
        e.append(e.builder.finish("length" if n == e.req.max_tokens else "stop", p.Usage(5, n)))
        self.transcripts[e.builder.id] = e.req.transcript(e.builder.turn())

    def cancel(self, e: Entry) -> None:
        if not e.builder.done and e.task is not None:
            e.task.cancel()
            e.append(e.builder.cancel())

    def parse(self, body: bytes | dict[str, Any]) -> ResponsesRequest:
        req = decode_create(body)
        history: list[Message] = []
        if req.previous_response_id:
            found = self.transcripts.get(req.previous_response_id)
            if found is None:
                raise previous_response_not_found(req.previous_response_id)
            history = found
        return build_request(req, self.limits, history)

    # -- HTTP -----------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        try:
            req = self.parse(await request.body())
        except APIError as err:
            return error_response(err)
        e = self.start(req)
        if req.stream:
            return self._sse(e, -1)
        if not req.background:
            assert e.task is not None
            await e.task
        return JSONResponse(e.builder.response())

    def _entry(self, request: Request) -> Entry:
        e = self.entries.get(request.path_params["rid"])
        if e is None:
            raise response_not_found(request.path_params["rid"])
        return e

    async def retrieve(self, request: Request) -> Response:
        try:
            e = self._entry(request)
            after = resume_point(request.query_params.get("starting_after"), "starting_after")
        except APIError as err:
            return error_response(err)
        if request.query_params.get("stream") == "true":
            return self._sse(e, after)
        return JSONResponse(e.builder.response())

    async def cancel_route(self, request: Request) -> Response:
        try:
            e = self._entry(request)
        except APIError as err:
            return error_response(err)
        self.cancel(e)
        return JSONResponse(e.builder.response())

    @staticmethod
    def _sse(e: Entry, after: int) -> StreamingResponse:
        async def body() -> Any:
            async for ev in e.follow(after):
                yield sse.event(orjson.dumps(ev), event=ev["type"])
        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                         "owned_by": "tokenfan"}]})

    # -- WebSocket mode -------------------------------------------------------------------------

    async def ws(self, ws: WebSocket) -> None:
        await ws.accept()
        lanes: Lanes[WsCreate] = Lanes()
        cache = TranscriptCache()
        send_lock = asyncio.Lock()
        tasks: set[asyncio.Task[None]] = set()

        async def send(text: str) -> None:
            async with send_lock:
                await ws.send_text(text)

        async def run(lane: str | None, msg: WsCreate) -> None:
            try:
                history: list[Message] = []
                pid = msg.request.previous_response_id
                if pid:
                    found = cache.get(pid) or self.transcripts.get(pid)
                    if found is None:
                        raise previous_response_not_found(pid)
                    history = found
                req = build_request(msg.request, self.limits, history)
                e = self.start(req, msg.generate)
                async for ev in e.follow(-1):
                    await send(ws_text(orjson.dumps(ev), lane))
                cache.put(e.builder.id, req.transcript(None if not msg.generate else e.builder.turn()))
            except APIError as err:
                await send(orjson.dumps(ws_error(err, lane)).decode())
            for nxt in lanes.finished(lane):
                spawn(*nxt)

        def spawn(lane: str | None, msg: WsCreate) -> None:
            t = asyncio.create_task(run(lane, msg))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        try:
            while True:
                text = await ws.receive_text()
                try:
                    msg = parse_client_message(text)
                    for started in lanes.submit(msg.stream_id, msg):
                        spawn(*started)
                except WsClientError as err:
                    await send(orjson.dumps(client_error_event(err)).decode())
        except WebSocketDisconnect:
            for t in tasks:
                t.cancel()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/responses", self.create, methods=["POST"]),
            WebSocketRoute("/v1/responses", self.ws),
            Route("/v1/responses/{rid}", self.retrieve),
            Route("/v1/responses/{rid}/cancel", self.cancel_route, methods=["POST"]),
        ])

class StubServer:
    """The stub on a loopback port, served by uvicorn in a thread."""

    def __init__(self, port: int, delta_interval: float = 0.03) -> None:
        config = uvicorn.Config(Stub(delta_interval).app(), host="127.0.0.1", port=port, log_level="warning",
                                ws="websockets-sansio")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
