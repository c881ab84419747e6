"""Does a bench run fit the gateway it targets? Checked before the run, from the ``limits`` of ``/health``.

A bench is one client (one address, no API key) that is a crowd: a gateway started with the defaults
refuses it past 64 generations or 128 subscriptions (docs/limits.md). Rather than run for minutes with most
attempts refused, the bench asks ``GET /health`` what the gateway allows and either runs (the run fits, or
``--fit-limits`` lowered ``--streams`` until it does) or stops at once, naming the gateway flags to lift.

What one run holds at most, for ``streams`` concurrency slots (a slot creates a stream, its arms subscribe,
and it starts the next one only when every subscriber has finished, so a slot never holds two generations):

- shared streams (the default): ``streams`` generations, ``streams × fan-out arms`` subscriptions;
- ``--separate-streams``: one generation and one subscription per fan-out arm and slot;
- every Responses arm (``resp-sse``, ``resp-ws``): one generation and one connection per slot.

Connections (open WebSockets and HTTP requests in progress) are the subscriptions plus the Responses
requests: a slot's ``POST /v1/streams`` runs when its previous subscribers are done.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import tokenfan_settings as settings
from tokenfan_bench.clients.responses import RESPONSES_TRANSPORTS


class LimitsUnknown(RuntimeError):
    """The target's ``/health`` could not be read, or the gateway is not ready."""


@dataclass(frozen=True)
class Need:
    """What a run holds at once at the gateway, as one client."""

    generations: int
    subscriptions: int
    connections: int
    subscribers_per_stream: int
    max_tokens: int


def need(transports: tuple[str, ...], streams: int, separate: bool, max_tokens: int) -> Need:
    fanout = sum(t not in RESPONSES_TRANSPORTS for t in transports)
    responses = len(transports) - fanout
    separate = separate or responses > 0  # a response is one client's: the run's streams are separate
    generations = streams * ((fanout if separate else min(fanout, 1)) + responses)
    subscriptions = streams * fanout
    return Need(generations=generations, subscriptions=subscriptions, connections=subscriptions + streams * responses,
                subscribers_per_stream=1 if separate else fanout, max_tokens=max_tokens)


def _flag(name: str) -> str:
    return next(s.option for s in settings.SETTINGS if s.name == name)


# (what the run needs, the limit's setting, 0 turns it off): checked in this order
_CHECKS: tuple[tuple[str, str, bool], ...] = (
    ("generations", "max_generations_per_client", True),
    ("subscriptions", "max_subscriptions_per_client", True),
    ("connections", "max_connections_per_client", True),
    ("generations", "max_concurrent", False),
    ("subscribers_per_stream", "max_subscribers", False),
    ("max_tokens", "max_tokens_cap", False),
)


def over(n: Need, limits: dict[str, Any]) -> list[tuple[str, int, int]]:
    """The limits ``n`` passes: ``(setting name, needed, limit)``, in the order of :data:`_CHECKS`."""
    out = []
    for what, name, zero_off in _CHECKS:
        limit = limits.get(name)
        if not isinstance(limit, int) or (zero_off and limit == 0):
            continue
        needed = getattr(n, what)
        if needed > limit:
            out.append((name, needed, limit))
    share, cap = limits.get("fair_share_at"), limits.get("max_concurrent")
    if isinstance(share, (int, float)) and isinstance(cap, int) and share > 0 and n.generations > int(cap * share):
        out.append(("fair_share_at", n.generations, int(cap * share)))  # past it, one client holding all is refused
    return out


def lift(problems: list[tuple[str, int, int]]) -> list[str]:
    """The gateway flags that lift ``problems``: ``0`` for the per-client limits and the fair share, the
    needed value for the others."""
    args = []
    for name, needed, _ in problems:
        value = "0" if name.endswith("_per_client") or name == "fair_share_at" else str(needed)
        args.append(f"{_flag(name)} {value}")
    return list(dict.fromkeys(args))


def largest_fit(transports: tuple[str, ...], streams: int, separate: bool, max_tokens: int,
                limits: dict[str, Any]) -> int:
    """The most streams up to ``streams`` whose run fits ``limits`` (0: none does)."""
    lo, hi = 0, streams
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if over(need(transports, mid, separate, max_tokens), limits):
            hi = mid - 1
        else:
            lo = mid
    return lo


def read(url: str, timeout: float = 5.0, cafile: str | None = None, wait: float = 0.0) -> dict[str, Any] | None:
    """The ``limits`` of ``url``'s ``/health`` (``None``: the gateway does not say, e.g. an older one);
    raises :class:`LimitsUnknown` when ``/health`` cannot be read or the gateway is not ready. A gateway that
    refuses connections or answers 503 (still starting) is asked again for up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return _read(url, timeout, cafile)
        except _NotYet as exc:
            if time.monotonic() >= deadline:
                raise LimitsUnknown(str(exc)) from None
            time.sleep(0.5)


class _NotYet(LimitsUnknown):
    """The gateway is not up or not ready yet."""


def _read(url: str, timeout: float, cafile: str | None) -> dict[str, Any] | None:
    import ssl

    ctx = None
    if url.startswith("https"):
        ctx = ssl.create_default_context(cafile=cafile)
        if not cafile:  # a self-signed test server: read its limits without verifying it
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout, context=ctx) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            raise _NotYet(f"{url}/health answers 503: the gateway is not ready (its engine is still starting, "
                          "or down); run the bench once /health answers 200") from None
        raise LimitsUnknown(f"{url}/health answers HTTP {exc.code}: is this a tokenfan gateway?") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            raise _NotYet(f"cannot reach {url}: connection refused (is the gateway running?)") from None
        raise LimitsUnknown(f"cannot read {url}/health: {exc.reason}") from None
    except (OSError, ValueError) as exc:
        raise LimitsUnknown(f"cannot read {url}/health: {exc}") from None
    limits = body.get("limits") if isinstance(body, dict) else None
    return limits if isinstance(limits, dict) else None


def refusal(url: str, problems: list[tuple[str, int, int]], streams: int, fit: int) -> str:
    """What the bench prints when a run does not fit: every limit it passes, the flags to lift them, and
    the largest ``--streams`` that fits as it is."""
    what = {"generations": "generations in flight", "subscriptions": "fan-out subscriptions",
            "connections": "open connections", "subscribers_per_stream": "subscribers per stream",
            "max_tokens": "max_tokens"}
    lines = [(f"tokenfan bench: this run does not fit the limits of the gateway at {url} (its /health), so it "
             "was not started: every attempt past a limit would be refused."),
             f"It needs, at once, as one client ({streams} streams):"]
    names = {name: w for w, name, _ in _CHECKS}
    for name, needed, limit in problems:
        if name == "fair_share_at":
            lines.append(f"  - {needed} generations in flight: one client holding more than {limit} is refused "
                         f"once the gateway is that busy ({_flag('fair_share_at')} × {_flag('max_concurrent')})")
        else:
            lines.append(f"  - {needed} {what[names[name]]}: the limit is {limit} ({_flag(name)})")
    flags = " ".join(lift(problems))
    lines.append(f"Restart the gateway with {flags} (docs/limits.md: a load generator is one client), "
                 + (f"or run at most --streams {fit} (--fit-limits does that)." if fit else "."))
    return "\n".join(lines)
