"""The engine server's shutdown, in process on a real ZeroMQ socket: error replies already decided reach their
gateway before the socket closes, and no task outlives :meth:`EngineServer.serve`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from engine_worker import protocol as p
from engine_worker.backends.synthetic import SyntheticBackend
from engine_worker.config import EngineConfig
from engine_worker.server import EngineServer


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
