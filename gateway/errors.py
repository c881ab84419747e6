"""Errors, as a tree (httpx's ``_exceptions.py`` is the model). No web framework here: the edge maps them.

    TokenfanError                 every failure the gateway names: a message and a machine-readable ``code``
    ├── EngineError               raised by the engine link (gateway.core.engine_link): a code from the engine's
    │   │                         ``Error`` message; no HTTP status in that layer
    │   └── EngineUnavailable     the link is down, or the instance that held the request is gone
    └── APIError                  what a client receives: a status and {"error": {message, type, param, code}}
        ├── ClientError           the request cannot be served as sent: 400 / 401 / 403 / 404 / 408 / 409 / 413 / 422
        ├── Refusal               a limit, an overload or a shutdown: 429 / 503, with Retry-After
        └── StreamError           a stream's lookup (404 / 410), its loss (502), its mirror's or its reader's end (503)

:func:`to_api_error` is the one place an :class:`EngineError` becomes an :class:`APIError`. The edge frames
``APIError.body()`` its own way: an HTTP response (:func:`gateway.api.edge.error_response`), an SSE
``event: error`` (the framings of :mod:`gateway.core.framing`), a WebSocket message and close code.
"""

from __future__ import annotations

from typing import Any

import orjson

# engine Error.code -> (HTTP status, OpenAI error type)
ENGINE_CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "engine_overloaded": (503, "server_error"),
    "engine_unavailable": (503, "server_error"),
    "engine_error": (500, "server_error"),
    "aborted": (499, "server_error"),
    "server_shutdown": (503, "server_error"),
}


class TokenfanError(Exception):
    """A failure the gateway names (the root of the tree above): what failed (``message``), a machine-readable
    ``code`` and the request field it concerns (``param``), if any."""

    code: str | None
    message: str
    param: str | None


