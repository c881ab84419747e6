"""Several engine workers behind one gateway: least-loaded routing, routing around dead engines.

Each engine has its own :class:`EngineClient` (own DEALER socket, own heartbeats). A new request goes
to the healthy engine with the smallest load, where load = the engine's last reported running +
waiting requests + this gateway's requests submitted since that heartbeat (so a burst between two
heartbeats still spreads). A request's handle belongs to the client that submitted it, so aborts
always reach the right engine. With one engine this is a thin pass-through. Failures are
:class:`gateway.errors.EngineError`; each link tracks its engine instance (see ``gateway.core.engine_client``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine_worker import protocol as p
from gateway.core.engine_client import EngineClient, Failure, RequestHandle
from gateway.errors import EngineError

log = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, addresses: list[str], heartbeat_interval: float, heartbeat_timeout: float,
                 curve_dir: Path | None = None) -> None:
        if not addresses:
            raise ValueError("at least one engine address is required")
        self.clients = [EngineClient(a, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                                     curve_dir=curve_dir) for a in addresses]

    async def start(self) -> None:
        for c in self.clients:
            await c.start()

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

    def _healthy(self) -> list[EngineClient]:
        return [c for c in self.clients if c.healthy]

    @property
    def healthy(self) -> bool:
        return bool(self._healthy())

    @property
    def last_heartbeat(self) -> p.Heartbeat | None:
        beats = [c.last_heartbeat for c in self._healthy() or self.clients if c.last_heartbeat is not None]
        return beats[0] if beats else None

    @property
    def model(self) -> str | None:
        hb = self.last_heartbeat
        return hb.model if hb else None

    @property
    def bad_frames(self) -> int:
        return sum(c.bad_frames for c in self.clients)

    def load(self) -> tuple[int, int]:
        loads = [c.load() for c in self._healthy()]
        return sum(r for r, _ in loads), sum(w for _, w in loads)

    def submit(self, submit: p.Submit) -> RequestHandle:
        """Submit to the least-loaded healthy engine; try the next one if a send fails. Raises EngineError."""
        candidates = sorted(self._healthy(), key=lambda c: c.routing_load())
        if not candidates:
            raise EngineError.unavailable()
        last: EngineError | None = None
        for client in candidates:
            try:
                return client.submit(submit)
            except EngineError as exc:
                last = exc
                log.warning("engine %s refused a submit (%s); trying the next", client.address, exc.message)
        assert last is not None
        raise last

    def fail_all(self, err: Failure) -> int:
        return sum(c.fail_all(err) for c in self.clients)

    def status(self) -> list[dict[str, object]]:
        """One entry per engine link: current ``engine_id``, ``restarts``, ``engine_changed_at``, load."""
        return [c.status() for c in self.clients]
