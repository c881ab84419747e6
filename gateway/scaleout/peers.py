"""``--workers``: a worker's side of its peers (the other workers of one server), over their private sockets.

- :class:`PeerLink` is the mirror's :class:`~gateway.scaleout.mirror.Link` to a peer: ``GET /internal/streams/{id}``
  on the owner's socket is a reader of the owner's log like any other, never merged, that sends
  :mod:`gateway.scaleout.broker_codec` records as SSE events (``id`` = seq; :class:`gateway.scaleout.workers.PeerFraming`),
  read with the shared :class:`gateway.core.sse.SseDecoder`. Cut or dropped, it is resumed with ``?after=``;
  a peer whose socket refuses is gone: the link looks for the stream on the other peers (the one that
  adopted it) while the mirror asks the owner's lease (:meth:`PeerLink.lease`: its socket answers with the
  pid that wrote the header) and offers the stream for adoption once it is missing.
- Adoption without ``--broker``: every listed stream a worker creates gets a *standby* mirror on the next
  worker (``POST /internal/standby/{id}``, :meth:`Peers.created`), so a worker's death leaves its log, the
  engine request and the token ids on a sibling. The stream is *gated* by it: its events reach readers once the
  standby acknowledged them (:meth:`Peers.acked`). The standby claims it (an ``O_EXCL`` file in the runtime
  directory, :meth:`Peers.claim`), continues it as a ``--broker`` replica would (:mod:`gateway.api.adoption`),
  and serves it to the others from then on.
- :class:`Peers` is what the routes use (:class:`gateway.core.ports.RemoteStreams`): mirrors, cancels
  (``DELETE /internal/streams/{id}``) and transcripts (``GET /internal/transcripts/{id}``) of the peers'
  streams, and ``/metrics`` merged over every worker (:func:`merge_metrics`).
- HTTP/1.1 to a peer is ``h11``'s (:func:`request`): one request per connection, the body as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h11
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core import sse
from gateway.core.streams import Stream, StreamHub
from gateway.errors import stream_expired, stream_lost, stream_not_found
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.mirror import (
    CATCH_UP_S,
    Item,
    Lease,
    MirrorSet,
    Opened,
    Quiet,
    RemoteStreamsByMirror,
    stop_tasks,
)
from gateway.scaleout.workers import worker_socket

if TYPE_CHECKING:
    from gateway.core.streams import Event

log = logging.getLogger(__name__)

SUMMED_GAUGES = {"tokenfan_active_streams", "tokenfan_subscribers", "tokenfan_retained_stream_bytes",
                 "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_open_fds"}


class PeerResponse:
    """A peer's answer: its status, then its body as it comes (h11 reads the framing). A request sent with an
    open body (:func:`request`'s ``body``) writes its lines meanwhile (:meth:`ack`)."""

    def __init__(self, status: int, conn: h11.Connection, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.status, self._conn, self._reader, self._writer = status, conn, reader, writer
        self.acked = 0

    def ack(self, held: int) -> None:
        """Tell the owner this worker's mirror holds ``held`` records of the stream (its events, and one more
        for its end): one line of the request's body, written only when it grew (nothing without a body)."""
        if held <= self.acked or self._conn.our_state is not h11.SEND_BODY or self._writer.is_closing():
            return
        self.acked = held
        self._writer.write(self._conn.send(h11.Data(data=b"%d\n" % held)))

    async def chunks(self, idle: float | None = None) -> AsyncGenerator[bytes | None, None]:
        """The body's bytes until it ends or the connection drops; None each time nothing came for ``idle`` s."""
        while True:
            try:
                ev = self._conn.next_event()
            except h11.RemoteProtocolError:
                return  # the connection dropped inside the body
            if ev is h11.NEED_DATA:
                try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands as data does
                    async with asyncio.timeout(idle):
                        data = await self._reader.read(1 << 16)
                except TimeoutError:
                    yield None
                    continue
                except ConnectionResetError:
                    # a peer killed with a standby's acknowledgements unread resets the connection: it dropped
                    # (what this side read and did not acknowledge yet, no reader has seen)
                    return
                self._conn.receive_data(data)
            elif isinstance(ev, h11.Data):
                yield bytes(ev.data)
            else:  # EndOfMessage, ConnectionClosed
                return

    async def body(self) -> bytes:
        try:
            return b"".join([c async for c in self.chunks() if c])
        finally:
            self.close()

    def close(self) -> None:
        self._writer.close()


async def request(path: Path, method: str, target: str, *, body: bool = False) -> PeerResponse:
    """Send one request to the worker listening on ``path``; OSError if it is not there or answers garbage.
    ``body``: its body stays open (chunked) for :meth:`PeerResponse.ack` while the answer streams."""
    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
    conn = h11.Connection(h11.CLIENT)
    headers = [("Host", "peer"), ("Connection", "close")]
    try:
        writer.write(conn.send(h11.Request(method=method, target=target,
                                           headers=[*headers, ("Transfer-Encoding", "chunked")] if body else headers)))
        if not body:
            writer.write(conn.send(h11.EndOfMessage()))
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(await reader.read(1 << 16))
            elif isinstance(ev, h11.Response):
                return PeerResponse(ev.status_code, conn, reader, writer)
            elif not isinstance(ev, h11.InformationalResponse):
                raise OSError(f"peer worker at {path} closed without an answer")
    except h11.ProtocolError as exc:
        writer.close()
        raise OSError(f"peer worker at {path}: {exc}") from exc
    except BaseException:
        writer.close()
        raise


def owner_name(index: int) -> str:
    """A worker's name in the headers it writes: its index and pid (a restarted worker is another owner)."""
    return f"{index}.{os.getpid()}"


def standby_of(index: int, workers: int) -> int:
    """The worker that keeps the standby of worker ``index``'s listed streams: the next one."""
    return (index + 1) % workers


def _owner(owner: str) -> tuple[int | None, int | None]:
    """(index, pid) of an owner name; pid None for an index alone."""
    index, _, pid = owner.partition(".")
    if not index.isdigit():
        return None, None
    return int(index), int(pid) if pid.isdigit() else None


RELEASED = b"released"  # the adoption claim its owner takes when it gives a stream's standby up


@dataclass(eq=False, slots=True)
class Gate:
    """The owner's hold on a gated stream (:class:`Peers`): ``held``, the records its standby acknowledged;
    ``since``, when the oldest record it has not acknowledged was published (None: it holds everything);
    ``relays``, its standby relays open now; ``settled``, set at every acknowledgement and when it is given up."""

    stream: Stream
    since: float | None
    held: int = 0
    relays: int = 0
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class PeerLink:
    """The mirror's link to the other workers (:class:`gateway.scaleout.mirror.Link`); ``poll``: how long a quiet
    connection waits before the mirror may look at its idle clock. ``me``: this worker's index; from the worker
    whose standby it is (:func:`standby_of`) it reads as the standby: ``POST``, the pending events too, each
    read acknowledged on the request's body (see :class:`Peers`)."""

    def __init__(self, peers: dict[int, Path], poll: float, me: int | None = None) -> None:
        self.peers, self.poll, self.me = peers, poll, me

    async def _ask(self, k: int, stream_id: str, after: int) -> PeerResponse:
        """The stream's log after ``after`` from worker ``k`` (as its standby, if this worker is)."""
        standby = self.me is not None and standby_of(k, len(self.peers) + 1) == self.me
        return await request(self.peers[k], "POST" if standby else "GET",
                             f"/internal/streams/{stream_id}?after={after}", body=standby)

    async def open(self, stream_id: str) -> Opened:
        """The stream from the peer that owns it. A peer that only mirrors it (409) may be about to adopt
        it: asked again for up to :data:`CATCH_UP_S` before the answer is 404."""
        deadline = time.monotonic() + CATCH_UP_S
        while True:
            gone = mirrored = False
            for k in self.peers:
                try:
                    resp = await self._ask(k, stream_id, -1)
                except OSError:
                    continue  # that worker is not up
                if resp.status != 200:
                    gone |= resp.status == 410
                    mirrored |= resp.status == 409
                    resp.close()
                    continue
                records = self._records(stream_id, k, resp)
                with contextlib.suppress(codec.CodecError):
                    async for item in records:
                        if isinstance(item, Quiet):
                            continue
                        if isinstance(item, codec.Header):
                            return Opened(item, records)
                        break
                await records.aclose()
                raise stream_lost(stream_id, f"worker {k} sent no header", status=410)
            if not mirrored or time.monotonic() >= deadline:
                raise stream_expired(stream_id) if gone else stream_not_found(stream_id)
            await asyncio.sleep(self.poll)

    async def _records(self, stream_id: str, k: int, resp: PeerResponse | None) -> AsyncGenerator[Item, None]:
        """The owner's records; a connection that ends without the end is resumed after the last event got,
        on the owner or, once it no longer serves the stream (gone, restarted), on whichever peer does (the
        one that adopted it: its header comes first). Meanwhile :class:`Quiet`, so the mirror asks the lease.
        Ends (without the end) if the owner is alive and no longer has the stream.

        What the mirror holds is acknowledged once per read (:meth:`PeerResponse.ack`): the records of a read
        are applied when the mirror asks for the next one; the end, when the mirror closes this generator after
        applying it."""
        last, owner, ended = -1, "", False
        try:
            while True:
                if resp is not None:
                    decoder = sse.SseDecoder()
                    async for data in resp.chunks(self.poll):
                        if data is None:
                            yield Quiet()
                            continue
                        for ev in decoder.feed(data):
                            if ev.id is not None:
                                last = int(ev.id)
                            item = codec.decode_line(ev.data)
                            if isinstance(item, codec.Header):
                                owner = item.owner
                            elif isinstance(item, codec.EndEntry):
                                ended = codec.end_is_complete(item, last + 1)
                            yield item
                        resp.ack(last + 1)
                    resp.close()
                resp = None
                for j in (k, *(j for j in self.peers if j != k)):
                    with contextlib.suppress(OSError):
                        answer = await self._ask(j, stream_id, last)
                        if answer.status == 200:
                            resp, k = answer, j
                            break
                        answer.close()
                if resp is None:
                    if (await self.lease(owner)).state == "held":
                        return  # its owner lives and dropped it: nothing will come
                    yield Quiet()
                    await asyncio.sleep(self.poll)
        finally:
            if resp is not None:
                if ended:
                    resp.ack(last + 2)
                resp.close()

    async def lease(self, owner: str) -> Lease:
        """A worker holds its streams while its private socket answers with the pid in its name."""
        index, pid = _owner(owner)
        path = self.peers.get(index) if index is not None else None
        if path is None:
            return Lease("missing")
        try:
            async with asyncio.timeout(self.poll * 4):
                resp = await request(path, "GET", "/internal/ready")
                body = orjson.loads(await resp.body()) if resp.status == 200 else {}
        except TimeoutError:  # (before OSError, of which it is a subclass)
            return Lease("unknown")  # alive but busy: asked again
        except OSError:
            return Lease("missing", certain=True)  # nobody listens on its socket: that process is gone
        except ValueError:
            return Lease("missing")
        if pid is None or body.get("pid") == pid:
            return Lease("held")
        return Lease("missing", certain=True)  # another process (restarted) serves that index

    async def cancel(self, stream_id: str, owner: str) -> bool:
        index, _ = _owner(owner)
        path = self.peers.get(index) if index is not None else None
        if path is None:
            return False
        try:
            resp = await request(path, "DELETE", f"/internal/streams/{stream_id}")
            body = await resp.body()
        except OSError:
            return False
        return resp.status == 200 and bool(orjson.loads(body).get("cancelled"))


class Peers(RemoteStreamsByMirror):
    """The other workers of this server: their streams (:class:`gateway.core.ports.RemoteStreams`) and metrics;
    without ``--broker`` also the publisher of this worker's listed streams (:class:`gateway.core.ports.Publisher`:
    a standby mirror on the next worker) and the claims of adoption among them.

    ``idle_timeout`` / ``recheck``: the mirrors' idle clock (:class:`gateway.scaleout.mirror.Idle`); a quiet
    mirror asks its owner's lease after ``recheck`` s (a local socket: cheap).

    The gate, as ``--broker``'s (:attr:`gateway.core.streams.Stream.gated`): a listed stream's events reach this
    worker's readers, and the other workers' mirrors, only once its standby acknowledged them (:meth:`acked`,
    one line per read of the standby's relay), so a reader never saw an event the standby lacks and the standby
    adopts from a log at least as long as any reader's. A standby that confirms nothing new for
    ``standby_timeout`` s, or whose relay closes, is given up (:meth:`release`): the events are released and the
    stream can no longer be adopted (the claim of its adoption is taken in its owner's name)."""

    def __init__(self, hub: StreamHub, *, port: int, workers: int, me: int, idle_timeout: float,
                 recheck: float, standby_timeout: float = 2.0) -> None:
        self.hub, self.port, self.me, self.workers = hub, port, me, workers
        self.standby_timeout = standby_timeout
        self.paths = {k: worker_socket(port, k) for k in range(workers) if k != me}
        self.mirrors = MirrorSet(hub, PeerLink(self.paths, poll=recheck, me=me), idle_timeout=idle_timeout,
                                 recheck=recheck, lease_check=recheck)
        self._standby_tasks: set[asyncio.Task[None]] = set()
        self._kept: dict[str, tuple[bytes, float]] = {}  # put_transcript: key -> (value, monotonic expiry)
        self._gates: dict[str, Gate] = {}  # this worker's gated streams, by id
        self._holding: asyncio.Task[None] | None = None  # gives up standbys that confirm nothing (_hold)
        self._asked: dict[str, float] = {}  # refusal: when a mirror that is not the standby first asked

    # -- Publisher: a standby mirror of each listed stream on the next worker, and the gate ----------------

    durable = True  # gated: a reader sees an event once the standby holds it

    def serving(self) -> bool:
        return True

    async def created(self, stream: Stream) -> None:
        """The standby of a new stream is up (its relay open) before the stream's id is handed out, or given
        up: at most ``standby_timeout`` (or :data:`CATCH_UP_S`) s, never an error."""
        self._gate(stream)
        await self._standby(stream)

    def _gate(self, stream: Stream) -> None:
        stream.gated = True
        self._gates[stream.id] = Gate(stream, None)  # (the clock starts at its first record: _unconfirmed)
        if self._holding is None or self._holding.done():
            self._holding = asyncio.get_running_loop().create_task(self._hold(), name="standby-hold")

    async def _standby(self, stream: Stream) -> None:
        nxt = standby_of(self.me, self.workers)
        try:
            async with asyncio.timeout(min(CATCH_UP_S, self.standby_timeout or CATCH_UP_S)):
                resp = await request(self.paths[nxt], "POST", f"/internal/standby/{stream.id}")
                await resp.body()
            if resp.status != 200:
                raise OSError(f"status {resp.status}")
        except (OSError, TimeoutError) as exc:
            self.release(stream, f"no standby on worker {nxt} ({exc or type(exc).__name__})")

    def published(self, stream: Stream, event: Event) -> None:
        self._unconfirmed(stream)  # the standby relay has it at once (Stream.append); the gate waits for its ack

    def ended(self, stream: Stream) -> None:
        self._unconfirmed(stream)  # its end waits for the standby too

    def _unconfirmed(self, stream: Stream) -> None:
        """``stream`` has a record its standby has not acknowledged: the hold's clock starts (if not running)."""
        gate = self._gates.get(stream.id)
        if gate is not None and gate.since is None:
            gate.since = time.monotonic()

    def acked(self, stream: Stream, held: int) -> None:
        """The standby holds ``held`` records of ``stream`` (its events, then one more for its end): what it
        holds reaches the readers (:meth:`Stream.commit`)."""
        gate = self._gates.get(stream.id)
        if gate is None or held <= gate.held:
            return
        gate.held = held
        stream.commit(held, sealed=held > stream.next_seq)
        gate.since = time.monotonic() if stream.pending or (stream.finished and not stream.sealed) else None
        if stream.sealed:
            del self._gates[stream.id]
        gate.settled.set()

    def relay(self, stream: Stream, opened: bool) -> Gate | None:
        """A standby relay of ``stream`` opened or closed; its gate (None: not gated, or no longer). The last
        one to close before the stream's end is sealed gives the standby up (a restarted worker has no mirror)."""
        gate = self._gates.get(stream.id)
        if gate is None:
            return None
        gate.relays += 1 if opened else -1
        if not opened and gate.relays == 0:
            self.release(stream, "its standby's relay closed")
        return gate

    def release(self, stream: Stream, why: str) -> None:
        """Give the standby of ``stream`` up: nobody may adopt it (its owner takes the adoption claim), then
        what it holds back reaches the readers and the rest goes to them ungated."""
        gate = self._gates.pop(stream.id, None)
        if not stream.gated:
            return
        log.warning("stream %s: %s; its events reach readers without a standby, it cannot be adopted if this "
                    "worker dies", stream.id, why)
        with contextlib.suppress(OSError):
            self._claim_file(stream.id, owner_name(self.me), RELEASED)
        stream.gated = False
        stream.commit(stream.next_seq, sealed=True)
        if gate is not None:
            gate.settled.set()

    async def _hold(self) -> None:
        """Every quarter of ``standby_timeout``: give up the standbys that confirmed nothing new for that long."""
        tick = max(0.01, self.standby_timeout / 4)
        while self._gates:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for gate in [g for g in self._gates.values() if g.since is not None]:
                assert gate.since is not None
                if now - gate.since > self.standby_timeout:
                    self.release(gate.stream, f"its standby confirmed nothing for {self.standby_timeout:g}s")

    async def successor(self) -> bool:
        return False  # a server's workers stop together: each drains its own streams

    async def hand_over(self) -> None:
        pass

    def put_transcript(self, response_id: str, data: bytes, ttl: float) -> None:
        """Kept here for ``ttl`` s, unless it belongs to a stream the hub retains (a stored response's
        transcript is served from there); peers ask for it over this worker's socket (:meth:`kept`)."""
        if response_id in self.hub.streams:
            return
        now = time.monotonic()
        for key in [k for k, (_, until) in self._kept.items() if until <= now]:
            del self._kept[key]
        self._kept[response_id] = (data, now + ttl)

    def kept(self, key: str) -> bytes | None:
        """What :meth:`put_transcript` keeps under ``key`` (an empty value counts as none), if not expired."""
        data, until = self._kept.get(key, (b"", 0.0))
        return data if data and until > time.monotonic() else None

    # -- adoption among the workers ---------------------------------------------------------------------

    async def claim(self, stream: Stream, header: codec.Header) -> bool:
        """True for exactly one worker: the owner's standby (:func:`standby_of`; another mirror may hold less
        than a reader saw), if it creates the stream's adoption file for that owner."""
        index, _ = _owner(header.owner)
        if index is None or standby_of(index, self.workers) != self.me:
            return False
        try:
            self._claim_file(stream.id, header.owner, owner_name(self.me).encode())
        except FileExistsError:
            return False
        return True

    def _claim_file(self, stream_id: str, owner: str, content: bytes) -> None:
        """Create the adoption claim of ``owner``'s ``stream_id`` (FileExistsError: it is taken); removed later."""
        path = self._claim_path(stream_id, owner)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        asyncio.get_running_loop().call_later(600, lambda: path.unlink(missing_ok=True))

    def _claim_path(self, stream_id: str, owner: str) -> Path:
        return worker_socket(self.port, 0).parent / f"adopt-{self.port}-{stream_id}-{owner}"

    def refusal(self, stream: Stream, header: codec.Header) -> str | None:
        """Why nobody can adopt ``stream`` of the lost ``header.owner`` (None: its standby may): its owner gave
        its standby up, or (asked on another worker) the standby has not adopted it within twice
        :data:`CATCH_UP_S` of the first question here."""
        try:
            if self._claim_path(stream.id, header.owner).read_bytes() == RELEASED:
                return "its owner had given its standby up"
        except OSError:
            pass
        index, _ = _owner(header.owner)
        if index is None or standby_of(index, self.workers) == self.me:
            return None
        now = time.monotonic()
        if now - self._asked.setdefault(stream.id, now) > 2 * CATCH_UP_S:
            return f"its standby (worker {standby_of(index, self.workers)}) did not adopt it"
        return None

    def adopted(self, stream: Stream) -> None:
        """This worker continues ``stream``: gated from now on, with a standby on the next worker (it is served
        from this worker's socket now: its header names this worker)."""
        self._gate(stream)
        task = asyncio.get_running_loop().create_task(self._standby(stream), name=f"standby-{stream.id}")
        self._standby_tasks.add(task)
        task.add_done_callback(self._standby_tasks.discard)

    async def close(self) -> None:
        tasks = self._standby_tasks | ({self._holding} if self._holding is not None else set())
        await stop_tasks(tasks)
        await self.mirrors.close()

    async def transcript(self, response_id: str) -> bytes | None:
        """The transcript of a response a peer retains (msgpack), or None."""
        bodies = await self._ask_all(f"/internal/transcripts/{response_id}")
        return bodies[0] if bodies else None

    async def merged_metrics(self, own: bytes) -> bytes:
        """This worker's metrics merged with every reachable peer's."""
        return merge_metrics([own.decode(), *(b.decode() for b in await self._ask_all("/internal/metrics"))])

    async def _ask_all(self, target: str) -> list[bytes]:
        """The bodies of the peers that answer ``GET target`` with 200, in worker order."""
        bodies = []
        for path in self.paths.values():
            with contextlib.suppress(OSError):
                resp = await request(path, "GET", target)
                body = await resp.body()
                if resp.status == 200:
                    bodies.append(body)
        return bodies


async def peers_ready(port: int, workers: int, me: int, timeout: float = 1.0) -> tuple[int, int]:
    """(peers that listen on the shared port, those of them that can serve). A peer whose private socket
    refuses (not started, or gone) listens on nothing and is left out; one that does not answer within
    ``timeout`` counts as listening and not ready."""
    async def one(k: int) -> tuple[bool, bool]:
        try:
            async with asyncio.timeout(timeout):
                resp = await request(worker_socket(port, k), "GET", "/internal/ready")
                body = orjson.loads(await resp.body()) if resp.status == 200 else {}
        except TimeoutError:
            return True, False
        except (OSError, ValueError):
            return False, False
        return bool(body.get("listening")), bool(body.get("listening") and body.get("ready"))

    answers = await asyncio.gather(*(one(k) for k in range(workers) if k != me))
    return sum(a for a, _ in answers), sum(r for _, r in answers)


def merge_metrics(texts: list[str]) -> bytes:
    """Prometheus text expositions of several workers -> one: counters and histograms summed, load
    gauges (:data:`SUMMED_GAUGES`) summed, other gauges their maximum; ``tokenfan_workers`` added."""
    families: dict[str, Any] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, fam)
            acc = values.setdefault(fam.name, {})
            summed = fam.type != "gauge" or fam.name in SUMMED_GAUGES
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in acc:
                    acc[key] = s.value
                else:
                    acc[key] = acc[key] + s.value if summed else max(acc[key], s.value)

    class Merged:
        def collect(self) -> Any:
            from prometheus_client.core import Metric

            for name, fam in families.items():
                m = Metric(name, fam.documentation, fam.type, fam.unit)
                for (sample_name, labels), value in values[name].items():
                    m.add_sample(sample_name, dict(labels), value)
                yield m
            w = Metric("tokenfan_workers", "Gateway worker processes whose metrics are in this scrape", "gauge")
            w.add_sample("tokenfan_workers", {}, float(len(texts)))
            yield w

    registry = CollectorRegistry()
    registry.register(Merged())  # type: ignore[arg-type]
    return generate_latest(registry)
