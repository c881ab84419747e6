"""``--workers N``: N gateway processes on one port, all on the same engine, any reader on any worker.

- Every worker binds the public port with ``SO_REUSEPORT`` (the kernel spreads connections) and a private
  Unix socket, ``<runtime dir>/gateway-<port>-w<k>.sock`` (0600, in the 0700 runtime directory). Worker 0
  is the process that was started; it spawns workers 1…N-1 with the same settings
  (:func:`spawn_workers`). Each worker has its own engine link (the engine serves several gateways).
- A reader that lands on a worker that does not run its stream gets a local *mirror* of it, fed by
  :class:`PeerBroker` from the owner's log over the owner's Unix socket (``GET /internal/streams/{id}``, a
  compact event stream that is a reader of the owner's stream like any other, never merged, resumed
  with ``?after=`` if cut). Replay, resume and slow readers then work on the mirror exactly as on the
  owner. ``DELETE`` and cancel reach the owner through ``DELETE /internal/streams/{id}``.
- ``/metrics`` on any worker merges every worker's metrics (counters and histograms summed, load gauges
  summed, other gauges their maximum), so a scrape sees the whole server; ``tokenfan_workers`` says how
  many answered.
- With ``--broker redis://…`` the Redis broker does this job instead (across workers and replicas).

- Readiness: a worker listens on the shared port only once its engine link is up (before, the kernel
  sends it no connections), and ``/health`` on any worker answers 200 only when every worker that listens
  on the port can serve (it asks each peer's ``GET /internal/ready``). So every request after the first
  200 lands on a worker that can serve it, after a cold start or a worker's restart alike.

Limits (``--max-concurrent``, ``--max-streams``, the per-client limits, …) apply per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine_worker.settings import default_runtime_dir
from gateway import sse
from gateway.delivery import SseResponse, cancel
from gateway.edge import gateway_of
from gateway.errors import APIError
from gateway.framing import Ending, Framing
from gateway.responses_chat import encode_transcript
from gateway.routes_responses import retained_transcript
from gateway.streams import Event, Stream, StreamHub

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.state import Gateway

log = logging.getLogger(__name__)

WORKER_INDEX_ENV = "TOKENFAN_WORKER_INDEX"
SUMMED_GAUGES = {"tokenfan_active_streams", "tokenfan_subscribers", "tokenfan_retained_stream_bytes",
                 "process_resident_memory_bytes", "process_virtual_memory_bytes", "process_open_fds"}


def worker_index() -> int:
    return int(os.environ.get(WORKER_INDEX_ENV, "0"))


def worker_socket(port: int, k: int) -> Path:
    return default_runtime_dir() / f"gateway-{port}-w{k}.sock"


def spawn_workers(config: GatewayConfig) -> list[subprocess.Popen[bytes]]:
    """Start workers 1…N-1 (this process is worker 0): ``tokenfan gateway`` with the same settings."""
    from engine_worker.settings import to_argv

    argv = [sys.executable, "-m", "gateway.cli", "gateway", *to_argv(config, "gateway")]
    procs = []
    for k in range(1, config.workers):
        env = {**os.environ, WORKER_INDEX_ENV: str(k)}
        procs.append(subprocess.Popen(argv, env=env))
    log.info("started %d more gateway workers on port %d", len(procs), config.port)
    return procs


def stop_workers(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()


# -- the owner's side: the internal routes, only on the private Unix socket ----------------------------


def _over_unix_socket(request: Request) -> bool:
    server = request.scope.get("server")
    return isinstance(server, tuple | list) and len(server) == 2 and server[1] is None


class PeerFraming(Framing):
    """One JSON object per event, every event on its own (a mirror's log must match the owner's seqs)."""

    name = "peer"
    mergeable = False

    def build(self, ev: Event) -> bytes:
        return b"data: " + orjson.dumps({"s": ev.seq, "p": ev.payload, "t": ev.timing, "x": ev.text,
                                         "f": ev.finish_reason}) + b"\n\n"

    def ending(self, stream: Stream) -> Ending:
        err = stream.error.body() if stream.error is not None else None
        return Ending(sse.event(orjson.dumps({"state": stream.state, "error": err}), event="end"))

    def cut(self, send_timeout: float) -> Ending:
        return Ending(sse.event(b"{}", event="cut"))


PEER = PeerFraming()


async def internal_stream(request: Request) -> Any:
    if not _over_unix_socket(request):
        raise APIError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    stream = gw.hub.get(request.path_params["id"])  # 404 / 410
    if stream.mirrored:
        raise APIError(404, "not the owner", code="stream_not_found")
    after = int(request.query_params.get("after", "-1"))
    meta = orjson.dumps({"endpoint": stream.endpoint, "model": stream.model, "detached": stream.detached,
                         "events": len(stream.events), "finished": stream.finished})
    return SseResponse(gw, stream, PEER, after, preamble=b"event: meta\ndata: " + meta + b"\n\n")


async def internal_cancel(request: Request) -> Response:
    if not _over_unix_socket(request):
        raise APIError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    s = gw.hub.streams.get(request.path_params["id"])
    return JSONResponse({"cancelled": bool(s is not None and not s.mirrored and cancel(s))})


async def internal_transcript(request: Request) -> Response:
    """A retained response's transcript (msgpack), for a peer resolving ``previous_response_id``."""
    if not _over_unix_socket(request):
        raise APIError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    transcript = retained_transcript(gateway_of(request).hub, request.path_params["id"])
    if transcript is None:
        return Response(status_code=404)
    return Response(encode_transcript(transcript), media_type="application/msgpack")


