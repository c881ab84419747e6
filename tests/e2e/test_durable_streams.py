"""Every listed stream is read by the Durable Streams protocol's official clients (docs/durable-streams.md).

Real processes: a synthetic engine and gateways on loopback; the TypeScript client ``@durable-streams/client``
(tests/node/durable) and the Python client ``durable-streams`` read ``durable_url`` to the end, resume from a
saved offset after a "reload" (a new client instance), and resume on another replica (``--broker``, a real
``redis-server``) after the one that ran the stream is SIGKILLed: each message once, in order, to the end.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.durable_clients import Read, npm_durable, py_read, ts_finish, ts_read, ts_start
from tests.e2e.helpers import wait_until
from tests.e2e.test_broker import RedisServer, redis_server  # noqa: F401  (the fixture)
from tests.procs import NO_CLIENT_LIMITS, start_engine, start_gateway, stop_all
from tests.system import require

ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "20", "--synthetic-ttft-ms", "5")
TOKENS = 60  # 3 s a stream: readers join and reload while it runs
LEASE = ("--broker-lease-interval", "0.2", "--broker-lease-ttl", "0.8")


@pytest.fixture(scope="module", autouse=True)
def _node() -> None:
    require("node")
    npm_durable()


@pytest.fixture(scope="module")
def slow_gateway(ipc_dir: Path) -> Iterator[str]:
    address = f"ipc://{ipc_dir / 'durable.sock'}"
    engine = start_engine(address, *ENGINE_ARGS, name="engine-durable")
    gateway, url = start_gateway(address, *NO_CLIENT_LIMITS, "--api-key", "sk-durable", name="gateway-durable")
    yield url
    stop_all([gateway, engine])


AUTH = {"Authorization": "Bearer sk-durable"}


def create(url: str, seed: int, headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": f"river {seed}"}], "max_tokens": TOKENS, "seed": seed, **extra}
    r = httpx.post(url + "/v1/streams", json=body, headers=headers, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def whole(durable_url: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The finished stream's messages, by one catch-up read (after waiting for its end)."""
    def closed() -> bool:
        return httpx.head(durable_url, headers=headers, timeout=10).headers.get("stream-closed") == "true"

    wait_until(closed, timeout=60, what="the stream closed")
    r = httpx.get(httpx.URL(durable_url).copy_add_param("offset", "-1"), headers=headers, timeout=10)
    assert r.status_code == 200 and r.headers["stream-closed"] == "true", r.headers
    return r.json()  # type: ignore[no-any-return]


def check(read: Read, want: list[dict[str, Any]]) -> None:
    """Each message once, in order, to the end; offsets strictly increasing as strings (8: sortable)."""
    assert not read.errors or read.sessions > 1, read.errors
    assert read.closed, (len(read.items), read.errors)
    assert read.items == want, ([i.get("choices") for i in read.items][:5], len(read.items), len(want))
    assert read.offsets == sorted(read.offsets), read.offsets
    assert text(read.items).strip()


def text(items: list[dict[str, Any]]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for i in items for c in i.get("choices") or [])


@pytest.mark.parametrize("live", ["sse", "long-poll"])
def test_the_typescript_client_reads_a_running_stream_to_its_end_with_the_stream_token(
        slow_gateway: str, live: str) -> None:
    s = create(slow_gateway, 1, AUTH, stream_options={"include_usage": True})
    assert "?token=" in s["durable_url"]  # the events_url's token opens the durable read too
    read = ts_read({"urls": [s["durable_url"]], "live": live})
    want = whole(s["durable_url"])
    check(read, want)
    assert want[-1]["usage"]["completion_tokens"] == TOKENS and read.sessions == 1


def test_the_typescript_client_resumes_from_a_saved_offset_after_a_reload_each_chunk_once(slow_gateway: str) -> None:
    s = create(slow_gateway, 2, AUTH)
    first = ts_read({"urls": [s["durable_url"]], "live": "sse", "stopAfter": 5})
    assert not first.closed and 5 <= len(first.items) < TOKENS, len(first.items)
    second = ts_read({"urls": [s["durable_url"]], "live": "long-poll", "offset": first.offset})
    resumed = Read(first.items + second.items, first.offsets + second.offsets, second.closed, second.errors)
    check(resumed, whole(s["durable_url"]))


def test_the_python_client_reads_a_stream_to_its_end_and_resumes_after_a_reload(slow_gateway: str) -> None:
    s = create(slow_gateway, 3, AUTH)
    first = py_read([s["durable_url"]], Read(), stop_after=5)
    assert not first.closed and len(first.items) >= 5
    second = py_read([s["durable_url"]], Read(), offset=first.offset)
    resumed = Read(first.items + second.items, first.offsets + second.offsets, second.closed, second.errors)
    want = whole(s["durable_url"])
    check(resumed, want)
    check(py_read([s["durable_url"]], Read()), want)  # and from the start, of the finished stream, with the key
    check(py_read([s["durable_url"].split("?")[0]], Read(), headers=AUTH), want)


def test_without_the_token_or_a_key_the_read_is_refused(slow_gateway: str) -> None:
    s = create(slow_gateway, 4, AUTH)
    bare = s["durable_url"].split("?")[0]
    r = httpx.get(bare, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def test_a_killed_owners_readers_resume_on_another_replica_from_their_offsets_each_chunk_once(
        ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    """Replicas A and B (``--broker``): a stream created on A; a TypeScript SSE reader, a TypeScript long-poll
    reader and a Python reader on A. A is SIGKILLed once each has its first messages; each goes on at B from
    the offset of the last answer it got (a new client instance) and must read every message once, to the end."""
    require("redis-server")
    address = f"ipc://{ipc_dir / 'durable-kill.sock'}"
    engine = start_engine(address, *ENGINE_ARGS, name="engine-durable-kill")
    (gw_a, url_a), (gw_b, url_b) = (start_gateway(address, "--broker", redis_server.url, *LEASE, *NO_CLIENT_LIMITS,
                                                  name=f"gateway-durable-{k}") for k in "ab")
    try:
        s = create(url_a, 5, max_tokens=100)  # 5 s: the kill lands mid-stream
        on_a, on_b = s["durable_url"], s["durable_url"].replace(url_a, url_b)
        assert on_b != on_a
        totals = {"ts-sse": 0, "ts-long-poll": 0, "py": 0}
        ts = {name: ts_start({"urls": [on_a, on_b], "live": name[3:], "retries": 2}) for name in ("ts-sse",
                                                                                                    "ts-long-poll")}
        results: dict[str, Read] = {}

        def follow(name: str) -> None:
            def progress(n: int) -> None:
                totals[name] = n
            results[name] = ts_finish(ts[name], progress)

        def py() -> None:
            def batch(r: Read) -> None:
                totals["py"] = len(r.items)
            results["py"] = py_read([on_a, on_b], Read(), on_batch=batch)

        threads = [threading.Thread(target=follow, args=(n,)) for n in ts] + [threading.Thread(target=py)]
        for t in threads:
            t.start()
        wait_until(lambda: all(n >= 3 for n in totals.values()), timeout=60, what="every reader has its first messages")
        os.kill(gw_a.popen.pid, signal.SIGKILL)
        for t in threads:
            t.join(120)
        want = whole(on_b)
        assert len(want) == 101, len(want)  # the role chunk and 100 tokens' chunks, read on B after A died
        for name, read in results.items():
            assert read.sessions == 2, (name, read.sessions, read.errors)  # it did resume on B
            check(read, want)
    finally:
        stop_all([gw_a, gw_b, engine])
