"""The error tree: each failure's class, its client-facing form, and the edge that makes it an HTTP response."""

from __future__ import annotations

import subprocess
import sys

import orjson

from gateway.api.edge import error_response
from gateway.errors import (
    APIError,
    ClientError,
    EngineError,
    EngineUnavailable,
    Refusal,
    StreamError,
    TokenfanError,
    bad_resume_point,
    engine_unavailable,
    owner_lost,
    slow_consumer,
    stream_expired,
    stream_lost,
    stream_not_found,
    to_api_error,
    too_many_streams,
)


def test_every_failure_is_a_tokenfan_error_on_its_branch() -> None:
    assert isinstance(EngineError.unavailable(), EngineUnavailable)
    assert issubclass(EngineUnavailable, EngineError) and issubclass(EngineError, TokenfanError)
    for err in (stream_not_found("s"), stream_expired("s"), stream_lost("s", "x"), owner_lost("s", "x"),
                slow_consumer(10, True)):
        assert isinstance(err, StreamError) and isinstance(err, TokenfanError)
    for err in (too_many_streams(3, 3), engine_unavailable()):
        assert isinstance(err, Refusal) and err.retry_after == 1.0
    assert isinstance(bad_resume_point("after", "x"), ClientError)


def test_engine_errors_become_api_errors_with_their_status_only_when_mapped() -> None:
    unavailable = to_api_error(EngineError.unavailable("gone"))
    assert isinstance(unavailable, Refusal)
    assert (unavailable.status, unavailable.code, unavailable.retry_after) == (503, "engine_unavailable", 1.0)
    too_long = to_api_error(EngineError("context_length_exceeded", "too long", "messages"))
    assert isinstance(too_long, ClientError) and (too_long.status, too_long.param) == (400, "messages")
    crashed = to_api_error(EngineError("engine_error", "boom"))
    assert type(crashed) is APIError and crashed.status == 500
    vllm = to_api_error(EngineError("BadRequestError", "bad tool", None, status=400, error_type="BadRequestError"))
    assert (vllm.status, vllm.type) == (400, "BadRequestError")
    api = ClientError(404, "no such thing", code="not_found")
    assert to_api_error(api) is api


def test_the_edge_makes_the_http_response_with_retry_after() -> None:
    resp = error_response(too_many_streams(5, 5))
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert orjson.loads(resp.body)["error"]["code"] == "too_many_streams"
    assert "retry-after" not in error_response(ClientError(400, "bad")).headers


def test_the_error_module_imports_no_web_framework() -> None:
    code = "import sys, gateway.errors; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('starlette', 'uvicorn', 'fastapi')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
