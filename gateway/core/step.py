"""One engine step's pass through the delivery core (:class:`Step`): the clock read once, and the writers to
flush once at its end.

Its own module so that the engine link (:mod:`gateway.core.engine_link`), which makes a step per engine
frame, knows nothing of connections: what a step holds is anything with a ``flush`` (:class:`Flushable`), which
:mod:`gateway.core.conn`'s connections are."""

from __future__ import annotations

from typing import Protocol


class Flushable(Protocol):
    def flush(self) -> None:
        """Write what this step gave it, in one transport write."""


class Step:
    """One engine step's pass through the delivery core: its clock, read once (``now``: monotonic
    seconds for gaps and timeouts; ``wall_ns``: epoch ns for delivery latency), and the connections that
    took frames during the pass, flushed once each at its end."""

    __slots__ = ("_held", "now", "wall_ns")

    def __init__(self, now: float, wall_ns: int) -> None:
        self.now = now
        self.wall_ns = wall_ns
        self._held: list[Flushable] = []

    def hold(self, conn: Flushable) -> None:
        """``conn`` has frames to write at the end of this step."""
        self._held.append(conn)

    def flush(self) -> None:
        """One transport write per connection for everything the pass gave it."""
        held, self._held = self._held, []
        for conn in held:
            conn.flush()
