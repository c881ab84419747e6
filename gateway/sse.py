"""Server-Sent Events framing (pure: values in, bytes out).

Data passed in must be a single line (JSON from orjson never contains a raw newline).
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"


def event(data: bytes, *, id: int | str | None = None, event: str | None = None, retry_ms: int | None = None) -> bytes:
    """One SSE event. Field order: retry, event, id, data (any order is valid)."""
    parts: list[bytes] = []
    if retry_ms is not None:
        parts.append(b"retry: %d\n" % retry_ms)
    if event is not None:
        parts.append(b"event: " + event.encode() + b"\n")
    if id is not None:
        parts.append(b"id: " + str(id).encode() + b"\n")
    parts.append(b"data: " + data + b"\n\n")
    return b"".join(parts)


def comment(text: str = "") -> bytes:
    """A comment line: ignored by EventSource, keeps proxies from cutting an idle stream."""
    return b": " + text.encode() + b"\n\n"


def parse_last_event_id(raw: str | None) -> int | None:
    """A ``Last-Event-ID`` as a sequence number; ``None`` if absent; ValueError if malformed."""
    if raw is None or raw == "":
        return None
    value = int(raw)
    if value < -1:
        raise ValueError("negative event id")
    return value
