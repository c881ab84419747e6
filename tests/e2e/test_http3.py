"""HTTP/3 and WebTransport (``--http3-port``) against a real gateway and synthetic engine, through the
bench's aioquic clients: SSE over HTTP/3 on the chat and fan-out routes, WebTransport streams carrying the
same SSE bytes, resume with ``Last-Event-ID`` after a dropped QUIC connection, limits and metrics."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.http.certs import generate
from gateway.http3.wire import RequestHead
from tests.e2e.helpers import with_applied_delay
from tests.procs import start_engine, start_gateway
from tokenfan_bench.clients.quic import QuicOrigin, Response, read_events
from tokenfan_bench.clients.recorder import Recorder
from tokenfan_bench.servers.processes import free_port, stop_all
from tokenfan_bench.wire.events import ChunkSample, SseDecoder

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def h3_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(TCP URL, UDP port) of a gateway serving HTTP/3 beside cleartext HTTP/1.1."""
    d = tmp_path_factory.mktemp("h3")
    cert, key = generate(d / "certs", days=13)
    address = f"ipc://{d / 'engine.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                          "--synthetic-tokens-per-s", "100", name="engine-h3")
    port = free_port()
    try:
        gateway, url = start_gateway(address, "--http3-port", str(port), "--http3-certfile", str(cert),
                                     "--http3-keyfile", str(key), "--max-subscriptions-per-client", "3",
                                     name="gateway-h3")
    except BaseException:
        engine.stop()
        raise
    yield url, port
    stop_all([gateway, engine])


def create_stream(url: str, max_tokens: int) -> dict[str, object]:
    r = httpx.post(url + "/v1/streams", json={"endpoint": "chat.completions", "max_tokens": max_tokens,
                                               "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def seqs(rec: Recorder) -> list[int]:
    return [s.seq for _, s in rec.rows]


def final_seq(url: str, stream_id: str) -> int:
    """The last event id of a finished stream, read over HTTP/1.1 from the start."""
    with httpx.stream("GET", f"{url}/v1/streams/{stream_id}/events", timeout=30) as r:
        ids = [int(line[3:]) for line in r.iter_lines() if line.startswith("id:")]
    return ids[-1]


def increasing(xs: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(xs))


def all_deltas(rows: list[tuple[int, ChunkSample]]) -> int:
    return sum(s.deltas for _, s in rows)


@pytest.mark.parametrize("transport", ["sse-h3", "wt"])
def test_fanout_stream_reads_every_event_over_quic(h3_gateway: tuple[str, int], transport: str) -> None:
    url, port = h3_gateway
    info = create_stream(url, 20)

    async def main() -> Recorder:
        origin = QuicOrigin("127.0.0.1", port, None)
        rec = Recorder(0, time.time_ns())
        try:
            await read_events(await origin.client(), transport, origin.authority,
                              f"/v1/streams/{info['id']}/events", rec)
        finally:
            await origin.close()
        return rec

    rec = asyncio.run(main())
    assert rec.error is None and rec.done
    assert rec.lost() == 0 and increasing(seqs(rec)) and seqs(rec)[-1] == final_seq(url, str(info["id"]))
    metrics = httpx.get(url + "/metrics").text
    assert f'tokenfan_chunks_sent_total{{transport="{transport}"}}' in metrics


@pytest.mark.parametrize("transport", ["sse-h3", "wt"])
def test_resume_after_dropped_connection_with_last_event_id(h3_gateway: tuple[str, int], transport: str) -> None:
    """Read part of a stream, drop the whole QUIC connection, reconnect and resume after the last event
    seen: every event exactly once, in order."""
    url, port = h3_gateway
    info = create_stream(url, 40)
    target = f"/v1/streams/{info['id']}/events"

    async def main() -> tuple[Recorder, Recorder]:
        first, rest = Recorder(0, time.time_ns()), Recorder(0, time.time_ns())
        origin = QuicOrigin("127.0.0.1", port, None)
        client = await origin.client()
        reading = asyncio.ensure_future(read_events(client, transport, origin.authority, target, first))
        while len(first.rows) < 5:
            await asyncio.sleep(0.01)
            assert not reading.done(), first.error
        await origin.close()  # the connection goes away mid-stream
        with pytest.raises(ConnectionError):
            await reading
        last = seqs(first)[-1]
        origin = QuicOrigin("127.0.0.1", port, None)
        try:
            await read_events(await origin.client(), transport, origin.authority, target, rest, last_event_id=last)
        finally:
            await origin.close()
        return first, rest

    first, rest = asyncio.run(main())
    assert rest.error is None and rest.done
    got = seqs(first) + seqs(rest)
    # a lagging reader gets merged events (one seq standing for several deltas): count deltas, not events
    assert increasing(got) and got[0] == 0 and got[-1] == final_seq(url, str(info["id"]))
    assert got[-1] + 1 == all_deltas(first.rows + rest.rows)  # nothing lost, nothing repeated


def test_chat_completions_stream_over_http3_and_webtransport(h3_gateway: tuple[str, int]) -> None:
    """POST /v1/chat/completions with stream: the same ``data:`` lines over HTTP/3 and over a
    WebTransport stream, ending with ``[DONE]``."""
    _, port = h3_gateway
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
                         "ignore_eos": True})

    async def main() -> list[tuple[int, dict[str, str], list[bytes]]]:
        origin = QuicOrigin("127.0.0.1", port, None)
        out = []
        try:
            client = await origin.client()
            for wt in (False, True):
                if wt:
                    await client.open_session(origin.authority)
                    _, resp = client.wt_request(RequestHead("POST", "/v1/chat/completions",
                                                            {"content-type": "application/json"}), body)
                else:
                    _, resp = client.request("POST", origin.authority, "/v1/chat/completions",
                                             {"content-type": "application/json"}, body)
                await resp.done
                dec = SseDecoder()
                out.append((resp.status or 0, resp.headers, [ev.data for ev in dec.feed(b"".join(resp.chunks))]))
        finally:
            await origin.close()
        return out

    for status, headers, events in asyncio.run(main()):
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert events[-1] == b"[DONE]"
        text = "".join(orjson.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                       if orjson.loads(e)["choices"])
        assert len(text) > 0


