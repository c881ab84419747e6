"""Several engine workers behind one gateway: least-loaded routing, routing around dead engines.

Each engine has its own :class:`EngineClient` (own DEALER socket, own heartbeats). A new request goes
to the healthy engine with the smallest load, where load = the engine's last reported running +
waiting requests + this gateway's requests submitted since that heartbeat (so a burst between two
heartbeats still spreads). A request's handle names the link it is on (``owner``: the one that
submitted it, or the one that took its continuation), so its abort reaches the engine that runs it. With
one engine this is a thin pass-through. Failures are :class:`gateway.errors.EngineError`; each link
tracks its engine instance (see :mod:`gateway.core.engine_link`).

Migration (docs/failures.md): when a link loses its engine (dropped connection, missed heartbeats, a new
instance), each request that can be continued exactly is re-submitted to a healthy engine as a
*continuation* (:meth:`EngineClient.resume`: the same request plus the output token ids delivered so far;
the engine generates the rest of the budget), so its stream goes on with the next token. With no healthy
engine (one engine, restarting) it waits up to ``MigrationPolicy.wait`` seconds. Requests it cannot
continue exactly fail with ``engine_unavailable``, as before: past the migration limit or the sequence
length limit. A request served by vLLM's OpenAI layer (tools, parsers, structured outputs, logprobs,
``n`` > 1) continues from its engine steps (``Submit.resume_steps``: the engine replays them through its
parsers and grammar, ``engine_worker/backends/vllm_resume.py``). The rules (:class:`Migrator`) take the
clock and the healthy engines as arguments; :class:`EnginePool` runs them on its links and retries parked
requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine_worker import protocol as p
from gateway.core.engine_client import EngineClient
from gateway.core.metrics import Migrations
from gateway.core.request import Failure, RequestHandle
from gateway.errors import EngineError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    """When a request whose engine was lost continues on another (``--migration-*``)."""

    limit: int = 3  # continuations per request (0: never; the request fails as before)
    wait: float = 60.0  # seconds to wait for a healthy engine (a restarting one) before failing
    max_tokens: int = 0  # prompt + output tokens above which a request is not continued (0: no limit)


class Target(Protocol):
    """An engine a continuation can be sent to (:class:`EngineClient`, or a bare
    :class:`gateway.core.engine_link.EngineLink`)."""

    address: str

    @property
    def engine_id(self) -> str | None: ...

    def routing_load(self) -> int: ...

    def resume(self, handle: RequestHandle, now: float) -> bool: ...


class Migrator:
    """Requests lost with their engine, parked until an engine takes their continuation (pure: the clock and
    the healthy engines are passed in)."""

    def __init__(self, policy: MigrationPolicy, migrations: Migrations) -> None:
        self.policy = policy
        self.migrations = migrations
        self.parked: list[tuple[RequestHandle, EngineError, float]] = []  # (handle, its loss, deadline)

    def refusal(self, h: RequestHandle) -> tuple[str, str] | None:
        """Why a lost request cannot be continued exactly (a reason code, its words), or None."""
        policy, sampling = self.policy, h.submit.sampling
        if h.migrations >= policy.limit:
            return ("limit", "migration is off" if not policy.limit else
                    f"it was continued {h.migrations} times already")
        if not h.openai:  # vLLM's OpenAI layer needs neither: the engine replays its steps (Submit.resume_steps)
            if h.output_chars and not h.output_ids:
                return "no_token_ids", "its deltas carried no token ids"
            if len(h.output_ids) >= sampling.max_tokens:
                return "budget_spent", "its token budget is spent"
        prompt = h.prompt_tokens or 0
        if policy.max_tokens and prompt + len(h.output_ids) > policy.max_tokens:
            return "max_tokens", f"its sequence ({prompt + len(h.output_ids)} tokens) is over --migration-max-tokens"
        return None

    def lost(self, address: str, handles: list[RequestHandle], err: EngineError, now: float) -> None:
        """Park what can be continued; fail the rest with ``err``."""
        for h in handles:
            if h.closed:
                continue
            if h.trace is not None:
                h.trace.engine_lost(address, err.code or "engine_unavailable")
            refused = self.refusal(h)
            if refused is not None:
                reason, why = refused
                if h.trace is not None:
                    h.trace.migration_refused(reason)
                self.migrations.outcomes["refused"] += 1
                self.migrations.refusals[reason] += 1
                log.warning("request %s lost with engine %s: not continued (%s)", h.request_id, address, why,
                            extra={"trace": h.trace})
                h.done = True
                h.fail(err)
                continue
            h.migrations += 1
            h.lost_at = now
            self.parked.append((h, err, now + self.policy.wait))

    def place(self, now: float, targets: Sequence[Target]) -> None:
        """Send every parked request's continuation to the least-loaded of ``targets`` that takes it; fail
        those past their wait."""
        waiting: list[tuple[RequestHandle, EngineError, float]] = []
        for h, err, deadline in self.parked:
            if h.closed or h.done:
                continue
            placed = None
            for target in sorted(targets, key=lambda t: t.routing_load()):
                if target.resume(h, now):
                    placed = target
                    break
            if placed is not None:
                if not h.lost_at:
                    continue  # re-attached where it was lost (Migrator.reattached)
                log.warning("request %s continued on engine %s at %s after %d output tokens (migration %d)",
                            h.request_id, placed.engine_id, placed.address, len(h.output_ids), h.migrations,
                            extra={"trace": h.trace})
            elif now >= deadline:
                self.migrations.outcomes["timeout"] += 1
                if h.trace is not None:
                    h.trace.migration_refused("timeout")
                log.error("request %s: no healthy engine within %.0fs to continue it on", h.request_id,
                          self.policy.wait, extra={"trace": h.trace})
                h.done = True
                h.fail(EngineError.unavailable(f"{err.message}; no healthy engine to continue on within "
                                               f"{self.policy.wait:g}s"))
            else:
                waiting.append((h, err, deadline))
        self.parked = waiting

    def continued(self, h: RequestHandle, gap: float, ok: bool) -> None:
        """A continuation's first delta arrived ``gap`` seconds after the loss (``ok``), or was refused."""
        if h.trace is not None:
            if ok:
                h.trace.migrated(h.owner.address, gap, len(h.output_ids))
            else:
                h.trace.migration_refused("failed")
        if not ok:  # the new engine refused the continuation: the request fails with its error
            self.migrations.outcomes["failed"] += 1
            log.error("request %s: the continuation was refused", h.request_id, extra={"trace": h.trace})
            return
        self.migrations.outcomes["continued"] += 1
        self.migrations.gap.observe(gap)

    def reattached(self, h: RequestHandle) -> None:
        """A parked request is on its engine again (the same instance answered and still ran it): no
        continuation, and no migration counted."""
        self.parked = [entry for entry in self.parked if entry[0] is not h]
        h.migrations -= 1
        log.warning("request %s re-attached on engine %s: the same instance still ran it", h.request_id,
                    h.owner.address, extra={"trace": h.trace})

    def fail_all(self, err: Failure) -> int:
        parked, self.parked = self.parked, []
        for h, _, _ in parked:
            h.done = True
            h.fail(err)
        return len(parked)


