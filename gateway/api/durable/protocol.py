"""The Durable Streams protocol's read side on a stream's log (pure: a stream and numbers in, bytes out).

Written from the protocol's PROTOCOL.md (durable-streams/durable-streams, "Version 1.0" draft, sections 5.5-5.8,
8, 9.1, 10) and read against its reference server (``packages/server/src/server.ts``, ``cursor.ts``) and the
clients ``@durable-streams/client`` 0.2.7 (npm) and ``durable-streams`` 0.1.0 (PyPI).

A *message* is one event's payload, the JSON an API's own clients get (a ``chat.completion.chunk``, a Responses
event, a UI message part); the stream is an ``application/json`` stream of them, read as JSON arrays (9.1.5).
A stream that did not finish normally has one more message at its end, its *trailer*: ``{"error": {...}}``
(the OpenAI error, as the fan-out SSE ``event: error`` carries it) or ``{"reason": "cancelled"}`` (the fan-out's
``event: end``). A *position* is the ``seq`` of the next message a reader gets (the trailer's is the number of
events); its *offset* is that position as sixteen decimal digits, so offsets sort as they follow each other
(8: opaque, lexicographically sortable, strictly increasing) and are the same on every replica (a mirror places
events by ``seq``). ``-1`` is the start and ``now`` the tail (8, sentinels).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import orjson

from gateway.core.streams import Stream
from gateway.errors import ClientError, stream_lost

CONTENT_TYPE = "application/json"
WIDTH = 16
_OFFSET = re.compile(rf"\d{{1,{WIDTH}}}")
MAX_MESSAGES = 4096  # per catch-up or long-poll answer; past it the answer has no Stream-Up-To-Date

# The protocol's default cursor (10.1): 20-second intervals counted from 2024-10-09T00:00:00Z.
CURSOR_EPOCH_S = 1728432000
CURSOR_INTERVAL_S = 20
CURSOR_JITTER_S = (1, 3600)

SECURITY_HEADERS = {"x-content-type-options": "nosniff", "cross-origin-resource-policy": "cross-origin"}
CACHEABLE = "private, max-age=60, stale-while-revalidate=300"  # 10.1: a user's stream, kept by its browser only
NO_STORE = "no-store"  # HEAD, offset=now, an open stream's tail, a long-poll's 204 (5.5, 8, 10.1)
EXPOSED = ("Stream-Next-Offset", "Stream-Cursor", "Stream-Up-To-Date", "Stream-Closed", "ETag")


def offset(position: int) -> str:
    return f"{position:0{WIDTH}d}"


def closed(stream: Stream) -> bool:
    """Whether no message will ever be added: it ended here for good (not moved elsewhere, end durable)."""
    return stream.over and stream.state in ("done", "error", "cancelled")


def trailer(stream: Stream) -> bytes | None:
    """The last message of a closed stream that did not finish normally (None: it did, or it is open)."""
    if not closed(stream) or stream.state == "done":
        return None
    if stream.state == "cancelled":
        return b'{"reason":"cancelled"}'
    err = stream.error or stream_lost(stream.id, "it failed without its error")
    return orjson.dumps(err.body())


def tail(stream: Stream) -> int:
    """The position after the last message there is now (the trailer counts once the stream is closed)."""
    return len(stream.events) + (trailer(stream) is not None)


def parse_offset(raw: str | None, stream: Stream) -> int:
    """The position ``?offset=`` names: absent or ``-1`` the start, ``now`` the tail, else an offset this
    server wrote. Past the tail of an open stream is allowed (a replica that mirrors it may be behind the one
    that wrote the offset); past a closed one's, or malformed, is a 400."""
    if raw is None or raw == "-1":
        return 0
    if raw == "now":
        return tail(stream)
    if not _OFFSET.fullmatch(raw):
        raise ClientError(400, f"Malformed offset {raw[:64]!r}: send -1, now or a Stream-Next-Offset this server "
                               "returned.", param="offset", code="invalid_value")
    position = int(raw)
    if closed(stream) and position > tail(stream):
        raise ClientError(400, f"Offset {raw} is past the end of stream {stream.id} ({offset(tail(stream))}).",
                          param="offset", code="invalid_value")
    return position


def messages(stream: Stream, position: int, limit: int = MAX_MESSAGES) -> tuple[list[bytes], int]:
    """The messages from ``position`` on (at most ``limit``) and the position after them."""
    events = stream.events
    out = [ev.json for ev in events[position:position + limit]]
    end = position + len(out)
    if end == len(events) and len(out) < limit and (last := trailer(stream)) is not None:
        out.append(last)
        end += 1
    return out, max(end, position)


def json_array(items: list[bytes]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def etag(stream_id: str, start: str, end: int, is_closed: bool) -> str:
    """10.1: varies with the range and with closure (``:c``), so a 304 never hides the end."""
    return f'"{stream_id}:{start}:{offset(end)}{":c" if is_closed else ""}"'


def cursor(now_s: float, client: str | None, jitter: Callable[[int, int], int] = random.randint) -> str:
    """10.1: the current interval's number; one past a client cursor that is not behind it (plus 1-3600 s of
    jitter, in intervals), so cursors never go back and a CDN's cache keys move on."""
    current = int((now_s - CURSOR_EPOCH_S) // CURSOR_INTERVAL_S)
    if client is None or not client.isdigit() or int(client) < current:
        return str(current)
    return str(int(client) + max(1, -(-jitter(*CURSOR_JITTER_S) // CURSOR_INTERVAL_S)))


def sse_data(items: list[bytes]) -> bytes:
    """``event: data`` carrying messages as one JSON array (5.8), a ``data:`` line per line of it."""
    body = json_array(items)
    lines = body.split(b"\n") if b"\n" in body else [body]
    return b"event: data\n" + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"


def sse_control(position: int, cursor_: str | None, up_to_date: bool, is_closed: bool = False) -> bytes:
    """``event: control`` after every data event (5.8); a closed stream's has ``streamClosed`` and no cursor."""
    control: dict[str, object] = {"streamNextOffset": offset(position)}
    if is_closed:
        control["streamClosed"] = True
        control["upToDate"] = True
    else:
        if cursor_ is not None:
            control["streamCursor"] = cursor_
        if up_to_date:
            control["upToDate"] = True
    return b"event: control\ndata: " + orjson.dumps(control) + b"\n\n"
