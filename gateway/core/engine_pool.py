"""Several engine workers behind one gateway: least-loaded routing, routing around dead engines.

Each engine has its own :class:`EngineClient` (own DEALER socket, own heartbeats). A new request goes
to the healthy engine with the smallest load, where load = the engine's last reported running +
waiting requests + this gateway's requests submitted since that heartbeat (so a burst between two
heartbeats still spreads). A request's handle belongs to the client that submitted it, so aborts
always reach the right engine. With one engine this is a thin pass-through. Failures are
:class:`gateway.errors.EngineError`; each link tracks its engine instance (see ``gateway.core.engine_client``).

Migration (docs/failures.md): when a link loses its engine (dropped connection, missed heartbeats, a new
instance), each request that can be continued exactly is re-submitted to a healthy engine as a
*continuation* (:meth:`EngineClient.resume`: the same request plus the output token ids delivered so far;
the engine generates the rest of the budget), so its stream goes on with the next token. With no healthy
engine (one engine, restarting) it waits up to ``MigrationPolicy.wait`` seconds. Requests it cannot
continue exactly fail with ``engine_unavailable``, as before: served by vLLM's OpenAI layer (tools, parsers,
structured outputs, logprobs, ``n`` > 1), with presence or frequency penalties (they depend on the output so
far), past the migration limit or the sequence length limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engine_worker import protocol as p
from gateway.core.engine_client import EngineClient, Failure, RequestHandle
from gateway.core.metrics import Migrations
from gateway.errors import EngineError

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    """When a request whose engine was lost continues on another (``--migration-*``)."""

    limit: int = 3  # continuations per request (0: never; the request fails as before)
    wait: float = 60.0  # seconds to wait for a healthy engine (a restarting one) before failing
    max_tokens: int = 0  # prompt + output tokens above which a request is not continued (0: no limit)


class EnginePool:
    def __init__(self, addresses: list[str], heartbeat_interval: float, heartbeat_timeout: float,
                 curve_dir: Path | None = None, migration: MigrationPolicy | None = None) -> None:
        if not addresses:
            raise ValueError("at least one engine address is required")
        self.clients = [EngineClient(a, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                                     curve_dir=curve_dir, on_lost=self._lost, on_continued=self._continued)
                        for a in addresses]
        self.policy = migration or MigrationPolicy()
        self.migrations = Migrations()
        self._parked: list[tuple[RequestHandle, EngineError, float]] = []  # (handle, its loss, deadline)
        self._placer: asyncio.Task[None] | None = None
        self._interval = heartbeat_interval

    async def start(self) -> None:
        for c in self.clients:
            await c.start()

    async def close(self) -> None:
        if self._placer is not None:
            self._placer.cancel()
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
        parked, self._parked = self._parked, []
        for h, _, _ in parked:
            h.done = True
            h._fail(err)
        return len(parked) + sum(c.fail_all(err) for c in self.clients)

    # -- migration -------------------------------------------------------------------------

    def refusal(self, h: RequestHandle) -> str | None:
        """Why a lost request cannot be continued exactly, or None."""
        policy, sampling = self.policy, h.submit.sampling
        if h.migrations >= policy.limit:
            return "migration is off" if not policy.limit else f"it was continued {h.migrations} times already"
        if h.openai:
            if h.output_chunks and not h.steps:
                return "its chunks carried no engine steps"
        elif h.output_chars and not h.output_ids:
            return "its deltas carried no token ids"
        elif len(h.output_ids) >= sampling.max_tokens:
            return "its token budget is spent"
        accepted = h.accepted
        prompt = accepted.result() if accepted.done() and not accepted.cancelled() and accepted.exception() is None \
            else 0
        if policy.max_tokens and prompt + len(h.output_ids) > policy.max_tokens:
            return f"its sequence ({prompt + len(h.output_ids)} tokens) is over --migration-max-tokens"
        return None

    def _lost(self, client: EngineClient, handles: list[RequestHandle], err: EngineError) -> None:
        """``on_lost`` of every link: continue what can be continued, fail the rest with ``err``."""
        now = time.monotonic()
        for h in handles:
            if h.closed:
                continue
            why = self.refusal(h)
            if why is not None:
                self.migrations.outcomes["refused"] += 1
                log.warning("request %s lost with engine %s: not continued (%s)", h.request_id, client.address, why)
                h.done = True
                h._fail(err)
                continue
            h.migrations += 1
            h.lost_at = now
            self._parked.append((h, err, now + self.policy.wait))
        self._place()
        if self._parked and (self._placer is None or self._placer.done()):
            self._placer = asyncio.get_running_loop().create_task(self._place_loop(), name="engine-migration")

    def _place(self) -> None:
        """Re-submit every parked request to the least-loaded healthy engine; fail those past their wait."""
        now = time.monotonic()
        waiting: list[tuple[RequestHandle, EngineError, float]] = []
        for h, err, deadline in self._parked:
            if h.closed or h.done:
                continue
            placed = None
            for client in sorted(self._healthy(), key=lambda c: c.routing_load()):
                if client.resume(h):
                    placed = client
                    break
            if placed is not None:
                log.warning("request %s continued on engine %s at %s after %d output tokens (migration %d)",
                            h.request_id, placed.engine_id, placed.address, len(h.output_ids), h.migrations)
            elif now >= deadline:
                self.migrations.outcomes["timeout"] += 1
                log.error("request %s: no healthy engine within %.0fs to continue it on", h.request_id,
                          self.policy.wait)
                h.done = True
                h._fail(EngineError.unavailable(f"{err.message}; no healthy engine to continue on within "
                                                f"{self.policy.wait:g}s"))
            else:
                waiting.append((h, err, deadline))
        self._parked = waiting

    async def _place_loop(self) -> None:
        while self._parked:
            await asyncio.sleep(min(self._interval, 0.05))
            self._place()

    def _continued(self, h: RequestHandle, now: float, ok: bool) -> None:
        if not ok:  # the new engine refused the continuation: the request fails with its error
            self.migrations.outcomes["failed"] += 1
            log.error("request %s: the continuation was refused", h.request_id)
            return
        self.migrations.outcomes["continued"] += 1
        self.migrations.gap.observe(now - h.lost_at)

    def status(self) -> list[dict[str, object]]:
        """One entry per engine link: current ``engine_id``, ``restarts``, ``engine_changed_at``, load."""
        return [c.status() for c in self.clients]
