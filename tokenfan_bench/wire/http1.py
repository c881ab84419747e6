"""HTTP/1.1 responses, decoded incrementally (pure: bytes in, values out; no I/O, no event loop).

Just what the bench's fast SSE client needs: a status line and headers, then a body framed by
``Transfer-Encoding: chunked`` (what uvicorn sends for streaming responses), by ``Content-Length``,
or by the end of the connection. Chunk extensions and trailers are skipped. Requests are built by
:func:`request` (the client sends only ``GET`` and small ``POST`` bodies).
"""

from __future__ import annotations

from typing import NamedTuple

MAX_HEAD = 64 * 1024


class HttpError(ValueError):
    """The peer sent something that is not a well-formed HTTP/1.1 response."""


class ResponseHead(NamedTuple):
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value


def request(method: str, target: str, host: str, headers: dict[str, str] | None = None,
            body: bytes | None = None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body is not None:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def parse_head(raw: bytes) -> ResponseHead:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise HttpError(f"bad status line {lines[0][:100]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(f"bad header line {line[:100]!r}")
        headers[name.strip().lower()] = value.strip()
    return ResponseHead(int(rest[:3]), headers)


# Parser states
_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)


class ResponseParser:
    """One response: ``feed(bytes) -> body bytes``; ``head`` once the headers are in; ``complete``
    when the body has ended (bytes after it are kept in ``leftover``). Raises :class:`HttpError`.
    Statuses without a body (1xx, 204, 304) complete with the head.
    """

    __slots__ = ("_buf", "_left", "_state", "head", "leftover")

    def __init__(self) -> None:
        self._buf = b""  # an incomplete head, chunk-size line or chunk terminator
        self._state = _HEAD
        self._left = 0  # bytes left in the current chunk / the Content-Length body
        self.head: ResponseHead | None = None
        self.leftover = b""

    @property
    def complete(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> bytes:
        if self._buf:
            data, self._buf = self._buf + data, b""
        st = self._state
        if st == _DATA and len(data) <= self._left:  # the common case in a long chunk: all of it is body
            self._left -= len(data)
            if self._left == 0:
                self._state = _DATA_END
            return data
        if st == _UNTIL_CLOSE:
            return data
        if st == _SIZE:  # the common case in a stream of small chunks: one whole chunk
            end = data.find(b"\r\n", 0, 18)
            if end > 0 and data[-2:] == b"\r\n" and b";" not in data[:end]:
                try:
                    size = int(data[:end], 16)
                except ValueError:
                    size = 0
                if size > 0 and len(data) == end + size + 4:
                    return data[end + 2:-2]
        out: list[bytes] = []
        pos, n = 0, len(data)
        while pos < n:
            if st == _SIZE:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > 1024:
                        raise HttpError("chunk size line too long")
                    self._buf = data[pos:]
                    break
                try:
                    size = int(data[pos:end].split(b";", 1)[0], 16)
                except ValueError:
                    raise HttpError(f"bad chunk size {data[pos:end][:40]!r}") from None
                pos = end + 2
                if size == 0:
                    st = _TRAILER
                else:
                    self._left, st = size, _DATA
            elif st == _DATA:
                take = min(self._left, n - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    st = _DATA_END
            elif st == _DATA_END:
                if n - pos < 2:
                    self._buf = data[pos:]
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise HttpError("chunk not followed by CRLF")
                pos += 2
                st = _SIZE
            elif st == _TRAILER:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    self._buf = data[pos:]
                    break
                st = _DONE if end == pos else _TRAILER
                pos = end + 2
            elif st == _LENGTH:
                take = min(self._left, n - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    st = _DONE
            elif st == _HEAD:
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > MAX_HEAD:
                        raise HttpError("response head too long")
                    self._buf = data[pos:]
                    break
                self.head = parse_head(data[pos:end])
                pos = end + 4
                st = self._body_state(self.head)
            elif st == _UNTIL_CLOSE:
                out.append(data[pos:])
                pos = n
            else:  # _DONE
                self.leftover += data[pos:]
                pos = n
        self._state = st
        return out[0] if len(out) == 1 else b"".join(out)

    def _body_state(self, head: ResponseHead) -> int:
        if head.status < 200 or head.status in (204, 304):
            return _DONE
        if "chunked" in head.headers.get("transfer-encoding", "").lower():
            return _SIZE
        length = head.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise HttpError(f"bad content-length {length[:40]!r}")
            self._left = int(length)
            return _LENGTH if self._left else _DONE
        return _UNTIL_CLOSE

    def eof(self) -> None:
        """The connection ended: completes a body read until close, raises if one was cut."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state != _DONE:
            raise HttpError("connection closed before the response was complete")
