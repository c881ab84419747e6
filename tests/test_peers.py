"""A peer's answer read by gateway.scaleout.peers, from a real Unix socket served by asyncio."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.scaleout.peers import request

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_reader_of_a_peers_body_cancelled_as_bytes_arrive_ends_cancelled_at_any_point(tmp_path: Path) -> None:
    path = tmp_path / "peer.sock"

    async def main() -> list[tuple[bool, bool]]:
        writers: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD + b"1\r\na\r\n")
            await writer.drain()
            await writers.put(writer)

        async def attempt(k: int) -> tuple[bool, bool]:
            resp = await request(path, "GET", "/internal/streams/s")
            got: list[bytes | None] = []

            async def read() -> None:
                async for c in resp.chunks(idle=60.0):
                    got.append(c)

            reader = asyncio.create_task(read())
            peer = await writers.get()
            while not got:
                await asyncio.sleep(0)
            peer.write(b"1\r\nb\r\n")
            for _ in range(k):
                await asyncio.sleep(0)
            pending = reader.cancel()
            peer.close()  # a reader whose cancel was dropped sees the body end and returns
            await asyncio.wait({reader})
            resp.close()
            return pending, reader.cancelled()

        server = await asyncio.start_unix_server(serve, str(path))
        async with server:
            return [await attempt(k) for k in range(12)]

    outcomes = asyncio.run(main())
    assert all(cancelled for pending, cancelled in outcomes if pending), outcomes