class EngineError(TokenfanError):
    """A failure reported by (or about) the engine link, by machine-readable ``code``."""

    code: str

    def __init__(self, code: str, message: str, param: str | None = None, status: int = 0,
                 error_type: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status  # set by vLLM's OpenAI layer in the engine: vllm serve's own status and type
        self.error_type = error_type

    @classmethod
    def unavailable(cls, detail: str = "the engine is not answering heartbeats") -> EngineUnavailable:
        """The engine link is down or the instance that held the request is gone (maps to 503)."""
        return EngineUnavailable("engine_unavailable", f"Service unavailable: {detail}; retry shortly.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r}, {self.param!r})"


class EngineUnavailable(EngineError):
    """The engine link is down, or the instance that held the request is gone."""


class APIError(TokenfanError):
    """An error as a client receives it (OpenAI's shape); ``retry_after``: seconds, for a Retry-After header."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @classmethod
    def from_engine(cls, code: str, message: str, param: str | None = None) -> APIError:
        status, type_ = ENGINE_CODES.get(code, (500, "server_error"))
        retry = 1.0 if status == 503 else None
        kind = Refusal if status == 503 else ClientError if 400 <= status < 500 else APIError
        return kind(status, message, type=type_, param=param, code=code, retry_after=retry)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, code={self.code!r})"


class ClientError(APIError):
    """The request cannot be served as sent (bad input, unknown id or route, missing key, too large)."""


class Refusal(APIError):
    """A limit, an overload or a shutdown: the same request may succeed later (or elsewhere)."""


class StreamError(APIError):
    """A stream cannot be (or no longer be) read here: unknown, expired, incomplete, or its reader was cut."""


CONTENT_CODES = {"context_length_exceeded", "prompt_too_long"}
NETWORK_CODES = {"slow_consumer"}


def error_class(err: APIError) -> str:
    """The streaming error class for metrics: ``network`` (the path to the client), ``content`` (the
    prompt or output does not fit), ``client`` (any other bad request), ``engine`` (the server side)."""
    if err.code in NETWORK_CODES:
        return "network"
    if err.code in CONTENT_CODES:
        return "content"
    return "client" if err.status < 500 else "engine"


def to_api_error(exc: TokenfanError) -> APIError:
    """The client-facing form of an engine-side failure (an APIError passes through)."""
    if isinstance(exc, APIError):
        return exc
    if not isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error", code=getattr(exc, "code", None))
    if isinstance(exc, EngineUnavailable) or exc.code == "engine_unavailable":
        return Refusal(503, exc.message, type="server_error", code="engine_unavailable", retry_after=1.0)
    if exc.status:
        return APIError(exc.status, exc.message, type=exc.error_type or "invalid_request_error", param=exc.param,
                        code=exc.code)
    return APIError.from_engine(exc.code, exc.message, exc.param)


def engine_unavailable(detail: str = "the engine is not answering heartbeats") -> Refusal:
    return Refusal(503, f"Service unavailable: {detail}; retry shortly.", type="server_error",
                    code="engine_unavailable", retry_after=1.0)


# A stream's lookup and loss, wherever it is served (a gateway's own hub, a mirror of another's):
# one wording and one code each, so a reader gets the same answer from every replica and worker.


def stream_not_found(stream_id: str) -> StreamError:
    return StreamError(404, f"No stream with id {stream_id}.", code="stream_not_found", param="id")


def stream_expired(stream_id: str, detail: str = "") -> StreamError:
    """The 410: the id existed, its stream is no longer retained (``detail``: why, or for how long streams are kept)."""
    return StreamError(410, f"Stream {stream_id} is no longer retained{detail}.", code="stream_expired", param="id")


def stream_lost(stream_id: str, detail: str, *, status: int = 502) -> StreamError:
    """Part of the stream is gone: it ends with this error, never with a normal end (410: it cannot be served)."""
    return StreamError(status, f"Stream {stream_id} is incomplete: {detail}.", type="server_error", code="stream_lost",
                    param="id" if status == 410 else None)


def stream_rolled_back(stream_id: str, seq: int, held: int) -> StreamError:
    """The reader read events the stream's log no longer holds (its store lost them, and the stream goes on
    from before them): its reading cannot go on as one answer."""
    return StreamError(502, f"Stream {stream_id} was rolled back: this reader read up to event {seq - 1}, and the "
                       f"stream goes on from {held} events (its broker lost the rest); read it again from the "
                       "start (?after=-1) or start a new generation.", type="server_error", code="stream_rolled_back")


def owner_lost(stream_id: str, detail: str) -> StreamError:
    """The gateway (replica or worker) that ran the stream is gone before its end."""
    return StreamError(502, f"The gateway running stream {stream_id} is gone: {detail}.", type="server_error",
                    code="owner_lost")


def owner_fenced(stream_id: str) -> StreamError:
    """This gateway cannot confirm it still owns the stream (``--broker``: its lease went unconfirmed)."""
    return StreamError(503, f"This gateway lost touch with the stream broker while it ran {stream_id}; read it on "
                       "another replica, or again here shortly (GET /v1/responses/{id}, or resume with "
                       "Last-Event-ID).", type="server_error", code="owner_fenced", retry_after=1.0)


def too_many_streams(streams: int, limit: int) -> Refusal:
    """The 429 of a gateway holding as many streams as ``--max-streams`` allows."""
    return Refusal(429, f"Too many streams ({streams}); the limit is {limit}.", type="rate_limit_error",
                   code="too_many_streams", retry_after=1.0)


def slow_consumer(send_timeout: float, resumable: bool) -> StreamError:
    """A reader cut because a write was blocked past ``--send-timeout``."""
    hint = " Resume with Last-Event-ID (or ?after=<last seq>) to continue." if resumable else ""
    return StreamError(503, f"Reader too slow: a write was blocked for more than {send_timeout:g}s.{hint}",
                       type="server_error", code="slow_consumer")


def bad_resume_point(param: str, raw: str | None) -> ClientError:
    """A resume position (``Last-Event-ID``, ``?after=``, ``starting_after``) that is not an event id."""
    return ClientError(400, f"{param} must be an integer event id >= -1 (-1: from the start), got {raw!r}.",
                       param=param, code="invalid_value")


def conflicting_resume_points(given: dict[str, str]) -> ClientError:
    """A reader that names two different resume positions (say ``Last-Event-ID: 4`` and ``?after=7``)."""
    named = ", ".join(f"{name}={raw}" for name, raw in given.items())
    return ClientError(400, f"The resume positions disagree ({named}); send one of them.",
                       param=next(iter(given)), code="invalid_value")


def delivery_failed(exc: Exception) -> APIError:
    """A bug rendering or writing one generation (the others go on)."""
    return APIError(500, f"The gateway failed to deliver this generation: {exc!r}", type="server_error",
                    code="internal_error")
