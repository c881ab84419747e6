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
  engine request and the token ids on a sibling; the sibling that claims it (an ``O_EXCL`` file in the
  runtime directory, :meth:`Peers.claim`) continues it as a ``--broker`` replica would
  (:mod:`gateway.api.adoption`), and serves it to the others from then on.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h11
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core import sse
from gateway.core.streams import StreamHub
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
    from gateway.core.streams import Event, Stream

log = logging.getLogger(__name__)

SUMMED_GAUGES = {"tokenfan_active_streams", "tokenfan_subscribers", "tokenfan_retained_stream_bytes",
                 "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_open_fds"}


class PeerResponse:
    """A peer's answer: its status, then its body as it comes (h11 reads the framing)."""

    def __init__(self, status: int, conn: h11.Connection, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.status, self._conn, self._reader, self._writer = status, conn, reader, writer

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


async def request(path: Path, method: str, target: str) -> PeerResponse:
    """Send one request to the worker listening on ``path``; OSError if it is not there or answers garbage."""
    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
    conn = h11.Connection(h11.CLIENT)
    try:
        writer.write(conn.send(h11.Request(method=method, target=target,
                                           headers=[("Host", "peer"), ("Connection", "close")])))
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


def _owner(owner: str) -> tuple[int | None, int | None]:
    """(index, pid) of an owner name; pid None for an index alone."""
    index, _, pid = owner.partition(".")
    if not index.isdigit():
        return None, None
    return int(index), int(pid) if pid.isdigit() else None


class PeerLink:
    """The mirror's link to the other workers (:class:`gateway.scaleout.mirror.Link`); ``poll``: how long a quiet
    connection waits before the mirror may look at its idle clock."""

    def __init__(self, peers: dict[int, Path], poll: float) -> None:
        self.peers, self.poll = peers, poll

    async def open(self, stream_id: str) -> Opened:
        """The stream from the peer that owns it. A peer that only mirrors it (409) may be about to adopt
        it: asked again for up to :data:`CATCH_UP_S` before the answer is 404."""
        deadline = time.monotonic() + CATCH_UP_S
        while True:
            gone = mirrored = False
            for k, path in self.peers.items():
                try:
                    resp = await request(path, "GET", f"/internal/streams/{stream_id}?after=-1")
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
        Ends (without the end) if the owner is alive and no longer has the stream."""
        last, owner = -1, ""
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
                            yield item
                    resp.close()
                resp = None
                for j in (k, *(j for j in self.peers if j != k)):
                    with contextlib.suppress(OSError):
                        answer = await request(self.peers[j], "GET", f"/internal/streams/{stream_id}?after={last}")
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
    mirror asks its owner's lease after ``recheck`` s (a local socket: cheap)."""

    def __init__(self, hub: StreamHub, *, port: int, workers: int, me: int, idle_timeout: float,
                 recheck: float) -> None:
        self.hub, self.port, self.me = hub, port, me
        self.paths = {k: worker_socket(port, k) for k in range(workers) if k != me}
        self.mirrors = MirrorSet(hub, PeerLink(self.paths, poll=recheck), idle_timeout=idle_timeout, recheck=recheck,
                                 lease_check=recheck)
        self._standby_tasks: set[asyncio.Task[None]] = set()
        self._kept: dict[str, tuple[bytes, float]] = {}  # put_transcript: key -> (value, monotonic expiry)

    # -- Publisher: a standby mirror of each listed stream on the next worker ----------------------------

    durable = False  # a worker's socket is local: no partition between it and its standby to fence

    def serving(self) -> bool:
        return True

    async def created(self, stream: Stream) -> None:
        if not self.paths:
            return
        task = asyncio.get_running_loop().create_task(self._standby(stream.id), name=f"standby-{stream.id}")
        self._standby_tasks.add(task)
        task.add_done_callback(self._standby_tasks.discard)

    async def _standby(self, stream_id: str) -> None:
        nxt = min((k for k in self.paths if k > self.me), default=min(self.paths))
        try:
            async with asyncio.timeout(CATCH_UP_S):
                resp = await request(self.paths[nxt], "POST", f"/internal/standby/{stream_id}")
                await resp.body()
            if resp.status != 200:
                raise OSError(f"status {resp.status}")
        except (OSError, TimeoutError) as exc:
            log.warning("stream %s has no standby on worker %d (%s): it cannot be adopted if this worker dies",
                        stream_id, nxt, exc or type(exc).__name__)

    def published(self, stream: Stream, event: Event) -> None:
        pass  # the standby reads the log over this worker's socket

    def ended(self, stream: Stream) -> None:
        pass

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
        """True for exactly one worker: the one that creates the stream's adoption file for that owner."""
        path = worker_socket(self.port, 0).parent / f"adopt-{self.port}-{stream.id}-{header.owner}"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        asyncio.get_running_loop().call_later(600, lambda: path.unlink(missing_ok=True))
        return True

    def adopted(self, stream: Stream) -> None:
        pass  # it is served from this worker's socket now (its header names this worker)

    async def close(self) -> None:
        await stop_tasks(self._standby_tasks)
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
