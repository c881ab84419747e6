"""Responses API WebSocket mode (pure): client messages in, requests and error events out.

The protocol, as the official SDKs speak it (``client.responses.connect()`` in Python,
``ResponsesWS`` from ``openai/resources/responses/ws`` in Node):

- The client opens ``ws(s)://<base>/responses`` (``Authorization: Bearer`` on the handshake) and
  sends ``{"type": "response.create", ...}``: the ``POST /v1/responses`` body without ``stream``
  (implicit) or ``background`` (refused), plus the WebSocket-only ``stream_id`` (a *lane*) and
  ``generate`` (``false``: a warmup that prepares state and produces no output).
- The server answers with the same events as over SSE. Events of a named lane carry its
  ``stream_id``; default-lane events carry none. Requests on one lane run FIFO without overlap;
  lanes run concurrently up to an active limit, and further creates wait (:class:`Lanes`).
- Errors are ``{"type": "error", "status", "error": {"type", "code", "message", "param"}}``
  (plus ``stream_id`` on a named lane, ``sequence_number`` when the error is part of a response's
  events); the socket stays open. Documented codes: ``previous_response_not_found``,
  ``invalid_stream_id``, ``websocket_stream_limit_reached``.
- ``previous_response_id`` resolves from a connection-local cache (:class:`TranscriptCache`, which
  also holds ``store: false`` responses), then from retained stored responses; otherwise
  ``previous_response_not_found``. A failed continuation on the same lane evicts its parent.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import orjson

from gateway.api.responses_api import CANCELLED_CODE, CreateRequest, decode_create
from gateway.api.responses_chat import Message, transcript_chars
from gateway.api.validation import unsupported
from gateway.errors import APIError

STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")
CLIENT_EVENTS = ("response.create",)

T = TypeVar("T")


@dataclass(slots=True)
class WsCreate:
    """One ``response.create``: its lane, whether to generate, and the request."""

    stream_id: str | None
    request: CreateRequest
    generate: bool = True


class WsClientError(Exception):
    """A client message that cannot be served; :meth:`event` is what the socket sends back."""

    def __init__(self, err: APIError, stream_id: str | None = None) -> None:
        super().__init__(err.message)
        self.error = err
        self.stream_id = stream_id

    def event(self) -> dict[str, Any]:
        return ws_error(self.error, self.stream_id)


def ws_error(err: APIError, stream_id: str | None = None, sequence_number: int | None = None) -> dict[str, Any]:
    """The WebSocket ``error`` event for ``err`` (``status`` is the HTTP status it would have had)."""
    ev: dict[str, Any] = {"type": "error", "status": err.status, "error": err.body()["error"]}
    if sequence_number is not None:
        ev["sequence_number"] = sequence_number
    if stream_id is not None:
        ev["stream_id"] = stream_id
    return ev


def parse_client_message(data: str | bytes) -> WsCreate:
    """A text message from the client -> :class:`WsCreate`, or :class:`WsClientError`."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise WsClientError(APIError(400, f"Message is not valid JSON: {exc}", code="invalid_json")) from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise WsClientError(APIError(400, "Expected a JSON object with a string 'type'.", param="type",
                                     code="invalid_event"))
    stream_id = obj.pop("stream_id", None)
    lane = stream_id if isinstance(stream_id, str) and STREAM_ID.fullmatch(stream_id) else None
    kind = obj.pop("type")
    if kind == "response.steer":
        raise WsClientError(unsupported("type", "response.steer (steering) is not supported by this server"))
    if kind != "response.create":
        raise WsClientError(APIError(400, f"Unknown client event type {kind!r}; expected one of "
                                          f"{list(CLIENT_EVENTS)}.", param="type", code="invalid_event"), lane)
    if stream_id is not None and lane is None:
        raise WsClientError(APIError(400, "stream_id must be 1-256 ASCII letters, digits, underscores, hyphens "
                                          "or periods.", param="stream_id", code="invalid_stream_id"))
    generate = obj.pop("generate", True)
    if not isinstance(generate, bool):
        raise WsClientError(APIError(400, "generate must be a boolean.", param="generate", code="invalid_type"), lane)
    obj.pop("stream", None)  # implicit over WebSocket
    if obj.get("background"):
        raise WsClientError(unsupported("background", "background is not supported over WebSocket; use "
                                        "POST /v1/responses"), lane)
    try:
        request = decode_create(obj)
    except APIError as err:
        raise WsClientError(err, lane) from err
    return WsCreate(stream_id=lane, request=request, generate=generate)


def ws_event(event: dict[str, Any], stream_id: str | None = None) -> dict[str, Any]:
    """A response log event as WebSocket mode sends it: ``stream_id`` added on a named lane, and an
    SSE-shaped ``error`` event (flat ``code``/``message``) rewritten to the WebSocket error shape."""
    if event.get("type") == "error" and "error" not in event:
        kind = "invalid_request_error" if event.get("code") == CANCELLED_CODE else "server_error"
        event = {"type": "error", "error": {"type": kind, "code": event.get("code"), "message": event.get("message"),
                                            "param": event.get("param")},
                 "sequence_number": event.get("sequence_number")}
    if stream_id is not None:
        event = {**event, "stream_id": stream_id}
    return event


def ws_text(event_json: bytes, stream_id: str | None = None) -> str:
    """:func:`ws_event` on an already serialized non-error event (a JSON object), without decoding it:
    the ``stream_id`` is spliced in, so one serialization serves every lane."""
    text = event_json.decode()
    if stream_id is None:
        return text
    return '{"stream_id":' + orjson.dumps(stream_id).decode() + "," + text[1:]


