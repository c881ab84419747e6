"""Who is asking, and how much each client holds: per-client limits and fair admission.

A *client* is its API key when keys are on (``key:`` + a hash prefix: the key itself is kept nowhere here),
else its address (``addr:<ip>``): the TCP peer's, or, only when that peer is one of ``--trusted-proxies``,
the rightmost ``X-Forwarded-For`` entry that is not itself a trusted proxy (entries further left were
written by the client and prove nothing). A stream token (an ``EventSource`` URL) carries no key, so its
subscriber counts under its address.

What a client holds (connections, generations, subscriptions) is counted in one
:class:`gateway.admission.Holdings` per gateway process; its docstring has the table of kinds, limits and codes.
This module names the client and counts its connections.

Fair admission (:func:`gateway.admission.fair_refusal`, pure): when the gateway is saturated, the clients holding the most are
refused first and a client holding nothing still gets in. ``docs/limits.md`` lists every limit and its error.
"""

from __future__ import annotations

import hashlib
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.edge import refuse
from gateway.config import TrustedProxies
from gateway.core.bare import defer
from gateway.errors import APIError

log = logging.getLogger(__name__)



# -- identity ------------------------------------------------------------------------------------


def key_client(api_key: str) -> str:
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:24]


def identify(scope: Scope, trusted: TrustedProxies) -> str:
    """The client id of an HTTP or WebSocket scope (after ``AuthMiddleware``, which records the key)."""
    key = scope.get("state", {}).get("api_key")
    if key is not None:
        return key_client(key)
    peer = scope.get("client")
    host = peer[0] if peer else "unknown"
    forwarded = None
    if trusted.networks:
        for name, value in scope.get("headers", ()):
            if name == b"x-forwarded-for":
                forwarded = value.decode("latin-1") if forwarded is None else forwarded + "," + value.decode("latin-1")
    return "addr:" + trusted.client_address(host, forwarded)


# -- connections (ASGI) ----------------------------------------------------------------------------

class ClientLimitMiddleware:
    """Names the client of every HTTP and WebSocket scope (``scope["state"]["client"]``) and counts its open
    ``/v1/*`` connections; one over ``--max-connections-per-client`` gets 429 ``client_connection_limit``
    (a WebSocket: accepted, one ``error`` message, closed with 4429), before any work is done for it.

    Sits inside ``AuthMiddleware`` (which records the API key) and finds the gateway on the app's state."""

    def __init__(self, app: ASGIApp, trusted: TrustedProxies) -> None:
        self.app = app
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        client = identify(scope, self.trusted)
        scope.setdefault("state", {})["client"] = client
        gw = getattr(scope["app"].state, "gateway", None)
        path: str = scope["path"]
        if gw is None or not path.startswith("/v1/") or path == "/v1/time":
            return await self.app(scope, receive, send)
        try:
            gw.clients.acquire("connections", client, gw.config.max_connections_per_client)
        except APIError as err:
            gw.refused(err)
            return await refuse(scope, receive, send, err)
        clients = gw.clients
        try:
            await self.app(scope, receive, send)
        finally:  # now, or when a detached subscriber's connection ends (gateway.core.bare)
            defer(scope, lambda: clients.release("connections", client))
