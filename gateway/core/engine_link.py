"""The rules of one engine link, without I/O: decoded messages and the time in, messages to send and events out.

:class:`EngineLink` is the state of the gateway's side of one engine worker's socket (the ZeroMQ driver,
:class:`gateway.core.engine_client.EngineClient`, only moves what it produces, as websockets' connection
moves what its ``protocol.py`` produces). Inputs: :meth:`EngineLink.receive` (a message from the engine),
:meth:`EngineLink.tick` (the pinger's beat), :meth:`EngineLink.disconnected` (the socket monitor saw the
connection drop), :meth:`EngineLink.submit` / :meth:`EngineLink.resume` / :meth:`EngineLink.close_request` /
:meth:`EngineLink.fail_all` (the gateway's requests). Outputs: :meth:`EngineLink.data_to_send` (``Submit``,
``Abort``, ``Ping``) and :meth:`EngineLink.events_received` (:data:`LinkEvent`); deltas, acceptances and
failures go straight to each request's :class:`gateway.core.request.RequestHandle`, in the step's pass.

The rules:

* **Registry.** Messages are routed by the id the engine knows a request by (``engine_rid``). A delta for an
  id the link does not hold (an aborted request, or a lost engine's late delta of a request since continued
  under ``<id>.m<n>``) is dropped.
* **Health.** The engine is healthy while a ``Heartbeat`` arrived within ``heartbeat_timeout`` of the time this
  gateway's loop *ran*: a tick is due every ``heartbeat_interval``, and the time a tick (or a health check
  between ticks) comes past its due time, since the last heartbeat, is the gateway's own stall (its loop busy,
  the process stopped or descheduled), during which no heartbeat could be read; it is not the engine's
  silence and does not count. A tick that finds the engine unhealthy after it was healthy loses every request;
  they stay *suspended* here, not aborted: the engine may still run them. A heartbeat of the same instance
  (or a delta or error of a suspended request) then **re-attaches** each one not continued, failed or closed
  meanwhile (:class:`Reattached`: no continuation, no migration counted; its deltas go on under the same id)
  and aborts the others. A dropped connection loses every request at once (no abort: the engine routes replies by the
  connection's ZeroMQ identity, which is new after a reconnect), and the link counts as down until the next
  heartbeat, so no request is sent into the gap.
* **Engine identity.** Each engine instance names itself by the ``engine_id`` in its heartbeats. A heartbeat
  with a new id (a restart under the same address the monitor missed) loses every request sent before the
  ping it answers (aborted, in case the new instance got some); one sent after it reached the new instance,
  which reads messages in order, and carries on.
* **Continuation.** :meth:`EngineLink.resume` sends a lost request again as a continuation
  (``Submit.resume``: the output token ids so far; ``resume_steps``: the engine steps of vLLM's OpenAI
  layer so far) under ``<id>.m<n>``; its first delta is a :class:`Continued` event, an engine error before
  it a :class:`ContinuationRefused`.
* **Load.** A heartbeat's ``running + waiting`` counts what the engine had read when it answered the ping;
  :meth:`EngineLink.routing_load` adds the submits sent after that ping (a burst between two heartbeats,
  continuations included, spreads instead of all going to the engine that looked idle).

Lost requests are an event (:class:`Lost`), not a failure: the pool continues them elsewhere or fails them.
This layer raises and delivers :class:`gateway.errors.EngineError` only; mapping to HTTP is the edge's job.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from engine_worker import protocol as p
from gateway.core.request import Failure, Owner, RequestHandle
from gateway.core.step import Step
from gateway.errors import EngineError, delivery_failed

log = logging.getLogger(__name__)

# Pings whose send position is remembered, to match a new instance's first heartbeat (~16 s at 4/s).
PINGS_KEPT = 64


@dataclass(frozen=True, slots=True)
class Lost:
    """Requests the link lost with its engine, already off the link (and aborted in the engine when it may
    still run them); ``error`` is what they fail with if they are not continued."""

    handles: list[RequestHandle]
    error: EngineError


@dataclass(frozen=True, slots=True)
class Continued:
    """A continued request's first delta arrived, ``gap`` seconds after its engine was lost."""

    handle: RequestHandle
    gap: float


@dataclass(frozen=True, slots=True)
class ContinuationRefused:
    """The engine refused a continuation (an ``Error`` before its first delta); the request failed with it."""

    handle: RequestHandle


@dataclass(frozen=True, slots=True)
class Reattached:
    """A request lost with missed heartbeats is on this link again: the same engine instance answered and
    still runs it (the pool forgets its continuation)."""

    handle: RequestHandle


LinkEvent = Lost | Continued | ContinuationRefused | Reattached


