"""A hostile client, run as its own process so its CPU is not the measuring client's:
``python -m tests.e2e.flood MODE URL N``.

Modes: ``ws`` (one ``/v1/ws`` connection sends N ``request`` messages in a burst, then cancels whatever was
not refused), ``sse`` (N ``EventSource`` subscriptions of one fan-out stream at once, raw HTTP/1.1), ``connect``
(N new ``/v1/ws`` connections at once, one request each). It prints ``start`` as the burst begins and, at the
end, one JSON summary line: every request's outcome (error codes counted; ``unanswered`` and ``bad`` must be 0).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import sys
from typing import Any

import httpx
import websockets

CHAT = {"messages": [{"role": "user", "content": "hello"}], "stream": True}


def _error_ok(err: Any) -> bool:
    return isinstance(err, dict) and bool(err.get("code")) and bool(err.get("message")) and bool(err.get("type"))


async def flood_ws(url: str, n: int) -> dict[str, Any]:
    """One connection, N requests; every id must end in an ``error`` or (after our cancel) a ``done``."""
    codes: collections.Counter[str] = collections.Counter()
    ended: set[str] = set()
    bad = 0
    async with websockets.connect(url.replace("http", "ws") + "/v1/ws", max_queue=None) as ws:
        print("start", flush=True)
        for i in range(n):  # one message each (a list would be one fragmented message)
            await ws.send(json.dumps({"type": "request", "id": str(i), "body": CHAT}))
        cancelled = False
        loop = asyncio.get_running_loop()
        quiet_from = loop.time() + 2.0  # the refusals are in once none came for 0.5 s (2 s for the first)
        while len(ended) < n:
            try:
                raw = await asyncio.wait_for(ws.recv(), 30 if cancelled else max(0.0, quiet_from - loop.time()))
            except TimeoutError:
                if cancelled:
                    break
                cancelled = True  # the refusals are in: cancel the rest (running or waiting)
                for i in range(n):
                    if str(i) not in ended:
                        await ws.send(json.dumps({"type": "cancel", "id": str(i)}))
                continue
            msg = json.loads(raw)
            if msg["type"] == "error":
                quiet_from = loop.time() + 0.5
                if msg.get("id") is None or not _error_ok(msg.get("error")):
                    bad += 1
                if msg["error"].get("code") == "not_found":  # a cancel that raced its request's end
                    continue
                codes[msg["error"]["code"]] += 1
                ended.add(msg["id"])
            elif msg["type"] == "done":
                codes["done"] += 1
                ended.add(msg["id"])
    return {"codes": dict(codes), "unanswered": n - len(ended), "bad": bad}


async def _raw_get(host: str, port: int, target: str, held: list[asyncio.StreamWriter]) -> tuple[int, Any]:
    """One HTTP/1.1 GET: (status, error body or None); a 200 stream is kept open in ``held``."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        return 0, repr(exc)
    status = int(head.split(b" ", 2)[1])
    if status == 200:
        held.append(writer)
        return status, None
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    body = await reader.readexactly(length)
    writer.close()
    return status, json.loads(body).get("error")


async def flood_sse(url: str, n: int) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        info = (await c.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x",
                                                        "max_tokens": 2000, "ignore_eos": True})).json()
    host, port = url.removeprefix("http://").split(":")
    target = info["events_url"].removeprefix(url)
    held: list[asyncio.StreamWriter] = []
    print("start", flush=True)
    results = await asyncio.gather(*(_raw_get(host, int(port), target, held) for _ in range(n)))
    codes: collections.Counter[str] = collections.Counter()
    bad = 0
    for status, err in results:
        if status == 200:
            codes["subscribed"] += 1
        elif status == 429 and _error_ok(err):
            codes[err["code"]] += 1
        else:
            bad += 1
            codes[f"status {status}: {err}"[:80]] += 1
    await asyncio.sleep(0.5)
    for w in held:
        w.close()
    async with httpx.AsyncClient() as c:
        await c.delete(f"{url}/v1/streams/{info['id']}")
    return {"codes": dict(codes), "unanswered": 0, "bad": bad}


class _Answers:
    """Counts connections that got their first answer; ``all_in`` is set once every one has."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.all_in = asyncio.Event()

    def one(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.all_in.set()


async def _one_connection(url: str, i: int, answers: _Answers) -> tuple[str, bool]:
    answered = False
    try:
        async with websockets.connect(url.replace("http", "ws") + "/v1/ws", open_timeout=60) as ws:
            with contextlib.suppress(websockets.ConnectionClosed):  # refused: the error is already in
                await ws.send(json.dumps({"type": "request", "id": str(i), "body": CHAT}))
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            answered = True
            answers.one()
            # hold every connection the gateway kept open until every connection has its answer, so that
            # no slot of --max-connections-per-client is freed (and taken again) during the flood
            await answers.all_in.wait()
            if msg["type"] == "error":
                return msg["error"].get("code") or "?", _error_ok(msg["error"])
            return "served", True
    except websockets.ConnectionClosed as exc:
        return f"closed {exc.rcvd.code if exc.rcvd else None}", False
    except (OSError, TimeoutError) as exc:
        return repr(exc)[:60], False
    finally:
        if not answered:
            answers.one()


async def flood_connect(url: str, n: int) -> dict[str, Any]:
    answers = _Answers(n)
    print("start", flush=True)
    results = await asyncio.gather(*(_one_connection(url, i, answers) for i in range(n)))
    codes = collections.Counter(code for code, _ in results)
    return {"codes": dict(codes), "unanswered": 0, "bad": sum(not ok for _, ok in results)}


def main() -> None:
    mode, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    flood = {"ws": flood_ws, "sse": flood_sse, "connect": flood_connect}[mode]
    print(json.dumps(asyncio.run(flood(url, n))), flush=True)


if __name__ == "__main__":
    main()
