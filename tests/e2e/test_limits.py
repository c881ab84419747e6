"""Configurable limits answer 413 / 429 + Retry-After / 400 in the OpenAI shape, and free up again."""

from __future__ import annotations

import httpx

from tests.e2e.helpers import listening, wait_until
from tests.procs import start_gateway


def test_concurrency_per_key_and_total_and_prompt_tokens(synthetic_engine: str) -> None:
    proc, url = start_gateway(synthetic_engine, "--api-key", "k1", "--api-key", "k2", "--max-concurrent", "2",
                              "--max-concurrent-per-key", "1", "--max-prompt-tokens", "10",
                              "--max-body-bytes", "2000", "--max-subscribers", "1", name="gateway-limits")
    h1, h2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    long = {"endpoint": "completions", "prompt": "x", "max_tokens": 1500}
    try:
        s1 = httpx.post(url + "/v1/streams", json=long, headers=h1)
        assert s1.status_code == 201
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=h1)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert httpx.post(url + "/v1/streams", json=long, headers=h2).status_code == 201
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=h2)
        assert r.status_code == 429  # k2 is at its own limit; the total is also 2
        httpx.delete(f"{url}/v1/streams/{s1.json()['id']}", headers=h1)
        wait_until(lambda: httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                      headers=h1).status_code == 200, what="slot freed after cancel")
        r = httpx.post(url + "/v1/completions", json={"prompt": "one two three four five six seven eight nine ten "
                                                                "eleven twelve", "max_tokens": 2}, headers=h1)
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
        r = httpx.post(url + "/v1/completions", content=b'{"prompt":"' + b"x" * 3000 + b'"}', headers=h1)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # one subscriber per stream
        s3 = httpx.post(url + "/v1/streams", json={**long, "max_tokens": 300}, headers=h1).json()
        with httpx.stream("GET", s3["events_url"]) as first:
            lines = first.iter_lines()  # keep the iterator: dropping it closes the response
            assert any(line.startswith("id: ") for line in lines)  # subscribed and receiving
            second = httpx.get(s3["events_url"])
            assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_subscribers"
    finally:
        proc.stop()


def test_requests_fail_fast_with_503_when_no_engine_is_attached(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    import time

    from tests.procs import spawn
    from tokenfan_bench.servers.processes import free_port

    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "gateway", "--engine", f"ipc://{ipc_dir / 'nobody.sock'}", "--port",
                  str(port), "--log-level", "warning"], "gateway-no-engine")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: listening(url), what="gateway listening")
        assert httpx.get(url + "/health").status_code == 503
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - t0 < 2
    finally:
        proc.stop()


def test_a_post_stream_client_that_stops_reading_is_cut_and_its_generation_aborted(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    from tests.e2e.helpers import fat_gateway, metric, stalled_client

    with fat_gateway(ipc_dir, "deadclient") as url:
        before = metric(url, "tokenfan_requests_aborted_total")
        body = b'{"prompt":"x","max_tokens":8000,"stream":true}'  # 16 MB over 8 s
        dead = stalled_client(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            # once every buffer is full, the write times out and the engine request is aborted
            wait_until(lambda: metric(url, "tokenfan_requests_aborted_total") > before, timeout=30,
                       what="dead client's generation aborted")
        finally:
            dead.close()


def test_responses_websocket_limits_are_settings(synthetic_engine: str) -> None:
    """`--responses-ws-max-lanes` / `--responses-ws-max-pending` bound one socket, as docs/settings.md says."""
    import json

    from websockets.sync.client import connect

    proc, url = start_gateway(synthetic_engine, "--responses-ws-max-lanes", "1", "--responses-ws-max-pending", "1",
                              name="gateway-resp-ws-limits")
    body = {"model": "synthetic", "input": "x", "max_output_tokens": 400}
    try:
        with connect(url.replace("http", "ws") + "/v1/responses") as ws:
            ws.send(json.dumps({"type": "response.create", **body, "stream_id": "a"}))
            ws.send(json.dumps({"type": "response.create", **body, "stream_id": "a"}))  # waits in lane a
            ws.send(json.dumps({"type": "response.create", **body, "stream_id": "a"}))  # over max_pending
            ws.send(json.dumps({"type": "response.create", **body, "stream_id": "b"}))  # a second lane
            codes = []
            while len(codes) < 2:
                ev = json.loads(ws.recv(timeout=10))
                if ev["type"] == "error":
                    codes.append((ev.get("stream_id"), ev["error"]["code"], ev.get("status")))
            assert codes[0][0] == "a" and codes[0][2] == 429
            assert codes[1] == ("b", "websocket_stream_limit_reached", codes[1][2])
    finally:
        proc.stop()