def test_webtransport_bad_head_and_limits_answer_openai_errors(h3_gateway: tuple[str, int]) -> None:
    """A malformed request head gets 400; a fourth subscription from one client gets the same
    ``client_subscription_limit`` 429 as over TCP (the gateway runs with a limit of 3)."""
    url, port = h3_gateway
    info = create_stream(url, 200)
    target = f"/v1/streams/{info['id']}/events"

    async def main() -> tuple[int | None, bytes, list[int | None], bytes]:
        origin = QuicOrigin("127.0.0.1", port, None)
        try:
            client = await origin.client()
            await client.open_session(origin.authority)
            sid = client.open_wt_stream()
            bad = client.responses[sid] = Response()
            client._quic.send_stream_data(sid, b"not json\n", end_stream=True)
            client.transmit()
            await bad.done
            resps = []
            for _ in range(4):
                _, resp = client.wt_request(RequestHead("GET", target, {}))
                resps.append(resp)
                while resp.status is None:
                    await asyncio.sleep(0.01)
            over = [r for r in resps if r.status != 200]
            if over:
                await over[0].done
            return bad.status, b"".join(bad.chunks), [r.status for r in resps], \
                b"".join(over[0].chunks) if over else b""
        finally:
            await origin.close()

    bad_status, bad_body, statuses, over_body = asyncio.run(main())
    assert bad_status == 400 and orjson.loads(bad_body)["error"]["code"] == "invalid_request"
    assert statuses[:3] == [200, 200, 200] and statuses[3] == 429
    assert orjson.loads(over_body)["error"]["code"] == "client_subscription_limit"


def test_webtransport_session_from_a_foreign_origin_is_refused(h3_gateway: tuple[str, int]) -> None:
    """As for a WebSocket: a page of another site gets 403; the gateway's own host on another port passes."""
    _, port = h3_gateway

    async def main() -> tuple[str, int]:
        origin = QuicOrigin("127.0.0.1", port, None)
        try:
            client = await origin.client()
            with pytest.raises(ConnectionError) as refused:
                await client.open_session(origin.authority, origin="https://evil.example")
        finally:
            await origin.close()
        origin = QuicOrigin("127.0.0.1", port, None)
        try:
            client = await origin.client()
            return str(refused.value), await client.open_session(origin.authority, origin="http://127.0.0.1:8000")
        finally:
            await origin.close()

    refused, session = asyncio.run(main())
    assert "HTTP 403" in refused and session >= 0


def test_gateway_refuses_http3_without_a_certificate(tmp_path: Path) -> None:
    from tests.procs import spawn

    proc = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", f"ipc://{tmp_path / 'none.sock'}",
                  "--port", str(free_port()), "--http3-port", str(free_port())], "gateway-h3-nocert")
    try:
        assert proc.popen.wait(30) != 0
    finally:
        proc.stop()
    assert "--http3-port needs a certificate" in proc.log_path.read_text()


# -- the bench's sse-h3 and wt arms ------------------------------------------------------------------

BENCH_RUN = ["--streams", "8", "--duration", "2", "--max-tokens", "40", "--ramp", "0.5", "--no-progress"]