async def internal_metrics(request: Request) -> Response:
    if not _over_unix_socket(request):
        raise APIError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    from gateway.service import refresh_metrics

    refresh_metrics(gw)
    return Response(gw.metrics.render(), media_type=gw.metrics.content_type)


async def internal_ready(request: Request) -> Response:
    """Whether this worker listens on the shared port and whether its engine link is up (for peers' /health)."""
    if not _over_unix_socket(request):
        raise APIError(404, f"No route for {request.method} {request.url.path}.", code="not_found")
    gw: Gateway = gateway_of(request)
    return JSONResponse({"listening": gw.listening, "ready": gw.engine.healthy})


async def peers_ready(port: int, workers: int, me: int, timeout: float = 1.0) -> tuple[int, int]:
    """(peers that listen on the shared port, those of them that can serve). A peer whose private socket
    refuses (not started, or gone) listens on nothing and is left out; one that does not answer within
    ``timeout`` counts as listening and not ready."""
    async def one(k: int) -> tuple[bool, bool]:
        try:
            async with asyncio.timeout(timeout):
                status, reader, writer = await _request(worker_socket(port, k), "GET", "/internal/ready")
                try:
                    body = orjson.loads(await reader.read()) if status == 200 else {}
                finally:
                    writer.close()
        except TimeoutError:
            return True, False
        except (OSError, ValueError, IndexError):
            return False, False
        return bool(body.get("listening")), bool(body.get("listening") and body.get("ready"))

    answers = await asyncio.gather(*(one(k) for k in range(workers) if k != me))
    return sum(a for a, _ in answers), sum(r for _, r in answers)


# -- a peer's side: mirrors, remote cancels, merged metrics -------------------------------------------


async def _request(path: Path, method: str, target: str) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """An HTTP/1.0 request over a Unix socket (the response body then runs to EOF: no chunking)."""
    reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
    writer.write(f"{method} {target} HTTP/1.0\r\nHost: peer\r\n\r\n".encode())
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
        pass
    return status, reader, writer


async def _sse_events(reader: asyncio.StreamReader) -> Any:
    """(event, data) pairs of an SSE body until EOF."""
    decoder = sse.SseDecoder()
    while data := await reader.read(1 << 16):
        for ev in decoder.feed(data):
            yield ev.event, ev.data


