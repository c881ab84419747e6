"""Access control: API keys, stream-scoped signed tokens, and the WebSocket Origin allow-list.

- With API keys configured, every ``/v1/*`` route except ``/v1/time`` needs
  ``Authorization: Bearer <key>``. WebSocket routes also accept ``?api_key=<key>`` (browsers cannot
  set headers on a WebSocket; note that query strings may end up in proxy logs).
- ``EventSource`` cannot send headers either: ``POST /v1/streams`` returns URLs carrying a short-lived
  ``token`` (HMAC-SHA256 over stream id and expiry) that opens that one stream's ``events``, ``ws`` and
  ``durable``.
- The keys and the token secrets can be replaced while the gateway runs (:mod:`gateway.http.reload`, on
  SIGHUP): :func:`read_key_file` and :func:`read_secret_file` read the files of ``--api-key-file`` and
  ``--token-secret-file``; the first secret signs, every other one still verifies (a rotation keeps the
  previous secret until the tokens it signed expire). A check reads the fields once, at the request's start,
  so an open stream is never cut by a reload.
- WebSocket handshakes whose ``Origin`` is neither the gateway's own host nor in the allow-list are
  refused (cross-site WebSocket hijacking). Clients that send no Origin (non-browsers) pass.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.edge import error_response
from gateway.errors import APIError, ClientError

_SUBSCRIBE = re.compile(r"^/v1/streams/([^/]+)/(events|ws|durable)$")
PUBLIC = {"/v1/time"}


class AuthFileError(ValueError):
    """A key or secret file that cannot be used (unreadable, or no secret in it); the message names it."""


def _lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthFileError(f"{path}: {exc.__class__.__name__}: {getattr(exc, 'strerror', None) or exc}") from exc
    stripped = (line.strip() for line in text.splitlines())
    return [line for line in stripped if line and not line.startswith("#")]


def read_key_file(path: Path) -> frozenset[str]:
    """The API keys of ``--api-key-file``: one per line; blank lines and ``#`` comments are skipped."""
    return frozenset(_lines(path))


def read_secret_file(path: Path) -> tuple[bytes, ...]:
    """The stream-token secrets of ``--token-secret-file``, the signing one first (same format as keys)."""
    found = tuple(dict.fromkeys(line.encode() for line in _lines(path)))
    if not found:
        raise AuthFileError(f"{path}: no secret in it (one per line, the current one first)")
    return found


@dataclass
class Auth:
    api_keys: frozenset[str] = frozenset()
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))  # signs, and verifies
    token_ttl: float = 3600.0
    allowed_origins: tuple[str, ...] = ()
    previous: tuple[bytes, ...] = ()  # verify only: tokens signed before a rotation
    required: bool = False  # keys are required even while none is configured (--api-key-file)

    @property
    def enabled(self) -> bool:
        return self.required or bool(self.api_keys)

    def sign(self, stream_id: str, now: float | None = None) -> str:
        expiry = int((now or time.time()) + self.token_ttl)
        return f"{expiry}.{_mac(self.secret, stream_id, str(expiry))}"

    def verify(self, stream_id: str, token: str, now: float | None = None) -> bool:
        expiry_s, _, sig = token.partition(".")
        if not expiry_s.isdigit() or int(expiry_s) < (now or time.time()):
            return False
        return any(hmac.compare_digest(_mac(secret, stream_id, expiry_s), sig)
                   for secret in (self.secret, *self.previous))

    def key_ok(self, key: str | None) -> bool:
        return key is not None and any(hmac.compare_digest(key, k) for k in self.api_keys)

    def origin_ok(self, origin: str | None, host: str | None) -> bool:
        if origin is None or "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        return host is not None and urlsplit(origin).netloc == host


def _mac(secret: bytes, stream_id: str, expiry: str) -> str:
    mac = hmac.new(secret, f"{stream_id}.{expiry}".encode(), hashlib.sha256).digest()[:18]
    return base64.urlsafe_b64encode(mac).decode()


class AuthMiddleware:
    """Pure ASGI middleware applying :class:`Auth` to HTTP and WebSocket scopes."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        # the headers as a dict only for the check: a local would stay alive for the whole response
        err = self._check(scope, {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
        if err is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            return await error_response(err)(scope, receive, send)
        if err.status == 403:  # a foreign Origin: refuse the handshake itself (HTTP 403)
            await send({"type": "websocket.close", "code": 1008, "reason": err.message[:120]})
            return
        # Accept, say why in the protocol's own terms, then close with 4000 + HTTP status (4401):
        # a browser cannot read a refused handshake's status, but it can read this.
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": orjson.dumps({"type": "error", "id": None,
                                                                    "error": err.body()["error"]}).decode()})
        await send({"type": "websocket.close", "code": 4000 + err.status, "reason": err.code or "unauthorized"})

    def _check(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        ws = scope["type"] == "websocket"
        if ws and not self.auth.origin_ok(headers.get("origin"), headers.get("host")):
            return ClientError(403, f"Origin {headers.get('origin')} is not allowed.", type="permission_error",
                            code="origin_not_allowed")
        path: str = scope["path"]
        if not self.auth.enabled or not path.startswith("/v1/") or path in PUBLIC:
            return None
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        auth_header = headers.get("authorization", "")
        key = auth_header[7:].strip() if auth_header[:7].lower() == "bearer " else None
        if key is None and ws:
            key = (query.get("api_key") or [None])[0]
        if self.auth.key_ok(key):
            scope.setdefault("state", {})["api_key"] = key  # for per-key limits
            return None
        m = _SUBSCRIBE.match(path)
        token = (query.get("token") or [None])[0]
        if m and token and self.auth.verify(m.group(1), token):
            return None
        if key is None and token is None:
            return ClientError(401, "Missing API key: send `Authorization: Bearer <key>` (or a stream token).",
                            code="missing_api_key")
        return ClientError(401, "Incorrect API key or expired stream token.", code="invalid_api_key")
