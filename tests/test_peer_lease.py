"""``PeerLink.lease`` (gateway/scaleout/peers.py) over a real Unix socket: how a sibling worker reads its owner.

A busy owner (accepts, answers late) must read as ``unknown`` (asked again), never as gone: a standby that
took a busy owner for a dead one would adopt its streams while it still generates them, and their readers
would read two answers. (``TimeoutError`` is an ``OSError`` since Python 3.3: caught as one, it read
``missing``, certain.) Only a socket nobody listens on is a process certainly gone."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import orjson

from gateway.scaleout.peers import PeerLink


async def _serve(path: Path, delay: float, pid: int) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(delay)
        body = orjson.dumps({"listening": True, "ready": True, "pid": pid})
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(answer, str(path))


def _lease(tmp_path: Path, delay: float | None, pid: int = 4242, owner: str = "1.4242") -> tuple[str, bool]:
    async def run() -> tuple[str, bool]:
        path = tmp_path / "w1.sock"
        server = await _serve(path, delay, pid) if delay is not None else None
        if server is None:  # a socket file nobody listens on: the worker died
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            s.close()
        try:
            lease = await PeerLink({1: path}, poll=0.05).lease(owner)
            return lease.state, lease.certain
        finally:
            if server is not None:
                server.close()
    return asyncio.run(run())


def test_an_owner_that_answers_is_held(tmp_path: Path) -> None:
    assert _lease(tmp_path, 0.0)[0] == "held"


def test_a_busy_owner_is_unknown_not_gone(tmp_path: Path) -> None:
    # answers after 1 s, past the lease's 4 x poll (0.2 s): alive but busy
    assert _lease(tmp_path, 1.0) == ("unknown", False)


def test_a_socket_nobody_listens_on_is_certainly_gone(tmp_path: Path) -> None:
    assert _lease(tmp_path, None) == ("missing", True)


def test_another_process_on_the_owners_index_is_certainly_gone(tmp_path: Path) -> None:
    assert _lease(tmp_path, 0.0, pid=os.getpid(), owner="1.4242") == ("missing", True)