class PeerBroker:
    """The other workers of this server: mirrors of their streams, cancels and transcripts sent to them
    (:class:`gateway.scaleout.StreamBroker`), and their metrics."""

    def __init__(self, hub: StreamHub, *, port: int, workers: int, me: int) -> None:
        self.hub = hub
        self.peers = {k: worker_socket(port, k) for k in range(workers) if k != me}
        self._owner: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def mirror(self, stream_id: str) -> Stream:
        """A local mirror of the stream a peer runs, or APIError 404 / 410."""
        existing = self.hub.streams.get(stream_id)
        if existing is not None:
            return existing
        gone = False
        for k, path in self.peers.items():
            try:
                status, reader, writer = await _request(path, "GET", f"/internal/streams/{stream_id}?after=-1")
            except OSError:
                continue  # that worker is not up
            if status != 200:
                gone |= status == 410
                writer.close()
                continue
            existing = self.hub.streams.get(stream_id)  # a concurrent subscriber made it meanwhile
            if existing is not None:
                writer.close()
                return existing
            stream = self._start_mirror(stream_id, k, reader, writer)
            # Answer once the mirror holds what the owner held when asked (its state, its events).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stream.meta.setdefault("caught_up", asyncio.Event()).wait()),
                                       5.0)
            return stream
        if gone:
            raise APIError(410, f"Stream {stream_id} is no longer retained.", code="stream_expired", param="id")
        raise APIError(404, f"No stream with id {stream_id}.", code="stream_not_found", param="id")

    def _start_mirror(self, stream_id: str, k: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> Stream:
        self.hub.check_capacity()
        stream = self.hub.create("", "", stream_id=stream_id)
        stream.mirrored = True
        self._owner[stream_id] = k
        task = asyncio.create_task(self._feed(stream, k, reader, writer), name=f"peer-mirror-{stream_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        stream.task = task
        return stream

    async def _feed(self, stream: Stream, k: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caught_up = stream.meta.setdefault("caught_up", asyncio.Event())
        target: int | None = None
        try:
            while True:
                async for kind, data in _sse_events(reader):
                    if kind == "meta":
                        meta = orjson.loads(data)
                        stream.endpoint, stream.model = meta["endpoint"], meta["model"]
                        stream.detached = meta.get("detached", True)
                        if target is None:
                            target = -1 if meta.get("finished") else int(meta.get("events", 0))
                    elif kind == "end":
                        end = orjson.loads(data)
                        e = end.get("error")
                        err = APIError(503, e["error"]["message"], type=e["error"]["type"], param=e["error"]["param"],
                                       code=e["error"]["code"]) if e else None
                        stream.finish(end["state"], err)
                        caught_up.set()
                        return
                    elif kind == "message":
                        ev = orjson.loads(data)
                        if ev["s"] == len(stream.events):
                            stream.append(Event(ev["s"], ev["p"], ev["t"], ev["x"], ev["f"]))
                    if target is not None and target >= 0 and len(stream.events) >= target:
                        caught_up.set()
                    # "cut": this mirror fell behind the owner's send timeout; resume below
                writer.close()
                try:  # the connection ended without an end: resume after the last event we have
                    status, reader, writer = await _request(self.peers[k], "GET",
                                                            f"/internal/streams/{stream.id}?after={len(stream.events) - 1}")
                except OSError:
                    status = 0
                if status != 200:
                    stream.finish("error", APIError(502, "The gateway worker running this stream is gone.",
                                                    type="server_error", code="owner_lost"))
                    return
        except asyncio.CancelledError:
            if not stream.finished:
                stream.finish("cancelled")
            raise
        finally:
            caught_up.set()
            writer.close()
            self.hub.mark_finished(stream)

    async def transcript(self, response_id: str) -> bytes | None:
        """The transcript of a response retained by a peer worker, or None."""
        for path in self.peers.values():
            with contextlib.suppress(OSError, ValueError, IndexError):
                status, reader, writer = await _request(path, "GET", f"/internal/transcripts/{response_id}")
                body = await reader.read()
                writer.close()
                if status == 200:
                    return body
        return None

    async def cancel_remote(self, stream_id: str) -> bool:
        k = self._owner.get(stream_id)
        if k is None:
            return False
        try:
            status, reader, writer = await _request(self.peers[k], "DELETE", f"/internal/streams/{stream_id}")
        except OSError:
            return False
        body = await reader.read()
        writer.close()
        return status == 200 and bool(orjson.loads(body).get("cancelled"))

    async def merged_metrics(self, own: bytes) -> bytes:
        """This worker's metrics merged with every reachable peer's."""
        texts = [own.decode()]
        for path in self.peers.values():
            with contextlib.suppress(OSError, ValueError, IndexError):
                status, reader, writer = await _request(path, "GET", "/internal/metrics")
                body = await reader.read()
                writer.close()
                if status == 200:
                    texts.append(body.decode())
        return merge_metrics(texts)


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


def bind_sockets(config: GatewayConfig) -> list[Any]:
    """This worker's sockets, bound, not yet listening: the shared public port (``SO_REUSEPORT``) and its
    private Unix socket. The kernel spreads the port's connections only over the workers that listen, so
    the server listens on it once this worker's engine link is up (``gateway.server``); a peer that finds
    the private socket refusing knows this worker takes no connections yet (:func:`peers_ready`)."""
    import socket

    public = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    public.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    public.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    public.bind((config.host, config.port))
    path = worker_socket(config.port, worker_index())
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    private.bind(str(path))
    os.chmod(path, 0o600)
    for s in (public, private):
        s.set_inheritable(False)  # uvicorn listens on the private socket once the app has started
    return [public, private]
