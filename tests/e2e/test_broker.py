"""Scale-out: two engines and two gateway replicas sharing fan-out streams through a real Redis.

Streams spread over both engines, killing one engine does not fail new streams, a subscriber resumes
on the other gateway without loss, a gateway restart loses no retained stream, and DELETE works
from either replica."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.helpers import chunk_text, sse_events, wait_until
from tests.procs import free_port, start_engine, start_gateway

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server not installed (make test installs Debian's redis-server)")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        wait_until(lambda: _ping(redis, port), timeout=10, what="redis up")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _ping(redis, port: int) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(redis.Redis(port=port).ping())
    except Exception:  # noqa: BLE001 - not up yet
        return False


def stream_text(events: list[dict[str, str]]) -> tuple[str, list[int]]:
    evs = [e for e in events if "id" in e]
    return "".join(chunk_text(json.loads(e["data"])) for e in evs), [int(e["id"]) for e in evs]


def test_two_engines_two_gateways_one_broker(ipc_dir, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    engines_addr = [f"ipc://{ipc_dir / f'bk-{i}.sock'}" for i in range(2)]
    engines = [start_engine(a, "--engine", "synthetic", "--synthetic-tokens-per-s", "40", name=f"engine-bk{i}")
               for i, a in enumerate(engines_addr)]
    common = ["--engine", engines_addr[1], "--broker", redis_url, "--heartbeat-interval", "0.2",
              "--heartbeat-timeout", "0.8"]
    gw_a, url_a = start_gateway(engines_addr[0], *common, name="gateway-bk-a")
    gw_b, url_b = start_gateway(engines_addr[0], *common, name="gateway-bk-b")
    try:
        wait_until(lambda: all(e["healthy"] for e in httpx.get(url_a + "/health").json()["engines"]),
                   what="both engines up")
        body = {"endpoint": "completions", "prompt": "x", "max_tokens": 80}
        streams = [httpx.post(url_a + "/v1/streams", json=body).json() for _ in range(4)]
        assert sorted(e["in_flight"] for e in httpx.get(url_a + "/health").json()["engines"]) == [2, 2]

        # Read part of a stream on gateway A, drop, resume on gateway B: nothing lost or repeated.
        sid = streams[0]["id"]
        seen_text, seen_ids = "", []
        with httpx.stream("GET", f"{url_a}/v1/streams/{sid}/events") as r:
            lines = r.iter_lines()
            buf = ""
            for line in lines:
                buf += line + "\n"
                if line == "" and "id: " in buf:
                    t, ids = stream_text(sse_events(buf))
                    seen_text, seen_ids = seen_text + t, seen_ids + ids
                    buf = ""
                    if len(seen_ids) >= 10:
                        break
        rest = sse_events(httpx.get(f"{url_b}/v1/streams/{sid}/events", timeout=30,
                                    headers={"Last-Event-ID": str(seen_ids[-1])}).text)
        rest_text, rest_ids = stream_text(rest)
        assert rest_ids[0] == seen_ids[-1] + 1 and rest[-1]["data"] == "[DONE]"
        full_text, full_ids = stream_text(sse_events(httpx.get(f"{url_a}/v1/streams/{sid}/events", timeout=30).text))
        assert seen_text + rest_text == full_text and seen_ids + rest_ids == full_ids

        # A WebSocket subscriber on B sees the same text; DELETE from B cancels A's generation.
        long = httpx.post(url_a + "/v1/streams", json={**body, "max_tokens": 1000}).json()
        time.sleep(0.3)
        r = httpx.delete(f"{url_b}/v1/streams/{long['id']}", timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        assert httpx.get(f"{url_a}/v1/streams/{long['id']}").json()["state"] == "cancelled"

        # Gateway A restarts: its finished streams are still served, from Redis, by the new process.
        port_a = int(url_a.rsplit(":", 1)[1])
        gw_a.stop()
        gw_a, url_a = start_gateway(engines_addr[0], *common, name="gateway-bk-a2", port=port_a)
        again, again_ids = stream_text(sse_events(httpx.get(f"{url_a}/v1/streams/{sid}/events", timeout=30).text))
        assert again == full_text and again_ids == full_ids
        assert httpx.get(f"{url_a}/v1/streams/str-never-existed/events").status_code == 404

        # Kill engine 0: new streams keep working on engine 1.
        engines[0].stop(signal.SIGKILL)
        wait_until(lambda: [e["healthy"] for e in httpx.get(url_b + "/health").json()["engines"]] == [False, True],
                   timeout=5, what="engine 0 seen down")
        for _ in range(3):
            s = httpx.post(url_b + "/v1/streams", json={**body, "max_tokens": 5}).json()
            text, ids = stream_text(sse_events(httpx.get(f"{url_a}/v1/streams/{s['id']}/events", timeout=30).text))
            assert text and ids == list(range(len(ids)))
    finally:
        for p in (gw_a, gw_b, *engines):
            p.stop()
