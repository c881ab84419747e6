"""The Durable Streams protocol's official clients as test readers: the TypeScript client
(``@durable-streams/client``, tests/node/durable/read_stream.mjs) and the Python client (``durable-streams``).

``durable-streams`` 0.1.0, the release on PyPI, predates the protocol's stream closure: it reads on past
``Stream-Closed`` (its repository's later code stops there). :func:`py_read` stops where the protocol says the
stream ends: after an answer with ``Stream-Closed: true`` (a long poll's 204 at the end raises
:class:`Closed` from a response hook, since the client would otherwise ask again at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from durable_streams import stream

from tests.procs import NODE_DIR, npm_ci

HARNESS_DIR = NODE_DIR / "durable"


class Closed(Exception):
    """The gateway said the stream is closed with nothing more to read."""


@dataclass
class Read:
    """What one reader got: the messages, the offset after each answer, whether it saw the end."""

    items: list[dict[str, Any]] = field(default_factory=list)
    offsets: list[str] = field(default_factory=list)
    closed: bool = False
    errors: list[str] = field(default_factory=list)
    sessions: int = 0  # client instances it took (1 + resumes)

    @property
    def offset(self) -> str:
        return self.offsets[-1] if self.offsets else "-1"


def _closed_hook(response: httpx.Response) -> None:
    if response.status_code == 204 and response.headers.get("stream-closed") == "true":
        raise Closed


def py_read(urls: list[str], read: Read, *, offset: str = "-1", stop_after: int | None = None,
            on_batch: Callable[[Read], None] | None = None, headers: dict[str, str] | None = None) -> Read:
    """Read ``urls[0]`` with long polls from ``offset`` to the stream's end (or ``stop_after`` messages, on an
    answer's edge); when its gateway is gone, go on at the next URL from the last offset: a new client."""
    saved = offset
    for url in urls:
        read.sessions += 1
        client = httpx.Client(timeout=30, event_hooks={"response": [_closed_hook]})
        try:
            hdrs: dict[str, str | Callable[[], str]] = dict(headers or {})
            with stream(url, offset=saved, live="long-poll", client=client, headers=hdrs) as res:
                for ev in res.iter_events(mode="json_batches"):
                    read.items.extend(ev.data)
                    read.offsets.append(ev.next_offset)
                    saved = ev.next_offset
                    if on_batch is not None:
                        on_batch(read)
                    if res.headers.get("stream-closed") == "true":
                        read.closed = True
                        return read
                    if stop_after is not None and len(read.items) >= stop_after:
                        return read
        except Closed:
            read.closed = True
            return read
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            read.errors.append(repr(exc))
        finally:
            client.close()
    return read


def npm_durable() -> Path:
    return npm_ci(HARNESS_DIR)


def ts_start(config: dict[str, Any]) -> subprocess.Popen[str]:
    """The TypeScript reader (tests/node/durable/read_stream.mjs) on ``config``, its progress on stdout."""
    return subprocess.Popen(["node", str(HARNESS_DIR / "read_stream.mjs"), json.dumps(config)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HARNESS_DIR,
                            env={**os.environ, "NODE_NO_WARNINGS": "1"})


def ts_finish(proc: subprocess.Popen[str], progress: Callable[[int], None] | None = None,
              timeout: float = 120.0) -> Read:
    """Follow a TypeScript reader to its result (``progress``: called with its total after each batch)."""
    result: dict[str, Any] = {}
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            if "result" in msg:
                result = msg["result"]
            elif progress is not None:
                progress(msg["total"])
        proc.wait()
    finally:
        timer.cancel()
    assert result, f"the TypeScript reader ended without its result: {proc.stderr.read() if proc.stderr else ''}"
    return Read(result["items"], result["offsets"], result["closed"], result["errors"], result["urlsUsed"])


def ts_read(config: dict[str, Any]) -> Read:
    return ts_finish(ts_start(config))
