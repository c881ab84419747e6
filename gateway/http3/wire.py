"""The head of one request on a WebTransport stream (pure: bytes in, values out).

A WebTransport stream carries one HTTP exchange of the gateway's own routes, so every route, limit and
resume path is the same as over HTTP/1.1, HTTP/2 and HTTP/3:

    client -> server   {"method": "GET", "path": "/v1/streams/ID/events", "headers": {"last-event-id": "7"}}\\n
                       then the request body (POST), then the end of the stream (FIN)
    server -> client   {"status": 200, "headers": {"content-type": "text/event-stream; charset=utf-8"}}\\n
                       then the response body: for a streamed route exactly the SSE bytes an
                       EventSource reads (``id:``/``data:`` lines), then FIN

One JSON line each way (UTF-8, at most :data:`MAX_HEAD` bytes) is all a browser needs to write and read
(``TextEncoder``/``TextDecoder``), and the event bytes after it are those of the other arms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

MAX_HEAD = 16 * 1024
METHODS = frozenset({"GET", "POST", "DELETE"})


class HeadError(ValueError):
    """A request head that is too long or not a JSON object of the expected shape."""


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    path: str  # with its query string, if any
    headers: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        return orjson.dumps({"method": self.method, "path": self.path, "headers": self.headers}) + b"\n"

    def asgi_headers(self) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]


def split_head(buf: bytes | bytearray) -> tuple[RequestHead, bytes] | None:
    """The request head at the start of ``buf`` and the bytes after it; None while the line is incomplete.

    Raises :class:`HeadError` for a line past :data:`MAX_HEAD` or one that is not a request head."""
    end = buf.find(b"\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise HeadError(f"request head longer than {MAX_HEAD} bytes")
        return None
    if end > MAX_HEAD:
        raise HeadError(f"request head longer than {MAX_HEAD} bytes")
    try:
        raw = orjson.loads(bytes(buf[:end]))
    except orjson.JSONDecodeError as exc:
        raise HeadError(f"request head is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise HeadError("request head must be a JSON object")
    method, path, headers = raw.get("method", "GET"), raw.get("path"), raw.get("headers", {})
    if method not in METHODS:
        raise HeadError(f"method must be one of {', '.join(sorted(METHODS))}")
    if not isinstance(path, str) or not path.startswith("/"):
        raise HeadError("path must be a string starting with /")
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise HeadError("headers must be an object of strings")
    try:
        for k, v in headers.items():
            k.encode("latin-1"), v.encode("latin-1")
    except UnicodeEncodeError:
        raise HeadError("header names and values must be Latin-1") from None
    return RequestHead(method, path, headers), bytes(buf[end + 1:])


def response_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The server's head line for ``status`` and the ASGI ``headers`` (repeated names joined by ``, ``)."""
    out: dict[str, str] = {}
    for k, v in headers:
        name, value = k.decode("latin-1").lower(), v.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return orjson.dumps({"status": status, "headers": out}) + b"\n"


def parse_response_head(buf: bytes | bytearray) -> tuple[int, dict[str, str], bytes] | None:
    """The client side: ``(status, headers, rest)`` once the head line is complete, else None."""
    end = buf.find(b"\n")
    if end < 0:
        return None
    raw = orjson.loads(bytes(buf[:end]))
    return int(raw["status"]), dict(raw.get("headers", {})), bytes(buf[end + 1:])
