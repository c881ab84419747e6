"""OpenAI-shaped errors.

    EngineError              raised by the engine link (gateway.core.engine_client): a code from the engine's
                             ``Error`` message, or ``engine_unavailable``; no HTTP status in that layer
    APIError                 an error a client receives: status + {"error": {message, type, param, code}}
    ├── invalid_request      400 / 404 / 413 / 422
    └── engine_unavailable   503 (with Retry-After)

:func:`to_api_error` is the one place an :class:`EngineError` becomes an :class:`APIError`; each
transport then frames ``APIError.body()`` its own way (HTTP status, SSE ``event: error``, WS message).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

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


class EngineError(Exception):
    """A failure reported by (or about) the engine link, by machine-readable ``code``."""

    def __init__(self, code: str, message: str, param: str | None = None, status: int = 0,
                 error_type: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status  # set by vLLM's OpenAI layer in the engine: vllm serve's own status and type
        self.error_type = error_type

    @classmethod
    def unavailable(cls, detail: str = "the engine is not answering heartbeats") -> EngineError:
        """The engine link is down or the instance that held the request is gone (maps to 503)."""
        return cls("engine_unavailable", f"Service unavailable: {detail}; retry shortly.")

    def __repr__(self) -> str:
        return f"EngineError({self.code!r}, {self.message!r}, {self.param!r})"


class APIError(Exception):
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
        return cls(status, message, type=type_, param=param, code=code, retry_after=retry)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def response(self) -> Response:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after else None
        return Response(self.to_bytes(), status_code=self.status, media_type="application/json", headers=headers)


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


def to_api_error(exc: EngineError | APIError) -> APIError:
    """The client-facing form of an engine-side failure (an APIError passes through)."""
    if isinstance(exc, APIError):
        return exc
    if exc.code == "engine_unavailable":
        return APIError(503, exc.message, type="server_error", code="engine_unavailable", retry_after=1.0)
    if exc.status:
        return APIError(exc.status, exc.message, type=exc.error_type or "invalid_request_error", param=exc.param,
                        code=exc.code)
    return APIError.from_engine(exc.code, exc.message, exc.param)


def engine_unavailable(detail: str = "the engine is not answering heartbeats") -> APIError:
    return APIError(503, f"Service unavailable: {detail}; retry shortly.", type="server_error",
                    code="engine_unavailable", retry_after=1.0)


# A stream's lookup and loss, wherever it is served (a gateway's own hub, a mirror of another's):
# one wording and one code each, so a reader gets the same answer from every replica and worker.


def stream_not_found(stream_id: str) -> APIError:
    return APIError(404, f"No stream with id {stream_id}.", code="stream_not_found", param="id")


def stream_expired(stream_id: str, detail: str = "") -> APIError:
    """The 410: the id existed, its stream is no longer retained (``detail``: why, or for how long streams are kept)."""
    return APIError(410, f"Stream {stream_id} is no longer retained{detail}.", code="stream_expired", param="id")


def stream_lost(stream_id: str, detail: str, *, status: int = 502) -> APIError:
    """Part of the stream is gone: it ends with this error, never with a normal end (410: it cannot be served)."""
    return APIError(status, f"Stream {stream_id} is incomplete: {detail}.", type="server_error", code="stream_lost",
                    param="id" if status == 410 else None)


def owner_lost(stream_id: str, detail: str) -> APIError:
    """The gateway (replica or worker) that ran the stream is gone before its end."""
    return APIError(502, f"The gateway running stream {stream_id} is gone: {detail}.", type="server_error",
                    code="owner_lost")
