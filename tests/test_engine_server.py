"""The engine server's shutdown, in process on a real ZeroMQ socket: error replies already decided reach their
gateway before the socket closes, and no task outlives :meth:`EngineServer.serve`. And its rules for when a
gateway is gone (:class:`GatewayWatch`, pure: the time and the socket's events passed in)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from engine_worker import protocol as p
from engine_worker.backends.synthetic import SyntheticBackend
from engine_worker.config import EngineConfig
from engine_worker.server import EngineServer, GatewayWatch


def test_an_error_reply_decided_at_shutdown_still_reaches_the_gateway(tmp_path: Path) -> None:
    async def main() -> None:
        address = f"ipc://{tmp_path / 'engine.sock'}"
        server = EngineServer(backend=SyntheticBackend(EngineConfig(backend="synthetic")), address=address,
                              max_queue=0)
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(stop))
        await server.bound.wait()
        ctx = zmq.asyncio.Context()
        gw = ctx.socket(zmq.DEALER)
        gw.setsockopt(zmq.LINGER, 0)
        gw.connect(address)
        try:
            submit = p.Submit(request_id="r1", endpoint="completions", prompt="x", sampling=p.Sampling(max_tokens=1))
            await gw.send_multipart(p.encode(submit))
            while not server._replies:  # max_queue=0: the submit is refused with engine_overloaded
                await asyncio.sleep(0)
            stop.set()  # in the same turn: the reply's send has not run yet
            await asyncio.wait_for(serving, 10)
            assert not server._replies
            msg = p.decode(await asyncio.wait_for(gw.recv_multipart(), 10))
            assert isinstance(msg, p.Error) and (msg.request_id, msg.code) == ("r1", "engine_overloaded")
        finally:
            gw.close()
            ctx.term()

    asyncio.run(main())


# -- GatewayWatch: which gateways' requests the engine aborts (pure: the time and the socket's events in) ------


def test_a_local_gateway_silent_but_connected_is_stalled_not_dead_and_keeps_its_requests() -> None:
    watch = GatewayWatch(grace=10.0, local=True)
    watch.heard(b"gw", 7, 0.0)
    assert watch.tick(30.0, 0.5) == []  # stopped for 30 s (SIGSTOP, a busy loop): its connection is up
    watch.heard(b"gw", 7, 30.1)
    assert watch.tick(30.5, 0.5) == []


def test_a_remote_gateway_silent_past_the_grace_is_presumed_cut_off() -> None:
    watch = GatewayWatch(grace=10.0, local=False)
    watch.heard(b"gw", 7, 0.0)
    for k in range(1, 21):
        assert watch.tick(k * 0.5, 0.5) == []
    assert watch.tick(10.5, 0.5) == [(b"gw", "silent for 10s")]
    assert watch.tick(11.0, 0.5) == []  # once


def test_time_the_engines_own_loop_did_not_run_is_not_the_gateways_silence() -> None:
    watch = GatewayWatch(grace=10.0, local=False)
    watch.heard(b"gw", 7, 0.0)
    assert watch.tick(0.5, 0.5) == []
    assert watch.tick(12.0, 0.5) == []  # this loop stalled 11.5 s: the gateway's pings wait in the socket
    watch.heard(b"gw", 7, 12.01)
    assert watch.tick(12.5, 0.5) == []


def test_a_dropped_connection_aborts_its_gateways_requests_unless_that_gateway_is_heard_from_since() -> None:
    watch = GatewayWatch(grace=10.0, local=True)
    watch.heard(b"dead", 7, 0.0)
    watch.heard(b"other", 8, 0.0)
    watch.disconnected(7, 0.2)
    assert watch.tick(0.5, 0.5) == []  # confirmed a second later
    assert watch.tick(1.5, 0.5) == [(b"dead", "disconnected")]
    # A new connection that got the same descriptor, heard from before the old one's drop was read:
    watch.heard(b"new", 7, 2.0)
    watch.disconnected(7, 2.0)
    watch.heard(b"new", 7, 2.25)
    assert watch.tick(3.5, 0.5) == []
