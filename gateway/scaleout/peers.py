"""``--workers``: a worker's side of its peers (the other workers of one server), over their private sockets.

- :class:`PeerLink` is the mirror's :class:`~gateway.scaleout.mirror.Link` to a peer: ``GET /internal/streams/{id}``
  on the owner's socket is a reader of the owner's log like any other, never merged, that sends
  :mod:`gateway.scaleout.broker_codec` records as SSE events (``id`` = seq; :class:`gateway.scaleout.workers.PeerFraming`),
  read with the shared :class:`gateway.core.sse.SseDecoder`. Cut or dropped, it is resumed with ``?after=``;
  a peer whose socket refuses is gone (the mirror ends with ``owner_lost``).
- :class:`Peers` is what the routes use (:class:`gateway.core.ports.RemoteStreams`): mirrors, cancels
  (``DELETE /internal/streams/{id}``) and transcripts (``GET /internal/transcripts/{id}``) of the peers'
  streams, and ``/metrics`` merged over every worker (:func:`merge_metrics`).
- HTTP/1.1 to a peer is ``h11``'s (:func:`request`): one request per connection, the body as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import h11
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core import sse
from gateway.core.streams import StreamHub
from gateway.errors import stream_expired, stream_lost, stream_not_found
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.mirror import Item, Lease, MirrorSet, Opened, Quiet, RemoteStreamsByMirror
from gateway.scaleout.workers import worker_socket

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


class PeerLink:
    """The mirror's link to the other workers (:class:`gateway.scaleout.mirror.Link`); ``poll``: how long a quiet
    connection waits before the mirror may look at its idle clock."""

    def __init__(self, peers: dict[int, Path], poll: float) -> None:
        self.peers, self.poll = peers, poll

    async def open(self, stream_id: str) -> Opened:
        gone = False
        for k, path in self.peers.items():
            try:
                resp = await request(path, "GET", f"/internal/streams/{stream_id}?after=-1")
            except OSError:
                continue  # that worker is not up
            if resp.status != 200:
                gone |= resp.status == 410
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
        raise stream_expired(stream_id) if gone else stream_not_found(stream_id)

    async def _records(self, stream_id: str, k: int, resp: PeerResponse) -> AsyncGenerator[Item, None]:
        """The owner's records; a connection that ends without the end is resumed after the last event got.
        Ends (without the end) when the owner no longer serves the stream."""
        last = -1
        try:
            while True:
                decoder = sse.SseDecoder()
                async for data in resp.chunks(self.poll):
                    if data is None:
                        yield Quiet()
                        continue
                    for ev in decoder.feed(data):
                        if ev.id is not None:
                            last = int(ev.id)
                        yield codec.decode_line(ev.data)
                resp.close()
                try:
                    resp = await request(self.peers[k], "GET", f"/internal/streams/{stream_id}?after={last}")
                except OSError:
                    return
                if resp.status != 200:
                    return
        finally:
            resp.close()

    async def lease(self, owner: str) -> Lease:
        """A worker holds its streams while its private socket accepts connections."""
        path = self.peers.get(int(owner)) if owner.isdigit() else None
        if path is None:
            return Lease("missing")
        try:
            _, writer = await asyncio.open_unix_connection(str(path))
        except OSError:
            return Lease("missing")
        writer.close()
        return Lease("held")

    async def cancel(self, stream_id: str, owner: str) -> bool:
        path = self.peers.get(int(owner)) if owner.isdigit() else None
        if path is None:
            return False
        try:
            resp = await request(path, "DELETE", f"/internal/streams/{stream_id}")
            body = await resp.body()
        except OSError:
            return False
        return resp.status == 200 and bool(orjson.loads(body).get("cancelled"))


class Peers(RemoteStreamsByMirror):
    """The other workers of this server: their streams (:class:`gateway.core.ports.RemoteStreams`) and metrics.

    ``idle_timeout`` / ``recheck``: the mirrors' idle clock (:class:`gateway.scaleout.mirror.Idle`)."""

    def __init__(self, hub: StreamHub, *, port: int, workers: int, me: int, idle_timeout: float,
                 recheck: float) -> None:
        self.paths = {k: worker_socket(port, k) for k in range(workers) if k != me}
        self.mirrors = MirrorSet(hub, PeerLink(self.paths, poll=recheck), idle_timeout=idle_timeout, recheck=recheck)

    async def close(self) -> None:
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
