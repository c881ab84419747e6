"""Admission: whether a new generation may start, and what every client holds.

- :class:`Holdings`: what each client holds (connections, generations, subscriptions), pure counting;
  :func:`fair_refusal`: who waits when the gateway is saturated (pure).
- :class:`LoopMonitor`: how late the event loop runs; a gateway that is behind refuses new work.
- :class:`Admission`: the checks a new generation passes, in order (overload, the gateway's total, the
  client's own limits, fair admission), each refusal an :class:`~gateway.errors.APIError` with its code.

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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Literal

from gateway.config import GatewayConfig
from gateway.errors import Refusal

log = logging.getLogger(__name__)

Kind = Literal["connections", "generations", "subscriptions"]
KINDS: tuple[Kind, ...] = ("connections", "generations", "subscriptions")
CODES: dict[Kind, str] = {"connections": "client_connection_limit", "generations": "client_generation_limit",
                          "subscriptions": "client_subscription_limit"}
FLAGS: dict[Kind, str] = {"connections": "--max-connections-per-client",
                          "generations": "--max-generations-per-client",
                          "subscriptions": "--max-subscriptions-per-client"}


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
            raise Refusal(429, f"This client has {held} {noun}; the limit is {limit} per client "
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


class LoopMonitor:
    """How late the event loop runs: the overshoot of a short periodic sleep, over the last ``window`` s.

    ``lag`` is the worst tick of the window (``tokenfan_event_loop_lag_seconds``). ``sustained``, what
    admission compares with ``--max-loop-lag``, is the median of the ticks' *busy* overshoot: the part of the
    lateness the loop's own work explains, at most the CPU its thread used during the tick. Time the process
    did not run (stopped, descheduled on a busy host, waiting on a page fault) is not work: a stall shows in
    ``lag`` and never in ``sustained``, however many stalls the window holds (two stalls a tick apart used to
    fill the median of a three-tick window). A loop behind on most ticks because of its work raises both. A
    gateway that is behind would only deliver everything later, failure notices included, so it refuses new
    work instead."""

    def __init__(self, interval: float = 0.05, window: float = 1.0) -> None:
        self.interval = interval
        self.window = window
        self.lag = 0.0
        self.sustained = 0.0
        self._recent: collections.deque[tuple[float, float, float]] = collections.deque()  # (at, overshoot, busy)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-monitor")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def record(self, at: float, overshoot: float, cpu: float | None = None) -> None:
        """Add one tick: ``overshoot`` s late, ``cpu`` s of the loop thread's CPU during it (None: all of the
        overshoot was work). Keeps the window (never fewer than 3 ticks, so a loop slower than one tick per
        window still has a median)."""
        busy = overshoot if cpu is None else min(overshoot, cpu)
        self._recent.append((at, overshoot, busy))
        while len(self._recent) > 3 and at - self._recent[0][0] > self.window:
            self._recent.popleft()
        self.lag = max(v for _, v, _ in self._recent)
        worked = sorted(b for _, _, b in self._recent)
        self.sustained = worked[len(worked) // 2]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(self.interval)
            now = loop.time()
            self.record(now, max(0.0, now - t - self.interval), time.thread_time() - cpu)


class Admission:
    """The checks a new generation passes before it is submitted (:meth:`check`), on what the gateway
    holds: per-client :attr:`clients` and the event loop's :attr:`loop` lag."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.clients = Holdings()
        self.loop = LoopMonitor()
        self._overload_logged_at = float("-inf")

    def check(self, client: str, key: str | None, engines_queue: bool) -> None:
        """Raise the refusal a new generation of ``client`` gets, if any: overload, the gateway's total, the
        client's own limits, then fair admission (:func:`fair_refusal`). ``engines_queue``: the engines
        report waiting requests."""
        max_lag = self.config.max_loop_lag
        lag = self.loop.sustained
        if max_lag and lag > max_lag:
            now = time.monotonic()
            if now - self._overload_logged_at > 1.0:  # rate-limited: one line per second of refusals
                self._overload_logged_at = now
                log.warning("refusing new work: event loop %.0f ms behind (median of the last second; "
                            "--max-loop-lag %.0f ms)", lag * 1000, max_lag * 1000)
            raise Refusal(503, f"The gateway is overloaded (event loop {lag * 1000:.0f} ms behind; the "
                                f"limit is {max_lag * 1000:.0f} ms); retry shortly.", type="server_error",
                           code="overloaded", retry_after=1.0)
        held = self.clients
        total = held.totals["generations"]
        if total >= self.config.max_concurrent:
            raise Refusal(429, f"Too many concurrent generations ({total}); the limit is "
                                f"{self.config.max_concurrent}.", type="rate_limit_error",
                           code="too_many_requests", retry_after=1.0)
        per_key = self.config.max_concurrent_per_key
        mine = held.of("generations", client)
        if per_key and key is not None and mine >= per_key:
            raise Refusal(429, f"This API key has {mine} generations in flight; the limit is "
                                f"{per_key}.", type="rate_limit_error", code="too_many_requests", retry_after=1.0)
        held.check("generations", client, self.config.max_generations_per_client)
        soft = int(self.config.max_concurrent * self.config.fair_share_at) if self.config.fair_share_at else 0
        why = fair_refusal(mine, total, held.clients("generations"), soft,
                           engines_queue=mine > 0 and engines_queue)
        if why is not None:
            raise Refusal(429, why + "; retry shortly.", type="rate_limit_error", code="fair_share_limit",
                           retry_after=1.0)
