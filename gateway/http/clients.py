"""Who is asking, and how much each client holds: per-client limits and fair admission.

A *client* is its API key when keys are on (``key:`` + a hash prefix: the key itself is kept nowhere here),
else its address (``addr:<ip>``): the TCP peer's, or, only when that peer is one of ``--trusted-proxies``,
the rightmost ``X-Forwarded-For`` entry that is not itself a trusted proxy (entries further left were
written by the client and prove nothing). A stream token (an ``EventSource`` URL) carries no key, so its
subscriber counts under its address.

What a client holds, counted in one :class:`Holdings` per gateway process:

=============  ==========================================================  =============================
kind           counted while                                               limit (429 code)
=============  ==========================================================  =============================
connections    a WebSocket is open or an HTTP request on ``/v1/*`` runs    ``--max-connections-per-client``
                                                                           (``client_connection_limit``)
generations    a generation is in flight (every route, every transport)    ``--max-generations-per-client``
                                                                           (``client_generation_limit``)
subscriptions  a fan-out reader (``/v1/streams/{id}/events`` or ``/ws``)    ``--max-subscriptions-per-client``
                                                                           (``client_subscription_limit``)
=============  ==========================================================  =============================

Fair admission (:func:`fair_refusal`, pure): when the gateway is saturated, the clients holding the most are
refused first and a client holding nothing still gets in. ``docs/limits.md`` lists every limit and its error.
"""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import logging
from collections.abc import Iterable
from typing import Any, Literal

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

log = logging.getLogger(__name__)

Kind = Literal["connections", "generations", "subscriptions"]
KINDS: tuple[Kind, ...] = ("connections", "generations", "subscriptions")
CODES: dict[Kind, str] = {"connections": "client_connection_limit", "generations": "client_generation_limit",
                          "subscriptions": "client_subscription_limit"}
FLAGS: dict[Kind, str] = {"connections": "--max-connections-per-client",
                          "generations": "--max-generations-per-client",
                          "subscriptions": "--max-subscriptions-per-client"}
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


# -- identity ------------------------------------------------------------------------------------

class TrustedProxies:
    """The ``--trusted-proxies`` networks; ``forwarded_for`` reads ``X-Forwarded-For`` only from them."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self.networks: tuple[IpNetwork, ...] = tuple(ipaddress.ip_network(e.strip(), strict=False)
                                                      for e in entries if e.strip())

    def __contains__(self, host: str) -> bool:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)

    def client_address(self, peer: str, forwarded_for: str | None) -> str:
        """The client's address: ``peer`` unless it is a trusted proxy that named the client."""
        if not forwarded_for or peer not in self:
            return peer
        hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
        for hop in reversed(hops):
            if hop not in self:
                return hop
        return hops[0] if hops else peer


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


# -- holdings ------------------------------------------------------------------------------------

class Holdings:
    """What every client holds, by kind (pure counting; the callers pass the limits)."""

    def __init__(self) -> None:
        self.held: dict[Kind, collections.Counter[str]] = {k: collections.Counter() for k in KINDS}
        self.totals: dict[Kind, int] = dict.fromkeys(KINDS, 0)

    def of(self, kind: Kind, client: str) -> int:
        return self.held[kind].get(client, 0)

    def clients(self, kind: Kind) -> int:
        """Clients holding at least one of ``kind``."""
        return len(self.held[kind])

    def check(self, kind: Kind, client: str, limit: int) -> None:
        """APIError 429 (code :data:`CODES`) if ``client`` already holds ``limit`` (0 = no limit)."""
        held = self.of(kind, client)
        if limit and held >= limit:
            noun = {"connections": "open connections", "generations": "generations in flight",
                    "subscriptions": "open stream subscriptions"}[kind]
            raise APIError(429, f"This client has {held} {noun}; the limit is {limit} per client "
                                f"({FLAGS[kind]}).", type="rate_limit_error", code=CODES[kind], retry_after=1.0)

    def acquire(self, kind: Kind, client: str, limit: int = 0) -> None:
        self.check(kind, client, limit)
        self.held[kind][client] += 1
        self.totals[kind] += 1

    def release(self, kind: Kind, client: str) -> None:
        counter = self.held[kind]
        if counter.get(client, 0) <= 0:
            raise RuntimeError(f"{client} holds no {kind}")  # a release without its acquire is a bug
        counter[client] -= 1
        self.totals[kind] -= 1
        if counter[client] == 0:
            del counter[client]


def fair_refusal(holding: int, total: int, clients: int, soft_cap: int, engines_queue: bool) -> str | None:
    """Why a client holding ``holding`` of ``total`` generations (``clients`` clients hold any) must wait,
    or None.

    - Gateway saturated (``total >= soft_cap``): a client holding at least the average per client is refused,
      so the biggest holder always is, and a client holding nothing always gets in (up to --max-concurrent).
    - The engines queue requests (``engines_queue``): a client holding more than the average is refused;
      equal clients, and a client alone, are not (the engine's queue is fair among them).
    """
    if holding == 0:
        return None
    average = total / max(1, clients)
    if soft_cap and total >= soft_cap and holding >= average:
        return (f"The gateway is busy ({total} generations in flight) and this client holds {holding}, at least "
                f"the average of {average:.1f} per client")
    if engines_queue and holding > average:
        return (f"The engines are queueing requests and this client holds {holding} generations, more than the "
                f"average of {average:.1f} per client")
    return None


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
        try:
            await self.app(scope, receive, send)
        finally:
            gw.clients.release("connections", client)


async def refuse(scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
    """Answer a scope with ``err`` before the route runs: HTTP status + OpenAI body, or for a WebSocket an
    accept, one error message (the ``/v1/ws`` and Responses shapes at once) and close 4000 + status
    (a browser cannot read a refused handshake's status, but it can read this)."""
    if scope["type"] == "http":
        return await err.response()(scope, receive, send)
    message: dict[str, Any] = {"type": "error", "id": None, "status": err.status, "error": err.body()["error"]}
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": orjson.dumps(message).decode()})
    await send({"type": "websocket.close", "code": 4000 + err.status, "reason": err.code or "refused"})