# -- lanes ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Lane(Generic[T]):
    queue: deque[T] = field(default_factory=deque)
    running: bool = False


class Lanes(Generic[T]):
    """Which ``response.create`` runs when on one connection (pure scheduling, no I/O).

    Each lane (``stream_id``; ``None`` is the default lane) runs its requests FIFO, one at a time.
    At most ``max_active`` lanes run at once; lanes with a waiting request take turns in the order
    they became ready (a lane that just finished one goes behind those already waiting).
    ``max_named`` distinct named lanes per connection (``websocket_stream_limit_reached`` after) and
    ``max_pending`` waiting requests (``pending_error``, by default a ``429``, after) bound what one socket
    can hold.

    ``/v1/ws`` uses it too, with one lane per request id and ``keep_idle=False``: a lane is forgotten when
    its request ends (or is cancelled while it waits), so ``max_active`` generations run and ``max_pending``
    wait, and an id is free again once its request is over.
    """

    def __init__(self, max_active: int = 16, max_named: int = 32, max_pending: int = 256, *,
                 keep_idle: bool = True, pending_error: Callable[[Lanes[T]], APIError] | None = None) -> None:
        self.max_active = max_active
        self.max_named = max_named
        self.max_pending = max_pending
        self.keep_idle = keep_idle
        self.pending_error = pending_error or _too_many_waiting
        self._lanes: dict[str | None, _Lane[T]] = {}
        self._ready: deque[str | None] = deque()  # lanes with a waiting head, in arrival order
        self._active = 0
        self._pending = 0

    @property
    def active(self) -> int:
        return self._active

    @property
    def pending(self) -> int:
        return self._pending

    def __contains__(self, lane_id: str | None) -> bool:
        return lane_id in self._lanes

    def cancel(self, lane_id: str | None) -> bool:
        """Drop the requests waiting on ``lane_id`` (not the running one); True if there were any."""
        lane = self._lanes.get(lane_id)
        if lane is None or not lane.queue:
            return False
        self._pending -= len(lane.queue)
        lane.queue.clear()
        if lane_id in self._ready:
            self._ready.remove(lane_id)
        if not lane.running and not self.keep_idle:
            del self._lanes[lane_id]
        return True

    def submit(self, lane_id: str | None, item: T) -> list[tuple[str | None, T]]:
        """Queue ``item`` on its lane; returns what to start now (lane, item), in order."""
        lane = self._lanes.get(lane_id)
        if lane is None:
            named = sum(1 for k in self._lanes if k is not None)
            if lane_id is not None and named >= self.max_named:
                raise WsClientError(APIError(400, f"At most {self.max_named} distinct stream_id values per "
                                                  "connection.", param="stream_id",
                                             code="websocket_stream_limit_reached"), lane_id)
            lane = self._lanes[lane_id] = _Lane()
        if self._pending >= self.max_pending and not (self._active < self.max_active and not lane.running):
            if not lane.queue and not lane.running and not self.keep_idle:
                del self._lanes[lane_id]
            raise WsClientError(self.pending_error(self), lane_id)
        lane.queue.append(item)
        self._pending += 1
        if not lane.running and len(lane.queue) == 1:
            self._ready.append(lane_id)
        return self._schedule()

    def finished(self, lane_id: str | None) -> list[tuple[str | None, T]]:
        """The running request of ``lane_id`` reached its terminal event; returns what to start now."""
        lane = self._lanes.get(lane_id)
        if lane is None or not lane.running:
            raise RuntimeError(f"lane {lane_id!r} has nothing running")
        lane.running = False
        self._active -= 1
        if lane.queue:
            self._ready.append(lane_id)
        elif not self.keep_idle:
            del self._lanes[lane_id]
        return self._schedule()

    def _schedule(self) -> list[tuple[str | None, T]]:
        started = []
        while self._ready and self._active < self.max_active:
            lane_id = self._ready.popleft()
            lane = self._lanes[lane_id]
            lane.running = True
            self._active += 1
            self._pending -= 1
            started.append((lane_id, lane.queue.popleft()))
        return started


def _too_many_waiting(lanes: Lanes[Any]) -> APIError:
    return APIError(429, f"Too many responses waiting on this connection (at most {lanes.max_pending}).",
                    type="rate_limit_error", code="rate_limit_exceeded")


# -- previous_response_id --------------------------------------------------------------------------


class TranscriptCache:
    """The connection-local transcripts of recent responses (for ``previous_response_id``), LRU
    bounded by entry count and total text size. It holds ``store: false`` responses too: they are
    continuable on their own connection only, and nothing of them outlives it."""

    def __init__(self, max_entries: int = 64, max_chars: int = 4_000_000) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._items: OrderedDict[str, tuple[list[Message], int]] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, transcript: list[Message]) -> None:
        self.evict(response_id)
        size = transcript_chars(transcript)
        if size > self.max_chars:
            return
        self._items[response_id] = (transcript, size)
        self._chars += size
        while len(self._items) > self.max_entries or self._chars > self.max_chars:
            _, (_, dropped) = self._items.popitem(last=False)
            self._chars -= dropped

    def get(self, response_id: str) -> list[Message] | None:
        hit = self._items.get(response_id)
        if hit is None:
            return None
        self._items.move_to_end(response_id)
        return hit[0]

    def evict(self, response_id: str) -> None:
        hit = self._items.pop(response_id, None)
        if hit is not None:
            self._chars -= hit[1]