@pytest.fixture(scope="module")
def delayed_h3_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(TCP URL, HTTP/3 URL) of a gateway whose every WebTransport write sleeps 1 ms (bench calibration)."""
    from tokenfan_bench.clients.quic import h3_gateway_args

    d = tmp_path_factory.mktemp("h3-bench")
    address = f"ipc://{d / 'engine.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "50",
                          "--synthetic-ttft-ms", "20", name="engine-h3-bench")
    args, h3_url = h3_gateway_args(d / "tls")
    try:
        gateway, url = start_gateway(address, *args, "--inject-delay", "wt:1", "--max-subscriptions-per-client", "0",
                                     "--max-connections-per-client", "0", name="gateway-h3-bench")
    except BaseException:
        engine.stop()
        raise
    yield url, h3_url
    stop_all([gateway, engine])


def bench(out: Path, *args: str) -> dict[str, object]:
    import json

    from tokenfan_bench.cli import main as bench_main

    assert bench_main([*args, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.alone  # reads time: no other test runs beside it (tests/conftest.py)
def test_bench_quic_arms_recover_an_injected_1ms_webtransport_delay(delayed_h3_gateway: tuple[str, str],
                                                                     tmp_path: Path) -> None:
    url, h3 = delayed_h3_gateway
    r, applied = with_applied_delay(
        url, "wt", lambda: bench(tmp_path, "--url", url, "--h3-url", h3, "--arms", "sse-h3,wt", *BENCH_RUN))
    d = r["diff_ms"]
    assert isinstance(d, dict) and d["paired"]
    # an asyncio.sleep(0.001) lasts 1.1-2 ms on 2 busy cores: the gateway times each one (applied)
    assert applied["n"] > 0 and abs(d["median"] - applied["median_ms"]) < 0.6, (d, applied)
    lo, hi = d["ci95"]
    assert 0.3 < lo <= d["median"] <= hi, d
    arms = r["arms"]
    assert isinstance(arms, dict) and arms["A"]["errors"] == 0 and arms["B"]["errors"] == 0


@pytest.mark.parametrize("arms", ["sse-h3,sse-h3", "wt,wt"])
def test_bench_quic_aa_interval_contains_zero(delayed_h3_gateway: tuple[str, str], tmp_path: Path,
                                              arms: str) -> None:
    url, h3 = delayed_h3_gateway
    r = bench(tmp_path, "--url", url, "--h3-url", h3, "--arms", arms, *BENCH_RUN)
    d = r["diff_ms"]
    assert isinstance(d, dict)
    lo, hi = d["ci95"]
    assert lo <= 0.0 <= hi, d


# -- Chromium over WebTransport ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def wt_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """(TCP URL, the page's WebTransport endpoint) of a gateway with a 13-day self-signed certificate."""
    from gateway.http.certs import sha256_of

    d = tmp_path_factory.mktemp("wt-browser")
    cert, key = generate(d / "certs", days=13)
    address = f"ipc://{d / 'engine.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                          "--synthetic-tokens-per-s", "100", name="engine-wt-browser")
    port = free_port()
    try:
        gateway, url = start_gateway(address, "--http3-port", str(port), "--http3-certfile", str(cert),
                                     "--http3-keyfile", str(key), "--max-subscriptions-per-client", "0",
                                     name="gateway-wt-browser")
    except BaseException:
        engine.stop()
        raise
    yield url, {"url": f"https://127.0.0.1:{port}/v1/wt", "hash": sha256_of(cert)}
    stop_all([gateway, engine])


def test_chromium_reads_tokens_over_webtransport_on_the_ab_page(wt_gateway: tuple[str, dict[str, str]]) -> None:
    """Headless Chromium, on the /ab page's browser arm, reads fan-out streams over WebTransport (a
    self-signed certificate accepted by its hash) and over EventSource: every stream complete, the same
    text for the same seed, and the gateway counts the WebTransport chunks under their own label."""
    from tests.system import require
    from tokenfan_bench.clients.browser import CHROMIUM, run_browser

    require(CHROMIUM)
    url, endpoint = wt_gateway
    r = run_browser(url, ("es", "wt"), streams=2, rounds=2, max_tokens=12, separate=False, wt=endpoint,
                    n_boot=100)
    arms = r["arms"]
    assert arms["B"]["transport"] == "browser-wt"
    assert arms["A"]["errors"] == 0 and arms["B"]["errors"] == 0, arms["B"]["error_examples"]
    assert arms["B"]["subscribers"] == 4 and arms["B"]["content_events"] > 0
    assert r["browser"]["texts_identical"]  # WebTransport read the same text as EventSource, seed by seed
    metrics = httpx.get(url + "/metrics").text
    assert 'tokenfan_chunks_sent_total{transport="wt"}' in metrics
