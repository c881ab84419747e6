"""One gateway over several engine workers: least-loaded routing, routing around a dead engine (its streams
continue on the other: migration), aborts reaching the engine that runs the request."""

from __future__ import annotations

import signal

import httpx

from tests.e2e.helpers import wait_until
from tests.procs import start_engine, start_gateway


def engines(url: str) -> list[dict]:
    return httpx.get(url + "/health").json()["engines"]


def test_requests_spread_over_engines_and_route_around_a_dead_one(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    addrs = [f"ipc://{ipc_dir / f'pool-{i}.sock'}" for i in range(2)]
    procs = [start_engine(a, "--engine", "synthetic", "--synthetic-tokens-per-s", "20", name=f"engine-pool{i}")
             for i, a in enumerate(addrs)]
    gw, url = start_gateway(addrs[0], "--engine", addrs[1], "--heartbeat-interval", "0.2",
                            "--heartbeat-timeout", "0.8", name="gateway-pool")
    try:
        wait_until(lambda: all(e["healthy"] for e in engines(url)), what="both engines up")
        long = {"endpoint": "completions", "prompt": "x", "max_tokens": 1000}
        ids = [httpx.post(url + "/v1/streams", json=long).json()["id"] for _ in range(8)]
        counts = [e["in_flight"] for e in engines(url)]
        assert sorted(counts) == [4, 4], counts  # least-loaded routing alternates
        # Cancelling aborts on the engine that runs the request.
        for sid in ids[:4]:
            assert httpx.delete(f"{url}/v1/streams/{sid}").json()["state"] == "cancelled"
        wait_until(lambda: sum(e["running"] or 0 for e in engines(url)) == 4, timeout=5,
                   what="engines report the aborts")
        # Kill one engine: its streams continue on the survivor (migration), new streams go there too.
        on_dead = engines(url)[0]["in_flight"]
        assert 1 <= on_dead <= 3, engines(url)
        procs[0].stop(signal.SIGKILL)
        wait_until(lambda: [e["healthy"] for e in engines(url)] == [False, True], timeout=5, what="engine 0 down")

        def states() -> list[str]:
            return sorted(httpx.get(f"{url}/v1/streams/{sid}").json()["state"] for sid in ids[4:])

        wait_until(lambda: engines(url)[1]["in_flight"] == 4, timeout=5, what="the dead engine's streams moved")
        assert states() == ["running"] * 4
        for _ in range(4):
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/health").status_code == 200
    finally:
        gw.stop()
        for p in procs:
            p.stop()
