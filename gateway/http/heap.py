"""Short full collections while streams are live: the live readers' objects moved out of the collector's sight.

A full collection scans every tracked object of the oldest generation. Thousands of fan-out readers hold about
50 tracked objects each (their task, coroutine frames, connection, cursor, meter), so the full collections that
a crowd of arriving readers sets off (one each time the oldest generation grew by a quarter) took up to 286 ms
at 10,000 readers, delaying every stream of the gateway. :class:`HeapFreezer` moves what is alive to the
permanent generation (``gc.freeze()``, after a collection of the young generations) every :attr:`FreezePolicy.step`
new readers and once they stop arriving, so a full collection scans only what came since.

Frozen objects are still freed when their last reference goes (a reader that leaves frees its objects: its
path makes no reference cycle); only a cycle among frozen objects waits. When the readers fall below
:attr:`FreezePolicy.thaw_below` of what they were at the last freeze, the heap is thawed: one full collection
of everything, then frozen again (:func:`gateway.http.app.freeze_startup_heap`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

Action = Literal["freeze", "thaw"]


@dataclass(slots=True)
class FreezePolicy:
    """When to freeze the live heap and when to thaw it, from the live readers' count and the time (pure)."""

    step: int = 256  # readers more than at the last freeze: freeze again (a crowd still arriving)
    quiet: float = 1.0  # seconds without a change in the readers' count: freeze what joined since the last one
    thaw_below: float = 0.5  # fewer readers than this share of those at the last freeze: thaw
    frozen_at: int = 0  # readers at the last freeze (or thaw)
    _last: int = 0
    _changed_at: float = field(default=float("-inf"))

    def decide(self, now: float, readers: int) -> Action | None:
        """What to do now, ``readers`` being live."""
        if readers != self._last:
            self._last, self._changed_at = readers, now
        if self.frozen_at >= self.step and readers < self.thaw_below * self.frozen_at:
            self.frozen_at = readers
            return "thaw"
        if readers >= self.frozen_at + self.step or (readers > self.frozen_at and now - self._changed_at >= self.quiet):
            self.frozen_at = readers
            return "freeze"
        return None


def freeze() -> int:
    """Collect the young generations, then freeze everything alive; how many objects are frozen."""
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> int:
    """Unfreeze, collect everything, freeze again; how many objects are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class HeapFreezer:
    """Applies a :class:`FreezePolicy` every ``tick`` seconds to the count ``readers()`` returns."""

    def __init__(self, readers: Callable[[], int], policy: FreezePolicy | None = None, tick: float = 0.5) -> None:
        self.readers = readers
        self.policy = policy or FreezePolicy()
        self.tick = tick
        self.freezes = 0
        self.thaws = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heap-freezer")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def step(self, now: float) -> Action | None:
        """One decision, applied."""
        readers = self.readers()
        action = self.policy.decide(now, readers)
        if action == "freeze":
            self.freezes += 1
            log.debug("froze the live heap at %d readers: %d objects", readers, freeze())
        elif action == "thaw":
            self.thaws += 1
            t0 = time.perf_counter()
            frozen = thaw()
            log.info("thawed the heap at %d readers (%d objects frozen again, %.0f ms)", readers, frozen,
                     (time.perf_counter() - t0) * 1000)
        return action

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            self.step(time.monotonic())


__all__ = ["FreezePolicy", "HeapFreezer", "freeze", "thaw"]
