"""Access control (pure): stream tokens, API keys, the WebSocket Origin check, and the middleware's decision."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.http.auth import Auth, AuthMiddleware


def _scope(path: str, *, ws: bool = False, query: bytes = b"") -> dict[str, Any]:
    return {"type": "websocket" if ws else "http", "path": path, "query_string": query, "headers": []}


def test_a_stream_token_opens_only_its_stream_until_it_expires() -> None:
    auth = Auth(secret=b"k" * 32, token_ttl=60)
    token = auth.sign("str-a", now=1000)
    assert auth.verify("str-a", token, now=1059)
    assert not auth.verify("str-a", token, now=1061)  # expired
    assert not auth.verify("str-b", token, now=1000)  # another stream
    assert not auth.verify("str-a", token[:-2] + "AA", now=1000)  # tampered
    assert not auth.verify("str-a", "garbage", now=1000)
    assert not Auth(secret=b"x" * 32).verify("str-a", token, now=1000)  # another replica's secret


def test_api_keys_and_origins() -> None:
    auth = Auth(api_keys=frozenset({"s3cret"}), allowed_origins=("https://app.example",))
    assert auth.key_ok("s3cret") and not auth.key_ok("nope") and not auth.key_ok(None)
    assert auth.origin_ok(None, "gw:8000")  # non-browser clients send no Origin
    assert auth.origin_ok("http://gw:8000", "gw:8000")  # same host
    assert auth.origin_ok("https://app.example", "gw:8000")
    assert not auth.origin_ok("https://evil.example", "gw:8000")
    assert Auth(allowed_origins=("*",)).origin_ok("https://any.example", "gw")


@pytest.mark.parametrize(("path", "ws", "query", "headers", "expected"), [
    ("/v1/chat/completions", False, b"", {}, "missing_api_key"),
    ("/v1/chat/completions", False, b"", {"authorization": "Bearer wrong"}, "invalid_api_key"),
    ("/v1/chat/completions", False, b"", {"authorization": "Bearer s3cret"}, None),
    ("/v1/responses", False, b"", {"authorization": "bearer s3cret"}, None),
    ("/v1/ws", True, b"api_key=s3cret", {}, None),  # browsers cannot set WebSocket headers
    ("/v1/chat/completions", False, b"api_key=s3cret", {}, "missing_api_key"),  # query keys: WebSocket only
    ("/v1/time", False, b"", {}, None),
    ("/health", False, b"", {}, None),
    ("/v1/ws", True, b"", {"origin": "https://evil.example", "host": "gw", "authorization": "Bearer s3cret"},
     "origin_not_allowed"),
])
def test_the_middleware_decision(path: str, ws: bool, query: bytes, headers: dict[str, str],
                                 expected: str | None) -> None:
    mw = AuthMiddleware(app=None, auth=Auth(api_keys=frozenset({"s3cret"})))  # type: ignore[arg-type]
    scope = _scope(path, ws=ws, query=query)
    err = mw._check(scope, headers)
    assert (err.code if err else None) == expected
    if expected is None and "s3cret" in (headers.get("authorization", "") + query.decode()):
        assert scope["state"]["api_key"] == "s3cret"  # per-key limits see it


def test_a_stream_token_opens_events_and_ws_without_a_key() -> None:
    auth = Auth(api_keys=frozenset({"s3cret"}))
    mw = AuthMiddleware(app=None, auth=auth)  # type: ignore[arg-type]
    token = auth.sign("str-a").encode()
    assert mw._check(_scope("/v1/streams/str-a/events", query=b"token=" + token), {}) is None
    assert mw._check(_scope("/v1/streams/str-a/ws", ws=True, query=b"token=" + token), {}) is None
    err = mw._check(_scope("/v1/streams/str-b/events", query=b"token=" + token), {})
    assert err is not None and err.code == "invalid_api_key"
    err = mw._check(_scope("/v1/streams/str-a", query=b"token=" + token), {})  # status/DELETE need the key
    assert err is not None and err.status == 401
