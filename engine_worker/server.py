"""The engine server: a ZeroMQ ROUTER that runs a backend and streams deltas back.

One socket (ROUTER, bound). Each gateway connects a DEALER; the ROUTER identity of the
frame that submitted a request is where that request's deltas go, so several gateways
share one engine and each sees only its own requests. Deltas produced in the same event-loop
turn (one engine step) are sent to each gateway as one :class:`DeltaBatch`, encoded once.

The token path is one synchronous pass per engine step: the backend calls each request's
:class:`Emitter` (a :class:`~engine_worker.backends.base.StepSink`) from its own per-step loop, the
emitter appends a :class:`~engine_worker.protocol.Delta` to its gateway's outbox, and the flush loop
sends each outbox as one batch. All deltas of a step share one clock read (``emit_ns``). Figures
(engine CPU per token before and after this shape): docs/vs-vllm.md.

``stream_interval`` N > 1 (like vLLM's ``--stream-interval``) merges the steps of one request into
deltas of at least N tokens; the first and the finishing step are sent at once. A merged delta keeps
the ``emit_ns`` of its oldest text, so delivery latencies measured from it stay honest.

A malformed frame is dropped, logged (rate-limited) and counted; it never stops the loop. A gateway's
requests are aborted when its connection drops, or over ``tcp://`` when it is silent past ``--gateway-grace``
(:class:`GatewayWatch`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine_worker import protocol as p
from engine_worker.backends.base import Backend, RequestRejected, Step
from engine_worker.curve import serve_curve
from engine_worker.ipc import check_tcp_bind, prepare_ipc_dir, secure_ipc_socket
from tokenfan_settings.release import __version__

if TYPE_CHECKING:
    from engine_worker.tracing import EngineTracer

log = logging.getLogger(__name__)

_SRCFD = int(zmq.SRCFD)  # a frame's property: the descriptor of the connection it came in on


@dataclass(slots=True)
class _Request:
    identity: bytes
    task: asyncio.Task[None]
    trace_id: str


@dataclass(slots=True)
class IntervalMerger:
    """Merges one request's steps into deltas of at least ``interval`` tokens (pure).

    :meth:`push` returns the step to send now, or None while text is held back. The first step (the
    time to first token) and a step with a ``finish_reason`` are never held.
    """

    interval: int
    _texts: list[str] = field(default_factory=list)
    _tokens: int = 0
    _sent: bool = False

    _ids: list[int] = field(default_factory=list)

    def push(self, step: Step) -> Step | None:
        if self.interval <= 1 or step.chunk:  # a whole OpenAI chunk is never merged
            return step
        held = self._tokens + step.token_count
        if self._sent and step.finish_reason is None and held < self.interval:
            self._texts.append(step.text)
            self._ids.extend(step.token_ids)
            self._tokens = held
            return None
        self._sent = True
        if self._texts:
            self._texts.append(step.text)
            self._ids.extend(step.token_ids)
            step = Step(text="".join(self._texts), token_count=held, finish_reason=step.finish_reason,
                        token_ids=self._ids or ())
            self._texts = []
            self._ids = []
            self._tokens = 0
        return step


@dataclass(slots=True)
class Emitter:
    """One request's deltas (the backend's :class:`~engine_worker.backends.base.StepSink`): numbers them,
    counts tokens, merges steps for ``--stream-interval`` and queues each delta for its gateway."""

    server: EngineServer
    identity: bytes
    request_id: str
    prompt_tokens: int
    merger: IntervalMerger | None = None  # None: every step is sent (interval 1)
    seq: int = 0
    completion: int = 0
    held_ns: int = 0  # when the oldest text held back by the merger left the backend
    finish_reason: p.FinishReason | None = None

    def __call__(self, text: str, token_count: int, finish_reason: p.FinishReason | None = None,
                 chunk: bytes = b"", token_ids: Sequence[int] = (), steps: p.EngineSteps | None = None
                 ) -> None:
        self.completion += token_count
        if self.merger is not None:
            step = self.merger.push(Step(text=text, token_count=token_count, finish_reason=finish_reason, chunk=chunk,
                                         token_ids=token_ids))
            if step is None:
                self.held_ns = self.held_ns or self.server.step_ns()
                return
            text, token_count, finish_reason, chunk = step.text, step.token_count, step.finish_reason, step.chunk
            token_ids = step.token_ids
        usage = None
        if finish_reason is not None:
            usage = p.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion)
            self.finish_reason = finish_reason
        self.server.queue(self.identity, p.Delta(
            request_id=self.request_id, seq=self.seq, text=text, token_count=token_count,
            emit_ns=self.held_ns or self.server.step_ns(), finish_reason=finish_reason, usage=usage, chunk=chunk,
            token_ids=token_ids if isinstance(token_ids, list) else list(token_ids), steps=steps or []))
        self.held_ns = 0
        self.seq += 1


class GatewayWatch:
    """Which gateways' requests to abort, and why (pure: the time and the socket's events passed in).

    A gateway is known by its ROUTER identity, heard from on one connection (the socket's file descriptor:
    ``zmq.SRCFD`` of its frames, the value of the monitor's ``DISCONNECTED``). The rules:

    * **Its connection dropped**: its requests are aborted ``DROP_CONFIRM`` s later unless it was heard from
      since (a new connection that reused the descriptor). Its process is gone or it reconnected under a new
      identity: nothing can ever read those deltas.
    * **Silent while connected**: over ``ipc://`` the connection is held by a live local process, so silence
      is a stall (the process stopped, descheduled, its event loop busy), never a death: its requests keep
      running. Over ``tcp://`` a connection can stay up to a host that is gone (a partition): silence for
      ``grace`` s aborts them.
    * Time this engine's own loop did not run (:meth:`tick` comes late) is not the gateway's silence.
    """

    DROP_CONFIRM = 1.0

    def __init__(self, grace: float, local: bool) -> None:
        self.grace = grace
        self.local = local  # ipc://: a connection is a live process
        self.last: dict[bytes, float] = {}  # identity -> when last heard from
        self.fd: dict[bytes, int] = {}  # identity -> its connection's descriptor
        self.dropped: dict[bytes, float] = {}  # identity -> when its connection dropped
        self._due = float("inf")

    def heard(self, identity: bytes, fd: int, now: float) -> None:
        self.last[identity] = now
        self.fd[identity] = fd
        self.dropped.pop(identity, None)

    def disconnected(self, fd: int, now: float) -> None:
        for identity, f in self.fd.items():
            if f == fd:
                self.dropped.setdefault(identity, now)

    def tick(self, now: float, interval: float) -> list[tuple[bytes, str]]:
        """Every ``interval`` s: the gateways whose requests to abort now, each with the reason to log."""
        late = max(0.0, now - self._due)
        self._due = now + interval
        if late:  # this loop did not run: nobody was heard in that time
            for identity in self.last:
                self.last[identity] += late
        out = []
        for identity, at in list(self.dropped.items()):
            if now - at >= self.DROP_CONFIRM:
                out.append((identity, "disconnected"))
        for identity, at in self.last.items():
            if identity not in self.dropped and now - at > self.grace and not self.local:
                out.append((identity, f"silent for {self.grace:.0f}s"))
        for identity, _ in out:
            self.forget(identity)
        return out

    def forget(self, identity: bytes) -> None:
        self.last.pop(identity, None)
        self.fd.pop(identity, None)
        self.dropped.pop(identity, None)


@dataclass(slots=True)
class ServerStats:
    bad_frames: int = 0
    submitted: int = 0
    aborted: int = 0
    failed: int = 0


@dataclass
class EngineServer:
    backend: Backend
    address: str
    max_queue: int = 1024
    gateway_grace: float = 10.0  # a tcp:// gateway silent this long (its connection up) is presumed cut off
    allow_remote_tcp: bool = False
    curve_dir: Path | None = None
    stream_interval: int = 1  # tokens per delta, like vLLM's --stream-interval
    tracer: EngineTracer | None = None  # --otlp-traces-endpoint: the engine.accept spans (engine_worker.tracing)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    stats: ServerStats = field(default_factory=ServerStats)

    def __post_init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._requests: dict[str, _Request] = {}
        self._replies: set[asyncio.Task[None]] = set()  # error replies being sent (_reply_error)
        self._outbox: dict[bytes, list[p.Delta]] = {}
        self._outbox_ready = asyncio.Event()
        self._step_ns = 0  # the clock of the deltas queued since the last flush (0: not read yet)
        self._watch = GatewayWatch(self.gateway_grace, local=self.address.startswith("ipc://"))
        self._last_bad_log = 0.0
        self._told: dict[bytes, float] = {}  # gateway identity -> when it was last told our protocol version
        # Preparing (chat template, tokenizer) is synchronous CPU work: one at a time, one per loop turn,
        # so a burst of submits never holds the loop for the whole burst (pings and deltas go between).
        self._prepare_turn = asyncio.Lock()
        self.bound = asyncio.Event()

    async def serve(self, stop: asyncio.Event) -> None:
        """Bind, serve until ``stop`` is set, then abort everything and close."""
        check_tcp_bind(self.address, self.allow_remote_tcp or self.curve_dir is not None)
        prepare_ipc_dir(self.address)
        sock = self._ctx.socket(zmq.ROUTER)
        authenticator = serve_curve(self._ctx, sock, self.curve_dir) if self.curve_dir else None
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # unknown peer: drop, don't raise
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(self.address)
        secure_ipc_socket(self.address)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self.bound.set()
        info = self.backend.info
        log.info("engine %s serving %s model=%s on %s", self.engine_id, info.kind, info.model, self.address)
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._flush_loop()),
                 asyncio.create_task(self._reap_loop()), asyncio.create_task(self._watch_links(monitor))]
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            for req in list(self._requests.values()):
                req.task.cancel()
            await asyncio.gather(*tasks, *(r.task for r in self._requests.values()), return_exceptions=True)
            await self._finish_replies()
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            self._ctx.term()
            log.info("engine %s stopped", self.engine_id)

    # -- receiving -------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        watch = self._watch
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            identity, body = frames[0].bytes, [f.bytes for f in frames[1:]]
            watch.heard(identity, cast(int, frames[-1].get(_SRCFD)), time.monotonic())
            try:
                msg = p.decode(body)
            except p.VersionMismatch as exc:
                self._bad_frame(identity, str(exc))
                self._tell_other_version(identity)
                continue
            except p.WireError as exc:
                self._bad_frame(identity, str(exc))
                continue
            try:
                await self._on_message(identity, msg)
            except Exception:  # one message must never end the loop (the engine would go deaf)
                log.exception("dropped a %s from %s that failed", type(msg).__name__, identity.hex())
                self._bad_frame(identity, f"{type(msg).__name__} failed")

    async def _on_message(self, identity: bytes, msg: p.Message) -> None:
        if isinstance(msg, p.Submit):
            self._on_submit(identity, msg)
        elif isinstance(msg, p.Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, p.Ping):
            await self._send(identity, self._heartbeat(msg.sent_ns))
        else:
            self._bad_frame(identity, f"unexpected {type(msg).__name__} from a gateway")

    def _bad_frame(self, identity: bytes, reason: str) -> None:
        self.stats.bad_frames += 1
        now = time.monotonic()
        if now - self._last_bad_log > 1.0:  # rate-limit: a flood of junk must not flood the log
            self._last_bad_log = now
            log.warning("dropped bad frame from %s: %s (total %d)", identity.hex(), reason, self.stats.bad_frames)

    def _tell_other_version(self, identity: bytes) -> None:
        """A gateway of another protocol version gets, at most once a second, an error frame of this one: it
        cannot read it, but its log then names both versions (:class:`engine_worker.protocol.VersionMismatch`)
        instead of waiting for a heartbeat that never comes."""
        now = time.monotonic()
        if now - self._told.get(identity, 0.0) >= 1.0:
            self._told[identity] = now
            self._reply_error(identity, "", "version_mismatch", f"this engine speaks {p.MAGIC.decode()}")

    def _heartbeat(self, ping_sent_ns: int) -> p.Heartbeat:
        running, waiting = self.backend.load()
        # Requests this server holds that the backend has not started yet count as waiting.
        waiting = max(waiting, len(self._requests) - running)
        info = self.backend.info
        return p.Heartbeat(
            engine_id=self.engine_id, backend=info.kind, model=info.model, max_model_len=info.max_model_len,
            running=running, waiting=waiting, ping_sent_ns=ping_sent_ns, sent_ns=p.now_ns(),
            bad_frames=self.stats.bad_frames, version=__version__,
        )

    def _on_submit(self, identity: bytes, msg: p.Submit) -> None:
        if msg.request_id in self._requests:
            self._reply_error(identity, msg.request_id, "invalid_request", f"duplicate request id {msg.request_id}")
            return
        if len(self._requests) >= self.max_queue:
            self._reply_error(identity, msg.request_id, "engine_overloaded",
                              f"engine has {len(self._requests)} requests in flight (limit {self.max_queue})")
            return
        self.stats.submitted += 1
        task = asyncio.create_task(self._run(identity, msg), name=f"req-{msg.request_id}")
        self._requests[msg.request_id] = _Request(identity=identity, task=task, trace_id=msg.trace_id)
        # An abort read in the same burst cancels the task before it runs: its coroutine never starts, so
        # _run's own cleanup never runs either. The entry must still go (it counts against --max-queue).
        task.add_done_callback(functools.partial(self._forget, msg.request_id))

    def _forget(self, rid: str, task: asyncio.Task[None]) -> None:
        req = self._requests.get(rid)
        if req is not None and req.task is task:
            del self._requests[rid]

    def _on_abort(self, identity: bytes, msg: p.Abort) -> None:
        for rid in msg.request_ids:
            req = self._requests.get(rid)
            if req is not None and req.identity == identity:
                self.stats.aborted += 1
                log.info("abort %s trace=%s", rid, req.trace_id)
                req.task.cancel()

    # -- generating ------------------------------------------------------------------------

    async def _run(self, identity: bytes, submit: p.Submit) -> None:
        rid = submit.request_id
        received_ns = time.time_ns()
        try:
            try:
                async with self._prepare_turn:
                    prepared = await self.backend.prepare(submit)
                    await asyncio.sleep(0)  # keep the turn until the loop has polled its sockets once
            except RequestRejected as exc:
                self._reply_error(identity, rid, exc.code, exc.message, exc.param, exc.status, exc.type)
                return
            await self._send(identity, p.Accepted(request_id=rid, prompt_tokens=prepared.prompt_tokens,
                                                  openai=prepared.openai))
            if self.tracer is not None:
                self.tracer.accepted(submit, received_ns, prepared.prompt_tokens, self.engine_id)
            # a continuation reports usage as one request: the output it resumes from counts
            resumed = sum(len(out) - 2 for step in submit.resume_steps for out in step) if prepared.openai \
                else len(submit.resume)
            if submit.resume or submit.resume_steps:
                log.info("accepted %s trace=%s prompt_tokens=%d: a continuation after %d output tokens", rid,
                         submit.trace_id, prepared.prompt_tokens, resumed)
            else:
                log.info("accepted %s trace=%s prompt_tokens=%d", rid, submit.trace_id, prepared.prompt_tokens)
            emitter = Emitter(self, identity, rid, prepared.prompt_tokens,
                              IntervalMerger(self.stream_interval) if self.stream_interval > 1 else None,
                              completion=resumed)
            await self.backend.stream(prepared, emitter)
            if emitter.finish_reason is None:  # the backend ended without a last step: stopped from outside
                emitter("", 0, "abort")
            log.info("finished %s trace=%s reason=%s completion_tokens=%d", rid, submit.trace_id,
                     emitter.finish_reason, emitter.completion)
        except asyncio.CancelledError:
            await self.backend.abort(rid)
            raise
        except RequestRejected as exc:  # vLLM's OpenAI layer failed the request mid-stream
            self.stats.failed += 1
            self._reply_error(identity, rid, exc.code, exc.message, exc.param, exc.status, exc.type)
        except Exception as exc:  # a backend bug or engine failure: tell the gateway, keep serving
            self.stats.failed += 1
            log.exception("request %s failed trace=%s", rid, submit.trace_id)
            self._reply_error(identity, rid, "engine_error", f"engine error: {type(exc).__name__}: {exc}")
        finally:
            self._requests.pop(rid, None)

    def _reply_error(self, identity: bytes, rid: str, code: str, message: str, param: str | None = None,
                     status: int = 0, type: str = "") -> None:
        task = asyncio.create_task(self._send(identity, p.Error(request_id=rid, code=code, message=message,
                                                                param=param, status=status, error_type=type)))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def _finish_replies(self) -> None:
        """On the way out: the error replies already decided still reach their gateway (a send never blocks:
        no high-water mark), unless the socket does not take them within a second."""
        if not self._replies:
            return
        _, late = await asyncio.wait(set(self._replies), timeout=1.0)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    # -- sending ---------------------------------------------------------------------------

    def step_ns(self) -> int:
        """The emit time of every delta of this step: one clock read per step, not per delta."""
        if not self._step_ns:
            self._step_ns = p.now_ns()
        return self._step_ns

    def queue(self, identity: bytes, delta: p.Delta) -> None:
        box = self._outbox.get(identity)
        if box is None:
            self._outbox[identity] = [delta]
            self._outbox_ready.set()
        else:
            box.append(delta)

    async def _flush_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            # One more turn lets every generator woken by the same engine step append first.
            await asyncio.sleep(0)
            self._outbox_ready.clear()
            outbox, self._outbox = self._outbox, {}
            self._step_ns = 0
            for identity, deltas in outbox.items():
                await self._send(identity, p.DeltaBatch(deltas=deltas))

    async def _send(self, identity: bytes, msg: p.Message) -> None:
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, *p.encode(msg)], copy=False)
        except zmq.ZMQError as exc:
            log.warning("send to %s failed: %s", identity.hex(), exc)

    async def _watch_links(self, monitor: zmq.asyncio.Socket) -> None:
        """The socket's monitor: a gateway's connection that dropped (:class:`GatewayWatch`)."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._watch.disconnected(int(event["value"]), time.monotonic())

    async def _reap_loop(self) -> None:
        """Abort the requests of gateways that are gone (their connection dropped) or, over ``tcp://``,
        silent past the grace (:class:`GatewayWatch`)."""
        interval = min(self.gateway_grace / 4, GatewayWatch.DROP_CONFIRM / 2)
        while True:
            await asyncio.sleep(interval)
            for identity, why in self._watch.tick(time.monotonic(), interval):
                orphans = [rid for rid, r in self._requests.items() if r.identity == identity]
                if orphans:
                    log.warning("gateway %s %s: aborting %d requests", identity.hex(), why, len(orphans))
                    self._on_abort(identity, p.Abort(request_ids=orphans))
