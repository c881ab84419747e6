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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from gateway.api.lanes import WsClientError
from gateway.api.responses.chat import Message, transcript_chars
from gateway.api.responses.request import CANCELLED_CODE, CreateRequest, decode_create
from gateway.api.validation import unsupported
from gateway.errors import APIError, ClientError

STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")
CLIENT_EVENTS = ("response.create",)

T = TypeVar("T")


@dataclass(slots=True)
class WsCreate:
    """One ``response.create``: its lane, whether to generate, and the request."""

    stream_id: str | None
    request: CreateRequest
    generate: bool = True



def ws_error(err: APIError, stream_id: str | None = None, sequence_number: int | None = None) -> dict[str, Any]:
    """The WebSocket ``error`` event for ``err`` (``status`` is the HTTP status it would have had)."""
    ev: dict[str, Any] = {"type": "error", "status": err.status, "error": err.body()["error"]}
    if sequence_number is not None:
        ev["sequence_number"] = sequence_number
    if stream_id is not None:
        ev["stream_id"] = stream_id
    return ev


def client_error_event(exc: WsClientError) -> dict[str, Any]:
    """The ``error`` event a refused client message gets (on its lane)."""
    return ws_error(exc.error, exc.stream_id)


def parse_client_message(data: str | bytes) -> WsCreate:
    """A text message from the client -> :class:`WsCreate`, or :class:`WsClientError`."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise WsClientError(ClientError(400, f"Message is not valid JSON: {exc}", code="invalid_json")) from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise WsClientError(ClientError(400, "Expected a JSON object with a string 'type'.", param="type",
                                     code="invalid_event"))
    stream_id = obj.pop("stream_id", None)
    lane = stream_id if isinstance(stream_id, str) and STREAM_ID.fullmatch(stream_id) else None
    kind = obj.pop("type")
    if kind == "response.steer":
        raise WsClientError(unsupported("type", "response.steer (steering) is not supported by this server"))
    if kind != "response.create":
        raise WsClientError(ClientError(400, f"Unknown client event type {kind!r}; expected one of "
                                          f"{list(CLIENT_EVENTS)}.", param="type", code="invalid_event"), lane)
    if stream_id is not None and lane is None:
        raise WsClientError(ClientError(400, "stream_id must be 1-256 ASCII letters, digits, underscores, hyphens "
                                          "or periods.", param="stream_id", code="invalid_stream_id"))
    generate = obj.pop("generate", True)
    if not isinstance(generate, bool):
        raise WsClientError(ClientError(400, "generate must be a boolean.", param="generate", code="invalid_type"), lane)
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