class EngineLink:
    """The state of one engine link (see the module docstring). Times are monotonic seconds (``now``) and
    epoch nanoseconds (``wall_ns``), passed in by the caller."""

    def __init__(self, address: str, heartbeat_timeout: float = 1.0, heartbeat_interval: float = 0.25) -> None:
        self.address = address
        self.heartbeat_timeout = heartbeat_timeout
        self.heartbeat_interval = heartbeat_interval
        self.requests: dict[str, RequestHandle] = {}  # by engine_rid
        # lost with missed heartbeats, not aborted: engine_rid -> (handle, its owner then)
        self.suspended: dict[str, tuple[RequestHandle, Owner]] = {}
        self.last_heartbeat: p.Heartbeat | None = None
        self.bad_frames = 0
        self.aborts_sent = 0
        self.restarts = 0  # heartbeats that named a new engine instance after a first one
        self.disconnects = 0  # dropped connections to the engine address
        self.previous_engine_id: str | None = None
        self.engine_changed_at: float | None = None  # epoch seconds of the last new engine_id
        self._last_beat_at = float("-inf")
        self._tick_due = float("inf")  # when the next tick is due (none before the first)
        self._stalled = 0.0  # seconds the gateway's loop ran its ticks late since the last heartbeat
        self.longest_stall = 0.0  # the longest such lateness seen (for /health)
        self._was_healthy = False
        self._submitted_since_beat = 0
        self._submit_seq = 0  # submits sent so far; each handle keeps its own position
        self._pings: OrderedDict[int, int] = OrderedDict()  # ping sent_ns -> submits sent before it
        self._out: list[p.Message] = []
        self._events: list[LinkEvent] = []

    # -- outputs -----------------------------------------------------------------------------------

    def data_to_send(self) -> list[p.Message]:
        """The messages to send to the engine, in order, since the last call."""
        out, self._out = self._out, []
        return out

    def events_received(self) -> list[LinkEvent]:
        """What happened to requests since the last call (lost, continued, refused)."""
        events, self._events = self._events, []
        return events

    # -- state -------------------------------------------------------------------------------------

    def healthy(self, now: float) -> bool:
        """Whether a heartbeat arrived within ``heartbeat_timeout`` of the time the gateway's loop ran since."""
        return self.silence(now) < self.heartbeat_timeout

    def silence(self, now: float) -> float:
        """Seconds the engine has been silent: since the last heartbeat, less the gateway's own stall in
        that time (the ticks' lateness, and how overdue the next tick is now)."""
        since = self._last_beat_at
        return now - since - self._stalled - max(0.0, now - max(self._tick_due, since))

    @property
    def engine_id(self) -> str | None:
        return self.last_heartbeat.engine_id if self.last_heartbeat else None

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def load(self) -> tuple[int, int]:
        """The engine's last reported (running, waiting)."""
        hb = self.last_heartbeat
        return (hb.running, hb.waiting) if hb else (0, 0)

    def routing_load(self) -> int:
        """Engine-reported load plus what this gateway submitted since that report."""
        running, waiting = self.load()
        return running + waiting + self._submitted_since_beat

    def status(self, now: float) -> dict[str, object]:
        """This link for ``/health``: the current instance, how often it changed, what is in flight."""
        hb = self.last_heartbeat
        return {"address": self.address, "healthy": self.healthy(now), "engine_id": hb.engine_id if hb else None,
                "version": hb.version or None if hb else None,
                "running": hb.running if hb else None, "waiting": hb.waiting if hb else None,
                "in_flight": self.in_flight, "restarts": self.restarts, "disconnects": self.disconnects,
                "longest_loop_stall_s": round(self.longest_stall, 3),
                "previous_engine_id": self.previous_engine_id, "engine_changed_at": self.engine_changed_at}

    # -- inputs: the engine and the socket ---------------------------------------------------------

    def receive(self, msg: p.Message, now: float, wall_ns: int) -> None:
        """One decoded message from the engine (a ``DeltaBatch`` as one step: see :meth:`deliver`)."""
        if type(msg) is p.DeltaBatch:
            step = Step(now, wall_ns)
            try:
                self.deliver(msg.deltas, step)
            finally:
                step.flush()
        elif isinstance(msg, p.Accepted):
            h = self.requests.get(msg.request_id)
            if h is not None:
                h.accept(msg.prompt_tokens, msg.openai)
        elif isinstance(msg, p.Error):
            self._on_error(msg)
        elif isinstance(msg, p.Heartbeat):
            self._on_heartbeat(msg, now, wall_ns)
        else:
            self.bad_frames += 1
            log.warning("unexpected %s from engine", type(msg).__name__)

    def bad_frame(self, exc: p.WireError) -> None:
        """A frame that did not decode: dropped and counted."""
        self.bad_frames += 1
        log.warning("dropped bad frame from engine: %s", exc)

    def deliver(self, deltas: list[p.Delta], step: Step) -> None:
        """One engine step, in one pass: every delta to its request (which renders it, appends it to its stream
        and writes it to the caught-up readers there); the caller flushes ``step`` after."""
        requests = self.requests
        for d in deltas:
            h = requests.get(d.request_id)
            if h is None:
                if d.request_id not in self.suspended or not self._resumed(d.request_id):
                    continue
                h = requests[d.request_id]
            if d.finish_reason is not None:
                h.done = True
                del requests[d.request_id]
            if h.lost_at:
                self._events.append(Continued(h, step.now - h.lost_at))
                h.lost_at = 0.0
                h.rejoined = True
            try:
                h.push(d, step)
            except Exception as exc:  # a bug rendering one request must not stop the link for all
                log.exception("delivering a delta of %s failed", d.request_id)
                h.fail(delivery_failed(exc))

    def tick(self, now: float, sent_ns: int) -> None:
        """The pinger's beat, every ``heartbeat_interval``: if the heartbeats stopped since the last beat,
        every request is lost; then a ``Ping`` (stamped ``sent_ns``) to send. A tick that comes late (past
        ``heartbeat_interval`` after the previous one) measures the gateway's own stall: that time is not
        the engine's silence."""
        late = max(0.0, now - max(self._tick_due, self._last_beat_at))
        if late:
            self._stalled += late
            if late > self.heartbeat_timeout / 2:
                log.warning("this gateway's event loop was stalled for %.1fs (engine at %s: not counted as its "
                            "silence)", late, self.address)
            self.longest_stall = max(self.longest_stall, late)
        self._tick_due = now + self.heartbeat_interval
        healthy = self.healthy(now)
        if self._was_healthy and not healthy:
            log.error("engine at %s missed heartbeats for %.1fs: %d requests in flight",
                      self.address, self.silence(now), len(self.requests))
            handles = list(self.requests.values())
            self._lose(handles, EngineError.unavailable("the engine stopped answering (crashed or restarting)"),
                       abort=False)
            self.suspended.update((h.engine_rid, (h, h.owner)) for h in handles)
        self._was_healthy = healthy
        self._pings[sent_ns] = self._submit_seq
        while len(self._pings) > PINGS_KEPT:
            self._pings.popitem(last=False)
        self._out.append(p.Ping(sent_ns=sent_ns))

    def disconnected(self) -> None:
        """The connection dropped: every request is lost at once; down until the next heartbeat."""
        self.disconnects += 1
        self._last_beat_at = float("-inf")
        self._was_healthy = False
        self.suspended.clear()  # the engine routes by the connection's identity: nothing of them comes back
        if self.requests:
            log.error("connection to engine %s at %s dropped: %d requests in flight",
                      self.engine_id, self.address, len(self.requests))
            self._lose(list(self.requests.values()),
                       EngineError.unavailable("the connection to the engine dropped (crashed or restarting)"),
                       abort=False)
        else:
            log.warning("connection to engine %s at %s dropped", self.engine_id, self.address)

    def _on_heartbeat(self, msg: p.Heartbeat, now: float, wall_ns: int) -> None:
        previous = self.last_heartbeat
        self.last_heartbeat = msg
        # The heartbeat's load counts what the engine had read when it answered the ping; submits sent
        # after that ping are not in it yet.
        before = self._pings.get(msg.ping_sent_ns, self._submit_seq)
        self._submitted_since_beat = self._submit_seq - before
        self._last_beat_at = now
        self._stalled = 0.0
        if previous is None:
            log.info("engine %s up: %s model=%s", msg.engine_id, msg.backend, msg.model)
            return
        if previous.engine_id == msg.engine_id:
            for rid in list(self.suspended):
                self._resumed(rid)
            return
        if self.suspended:  # lost with the old instance: abort them in case the new one got some
            self._abort(list(self.suspended))
            self.suspended.clear()
        self.restarts += 1
        self.previous_engine_id = previous.engine_id
        self.engine_changed_at = wall_ns / 1e9
        # A submit sent before the ping this heartbeat answers may have gone to the old instance and be
        # lost; one sent after it can only have reached the new one (a link delivers in order).
        stale = [h for h in self.requests.values() if h.send_seq < before]
        log.error("engine at %s restarted: %s -> %s (%s model=%s); %d requests of the old instance lost",
                  self.address, previous.engine_id, msg.engine_id, msg.backend, msg.model, len(stale))
        if stale:
            self._lose(stale, EngineError.unavailable(
                f"the engine restarted (instance {previous.engine_id} replaced by {msg.engine_id})"), abort=True)

    def _on_error(self, msg: p.Error) -> None:
        if not msg.request_id:
            log.error("engine error: %s", msg.message)
            return
        if msg.request_id in self.suspended:
            self._resumed(msg.request_id)
        h = self.requests.pop(msg.request_id, None)
        if h is not None:
            if h.lost_at:
                self._events.append(ContinuationRefused(h))
            h.done = True
            h.fail(EngineError(msg.code, msg.message, msg.param, msg.status, msg.error_type))

    # -- inputs: the gateway's requests ------------------------------------------------------------

    def submit(self, submit: p.Submit, now: float, owner: Owner | None = None) -> RequestHandle:
        """A new request (its ``Submit`` to send); raises EngineError ``engine_unavailable`` if the engine
        is down. ``owner``: what the handle's ``close`` goes through (the driver; this link by default)."""
        if not self.healthy(now):
            raise EngineError.unavailable()
        handle = RequestHandle(owner or self, submit, self._submit_seq)
        self._send_submit(handle, submit)
        return handle

    def resume(self, handle: RequestHandle, now: float, owner: Owner | None = None) -> bool:
        """Continue a request another link lost: its submit with the output so far (``resume``,
        ``resume_chars``; ``resume_steps`` for vLLM's OpenAI layer), under a new engine id. False if the engine
        is down (the handle is untouched)."""
        if not self.healthy(now):
            return False
        if self.suspended.get(handle.engine_rid, (None,))[0] is handle:  # lost here: the same instance runs it
            return self._resumed(handle.engine_rid)
        rid = f"{handle.request_id}.m{handle.migrations}"
        submit = msgspec.structs.replace(handle.submit, request_id=rid, resume=list(handle.output_ids),
                                         resume_chars=handle.output_chars,
                                         resume_steps=list(handle.steps) if handle.openai else [])
        handle.owner, handle.engine_rid, handle.send_seq = owner or self, rid, self._submit_seq
        self._send_submit(handle, submit)
        return True

    def _resumed(self, rid: str) -> bool:
        """The engine answered for suspended ``rid`` (the same instance runs it): re-attach it if nothing took
        it meanwhile (a continuation elsewhere, a failure, its consumer's close), else abort it."""
        h, owner = self.suspended.pop(rid)
        if h.done or h.closed or h.engine_rid != rid or h.owner is not owner:
            self._abort([rid])
            return False
        self.requests[rid] = h
        h.lost_at = 0.0
        self._events.append(Reattached(h))
        return True

    def _send_submit(self, handle: RequestHandle, submit: p.Submit) -> None:
        self.requests[handle.engine_rid] = handle
        self._out.append(submit)
        self._submit_seq += 1
        self._submitted_since_beat += 1

    def unsent(self, submit: p.Submit) -> RequestHandle | None:
        """The driver could not send ``submit`` (the engine is not connected): it is forgotten, as if never
        submitted. Returns its handle."""
        handle = self.requests.pop(submit.request_id, None)
        if handle is not None:
            if handle.send_seq == self._submit_seq - 1:
                self._submit_seq -= 1
            self._submitted_since_beat = max(0, self._submitted_since_beat - 1)
        return handle

    def close_request(self, handle: RequestHandle) -> None:
        """The consumer is done with ``handle``: forgotten, and aborted in the engine if unfinished."""
        if self.requests.pop(handle.engine_rid, None) is not None and not handle.done:
            self._abort([handle.engine_rid])
        elif self.suspended.get(handle.engine_rid, (None,))[0] is handle:
            del self.suspended[handle.engine_rid]
            self._abort([handle.engine_rid])

    def fail_all(self, err: Failure) -> int:
        """Fail every in-flight request with ``err`` and abort them in the engine; returns how many."""
        handles = list(self.requests.values())
        self._detach(handles, abort=True)
        if self.suspended:  # the pool fails them (they are parked there)
            self._abort(list(self.suspended))
            self.suspended.clear()
        for h in handles:
            h.done = True
            h.fail(err)
        return len(handles)

    def abort_all(self) -> None:
        """Tell the engine to stop every request in flight (the gateway is closing the link)."""
        if self.requests or self.suspended:
            self._abort([*self.requests, *self.suspended])
            self.suspended.clear()

    def _detach(self, handles: list[RequestHandle], abort: bool) -> None:
        """Take requests off this link; ``abort``: tell the engine too (it may still run them)."""
        for h in handles:
            self.requests.pop(h.engine_rid, None)
        if handles and abort:
            self._abort([h.engine_rid for h in handles])

    def _lose(self, handles: list[RequestHandle], err: EngineError, abort: bool) -> None:
        self._detach(handles, abort)
        self._events.append(Lost(handles, err))

    def _abort(self, request_ids: list[str]) -> None:
        self.aborts_sent += len(request_ids)
        self._out.append(p.Abort(request_ids=request_ids))