class EnginePool:
    def __init__(self, addresses: list[str], heartbeat_interval: float, heartbeat_timeout: float,
                 curve_dir: Path | None = None, migration: MigrationPolicy | None = None) -> None:
        if not addresses:
            raise ValueError("at least one engine address is required")
        self.clients = [EngineClient(a, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                                     curve_dir=curve_dir, on_lost=self._lost, on_continued=self._continued,
                                     on_reattached=self._reattached)
                        for a in addresses]
        self.policy = migration or MigrationPolicy()
        self.migrations = Migrations()
        self.migrator = Migrator(self.policy, self.migrations)
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
        return self.migrator.fail_all(err) + sum(c.fail_all(err) for c in self.clients)

    # -- migration (the rules: :class:`Migrator`) --------------------------------------------------

    def refusal(self, h: RequestHandle) -> tuple[str, str] | None:
        """Why a lost request cannot be continued exactly (a reason code, its words), or None."""
        return self.migrator.refusal(h)

    def _lost(self, client: EngineClient, handles: list[RequestHandle], err: EngineError) -> None:
        """``on_lost`` of every link: continue what can be continued, fail the rest with ``err``."""
        self.migrator.lost(client.address, handles, err, time.monotonic())
        self._place()
        if self.migrator.parked and (self._placer is None or self._placer.done()):
            self._placer = asyncio.get_running_loop().create_task(self._place_loop(), name="engine-migration")

    def _place(self) -> None:
        self.migrator.place(time.monotonic(), self._healthy())

    async def _place_loop(self) -> None:
        while self.migrator.parked:
            await asyncio.sleep(min(self._interval, 0.05))
            self._place()

    def _reattached(self, h: RequestHandle) -> None:
        self.migrator.reattached(h)

    def _continued(self, h: RequestHandle, gap: float, ok: bool) -> None:
        self.migrator.continued(h, gap, ok)

    def status(self) -> list[dict[str, object]]:
        """One entry per engine link: current ``engine_id``, ``restarts``, ``engine_changed_at``, load."""
        return [c.status() for c in self.clients]
