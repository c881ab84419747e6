"""A bounded share of each event-loop turn for subscriber work (:class:`Turnstile`).

Thousands of subscribers arriving at once each start with a first step that runs until it parks: the route,
the response head, detaching, then the replay of the stream's history, 64 events a write. All of them would
run in one loop turn, and every timer waits behind them (the engine link's heartbeat pings, the watchdog,
other streams' deliveries): a gateway subscribing 10,000 readers of one stream stalled its loop for seconds.
Each such unit of work takes a turn first; at most :data:`PER_TURN` units run in one loop turn, the rest
wait, first come first served, for the next turns. When nothing waits a turn costs no await at all.
"""

from __future__ import annotations

import asyncio
import collections

PER_TURN = 32  # units of subscriber work (a first step, a replay write of up to 64 events) per loop turn


class Turnstile:
    """At most ``per_turn`` callers of :meth:`turn` go on in each event-loop turn; the others wait in order."""

    __slots__ = ("_admitted", "_armed", "_waiting", "per_turn", "waited")

    def __init__(self, per_turn: int = PER_TURN) -> None:
        self.per_turn = per_turn
        self.waited = 0  # turns taken by waiting (how often the bound held someone back)
        self._admitted = 0  # units let through in the current turn
        self._armed = False  # the next turn's reset is scheduled
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def turn(self) -> None:
        """Return at once if this loop turn has room (and nobody waits), else when a later turn has."""
        if self._admitted < self.per_turn and not self._waiting:
            self._admitted += 1
            self._arm()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self.waited += 1
        self._arm()
        try:
            await fut
        except asyncio.CancelledError:
            if not fut.done() or fut.cancelled():
                try:
                    self._waiting.remove(fut)
                except ValueError:
                    pass
            raise

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """A new loop turn: let the next ``per_turn`` waiters go (they run in the turn after this callback's)."""
        self._armed = False
        self._admitted = 0
        waiting = self._waiting
        while waiting and self._admitted < self.per_turn:
            fut = waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                self._admitted += 1
        if waiting or self._admitted:
            self._arm()


__all__ = ["PER_TURN", "Turnstile"]
