"""``--workers N``: N gateway processes on one port, all on the same engine, any reader on any worker.

- Every worker binds the public port with ``SO_REUSEPORT`` (the kernel spreads connections) and a private
  Unix socket, ``<runtime dir>/gateway-<port>-w<k>.sock`` (0600, in the 0700 runtime directory). Worker 0
  is the process that was started; it spawns workers 1…N-1 with the same settings
  (:func:`spawn_workers`). Each worker has its own engine link (the engine serves several gateways).
- A reader that lands on a worker that does not run its stream gets a local *mirror* of it
  (:mod:`gateway.scaleout.mirror`, the same as ``--broker``'s), fed from the owner's log over the owner's Unix
  socket: ``GET /internal/streams/{id}`` (:mod:`gateway.http.internal`, in :class:`PeerFraming`), :class:`gateway.scaleout.peers.PeerLink`
  on the peer (``POST`` from the stream's standby: :class:`StandbyFraming`, the gate in
  :class:`gateway.scaleout.peers.Peers`). ``DELETE`` and cancel reach the owner through ``DELETE /internal/streams/{id}``.
- ``/metrics`` on any worker merges every worker's metrics (:func:`gateway.scaleout.peers.merge_metrics`), so a
  scrape sees the whole server; ``tokenfan_workers`` says how many answered.
- With ``--broker redis://…`` mirrors read Redis instead (across workers and replicas).

- Readiness: a worker listens on the shared port only once its engine link is up (before, the kernel
  sends it no connections), and ``/health`` on any worker answers 200 only when every worker that listens
  on the port can serve (it asks each peer's ``GET /internal/ready``). So every request after the first
  200 lands on a worker that can serve it, after a cold start or a worker's restart alike.

Limits (``--max-concurrent``, ``--max-streams``, the per-client limits, …) apply per worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.core import sse
from gateway.core.framing import Ending, Framing
from gateway.core.streams import Event, Stream
from gateway.scaleout import broker_codec as codec
from tokenfan_settings import default_runtime_dir

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

log = logging.getLogger(__name__)

WORKER_INDEX_ENV = "TOKENFAN_WORKER_INDEX"


def worker_index() -> int:
    return int(os.environ.get(WORKER_INDEX_ENV, "0"))


def worker_socket(port: int, k: int) -> Path:
    return default_runtime_dir() / f"gateway-{port}-w{k}.sock"


# -- the owner's side of a peer link: its log as records ------------------------------------------


class PeerFraming(Framing):
    """A peer's mirror reads the owner's log as :mod:`gateway.scaleout.broker_codec` records, one SSE event each
    (``id`` = seq), every event on its own (a mirror's log must match the owner's seqs). A cut reader gets
    no end: its mirror resumes after the last id it got."""

    name = "peer"
    relay = True  # written first and at once: the peer writes its share of the readers meanwhile

    def build(self, ev: Event) -> bytes:
        return sse.event(codec.pack_event(ev), id=ev.seq)

    def ending(self, stream: Stream) -> Ending:
        return Ending(sse.event(codec.pack(codec.encode_end_of(stream))))

    def cut(self, send_timeout: float) -> Ending:
        return Ending(sse.comment("cut: too slow, resume after the last id"))


class StandbyFraming(PeerFraming):
    """The relay to a stream's standby: also a gated stream's pending events, which wait for its acknowledgement
    (:class:`gateway.scaleout.peers.Peers`)."""

    standby = True


PEER = PeerFraming()
STANDBY = StandbyFraming()


def bind_sockets(config: GatewayConfig) -> list[Any]:
    """This worker's sockets, bound, not yet listening: the shared public port (``SO_REUSEPORT``) and its
    private Unix socket. The kernel spreads the port's connections only over the workers that listen, so
    the server listens on it once this worker's engine link is up (``gateway.http.server``); a peer that finds
    the private socket refusing knows this worker takes no connections yet (:func:`peers_ready`)."""
    import socket

    public = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    public.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    public.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        public.bind((config.host, config.port))
    except OSError as exc:
        raise SystemExit(f"tokenfan: cannot listen on {config.host}:{config.port}: {exc.strerror}") from None
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
