"""OpenTelemetry traces on the synthetic engine (real processes, an OTLP/HTTP receiver in the test): a request's
``traceparent`` becomes the parent of its generation's span on every route, the span carries the GenAI attributes
and the events of what happened to the stream (first token, migration from a killed engine, a reader's resume, a
client's cancel), the engine's ``engine.accept`` spans join the trace, fan-out readers get linked spans, and the
access log names the trace and span. The vLLM variant (vLLM's own request spans) is test_vllm_tracing.py."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets.sync.client

from gateway.http.certs import generate
from gateway.http3.wire import RequestHead
from tests.e2e.helpers import sse_events, wait_until
from tests.e2e.test_adoption import LEASE
from tests.e2e.test_broker import RedisServer
from tests.otlp import Receiver, Span, named, traceparent
from tests.procs import NO_CLIENT_LIMITS, Proc, start_engine, start_gateway, stop_all
from tests.system import require
from tokenfan_bench.clients.quic import QuicOrigin
from tokenfan_bench.servers.processes import free_port

# the batch processors export every 100 ms (default 5 s): the test waits for spans, not for the batch
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "25", "--synthetic-ttft-ms", "5")


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(receiver: Receiver, ipc_dir: Path) -> Iterator[tuple[str, list[Proc], list[str]]]:
    """Two traced synthetic engines behind one traced gateway (access log on): its URL, the engines, their
    addresses."""
    addresses = [f"ipc://{ipc_dir / f'traced-{k}.sock'}" for k in range(2)]
    engines = [start_engine(a, *ENGINE_ARGS, "--otlp-traces-endpoint", receiver.endpoint, name=f"engine-traced-{k}",
                            env=FAST_EXPORT) for k, a in enumerate(addresses)]
    try:
        gateway, url = start_gateway(",".join(addresses), "--otlp-traces-endpoint", receiver.endpoint,
                                     "--log-level", "info", "--heartbeat-timeout", "30", *NO_CLIENT_LIMITS,
                                     name="gateway-traced", env=FAST_EXPORT)
    except BaseException:
        stop_all(engines)
        raise
    wait_until(lambda: all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]), 30, "both engines")
    yield url, engines, addresses
    stop_all([gateway, *engines])


def new_parent() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def chat(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": True, **extra}


def generation(receiver: Receiver, trace_id: str, what: str) -> Span:
    spans = receiver.wait(lambda ss: any(s.name.startswith("chat ") for s in ss), what=what, trace_id=trace_id)
    (span,) = [s for s in spans if s.name.startswith("chat ")]
    return span


def test_a_streamed_chat_with_a_traceparent_is_one_generation_span_under_it_with_the_engines_span_below(
        traced: tuple[str, list[Proc], list[str]], receiver: Receiver) -> None:
    url, _, _ = traced
    trace_id, parent = new_parent()
    r = httpx.post(url + "/v1/chat/completions", json=chat(8), headers={"traceparent": traceparent(trace_id, parent)},
                   timeout=30)
    assert r.status_code == 200 and "[DONE]" in r.text
    gen = generation(receiver, trace_id, "the generation's span")
    assert gen.parent_id == parent and gen.service == "tokenfan-gateway"
    a = gen.attributes
    assert a["gen_ai.request.model"] == "synthetic" and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.usage.output_tokens"] == 8 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["tokenfan.migrations"] == 0
    assert gen.event("first_token").attributes["tokenfan.ttft_s"] > 0
    accept = receiver.wait(lambda ss: any(s.name == "engine.accept" for s in ss), trace_id=trace_id,
                           what="the engine's span")
    (engine_span,) = named(accept, "engine.accept")
    assert engine_span.parent_id == gen.span_id and engine_span.service == "tokenfan-engine"
    assert engine_span.attributes["gen_ai.response.id"] == a["gen_ai.response.id"]


def test_the_access_log_names_the_generations_trace_and_span(traced: tuple[str, list[Proc], list[str]],
                                                                receiver: Receiver) -> None:
    url, _, _ = traced
    trace_id, parent = new_parent()
    rid = "trace-log-" + secrets.token_hex(4)
    httpx.post(url + "/v1/chat/completions", json=chat(2),
               headers={"traceparent": traceparent(trace_id, parent), "x-request-id": rid}, timeout=30)
    gen = generation(receiver, trace_id, "the generation's span")
    gateway_log = next(p for p in Path("test-artifacts").glob("gateway-traced-*.log") if rid in p.read_text())

    def line() -> dict[str, object] | None:
        rows = [json.loads(x.split(": ", 1)[1]) for x in gateway_log.read_text().splitlines()
                if "tokenfan.access" in x and rid in x]
        return rows[0] if rows else None

    wait_until(lambda: line() is not None, 10, "the access log line")
    row = line()
    assert row is not None and (row["trace_id"], row["span_id"]) == (trace_id, gen.span_id)
    # no generation (a 404): the request's own traceparent
    other, parent2 = new_parent()
    httpx.get(url + "/v1/streams/str-nothere", headers={"traceparent": traceparent(other, parent2), "x-request-id": rid + "b"})
    wait_until(lambda: rid + "b" in gateway_log.read_text(), 10, "the 404's access log line")
    row404 = next(json.loads(x.split(": ", 1)[1]) for x in gateway_log.read_text().splitlines() if rid + "b" in x)
    assert (row404["trace_id"], row404["span_id"]) == (other, parent2)


def test_websocket_requests_join_the_handshakes_trace(traced: tuple[str, list[Proc], list[str]],
                                                      receiver: Receiver) -> None:
    url, _, _ = traced
    trace_id, parent = new_parent()
    with websockets.sync.client.connect(url.replace("http", "ws") + "/v1/ws",
                                        additional_headers={"traceparent": traceparent(trace_id, parent)}) as ws:
        ws.send(json.dumps({"type": "request", "id": "a", "endpoint": "chat.completions", "body": chat(3)}))
        while True:
            msg = json.loads(ws.recv(timeout=30))
            if msg.get("type") in ("done", "error"):
                break
    gen = generation(receiver, trace_id, "the WebSocket request's span")
    assert gen.parent_id == parent and gen.attributes["gen_ai.usage.output_tokens"] == 3


def test_a_client_that_leaves_mid_stream_is_a_cancel_event(traced: tuple[str, list[Proc], list[str]],
                                                           receiver: Receiver) -> None:
    url, _, _ = traced
    trace_id, parent = new_parent()
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat(200),
                      headers={"traceparent": traceparent(trace_id, parent)}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                break
    gen = generation(receiver, trace_id, "the cancelled generation's span")
    gen.event("cancel")
    assert gen.attributes["gen_ai.response.finish_reasons"] == ["cancelled"]


def test_fanout_readers_get_spans_linked_to_the_generation_and_a_resume_is_an_event(
        traced: tuple[str, list[Proc], list[str]], receiver: Receiver) -> None:
    url, _, _ = traced
    trace_id, parent = new_parent()
    created = httpx.post(url + "/v1/streams", json=chat(10), headers={"traceparent": traceparent(trace_id, parent)},
                         timeout=30).json()
    events_url = url + created["events_url"] if created["events_url"].startswith("/") else created["events_url"]
    first = httpx.get(events_url, timeout=30)
    assert "[DONE]" in first.text
    reader_trace, reader_parent = new_parent()  # a reader with a trace of its own: its span joins that one
    resumed = httpx.get(events_url, headers={"Last-Event-ID": "3",
                                             "traceparent": traceparent(reader_trace, reader_parent)}, timeout=30)
    assert next(e["id"] for e in sse_events(resumed.text) if "id" in e) == "4"
    gen = generation(receiver, trace_id, "the listed generation's span")
    assert gen.attributes["tokenfan.stream.listed"] is True
    readers = receiver.wait(lambda ss: len(list(named(ss, "stream.read"))) >= 1, trace_id=trace_id,
                            what="the first reader's span")
    (plain,) = named(readers, "stream.read")
    assert plain.parent_id == gen.span_id and (trace_id, gen.span_id) in plain.links
    own = receiver.wait(lambda ss: any(s.name == "stream.read" for s in ss), trace_id=reader_trace,
                        what="the resuming reader's span")
    (resuming,) = named(own, "stream.read")
    assert resuming.parent_id == reader_parent and (trace_id, gen.span_id) in resuming.links
    assert resuming.event("resume").attributes["tokenfan.reader.after"] == 3


def test_a_killed_engine_is_an_engine_lost_and_a_migration_event_with_both_engines_spans(
        traced: tuple[str, list[Proc], list[str]], receiver: Receiver) -> None:
    """The last test of the module: it kills one of the two engines."""
    url, engines, addresses = traced
    trace_id, parent = new_parent()
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat(50),
                      headers={"traceparent": traceparent(trace_id, parent)}, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {") and '"content"' in line:
                break
        accept = receiver.wait(lambda ss: any(s.name == "engine.accept" for s in ss), trace_id=trace_id,
                               what="the first engine's span")
        (first,) = named(accept, "engine.accept")
        victim = next(k for k, a in enumerate(addresses) if first.resource["tokenfan.engine.address"] == a)
        os.killpg(engines[victim].popen.pid, signal.SIGKILL)
        rest = "\n".join(lines)
    assert rest.strip().endswith("data: [DONE]") and "event: error" not in rest
    gen = generation(receiver, trace_id, "the migrated generation's span")
    lost, moved = gen.event("engine_lost"), gen.event("migration")
    assert lost.attributes["tokenfan.engine.address"] == addresses[victim]
    assert moved.attributes["tokenfan.migration.from"] == addresses[victim]
    assert moved.attributes["tokenfan.migration.to"] == addresses[1 - victim]
    assert 0 < moved.attributes["tokenfan.migration.gap_s"] < 10 and moved.attributes["tokenfan.migration.tokens"] > 0
    assert gen.attributes["tokenfan.migrations"] == 1 and gen.attributes["gen_ai.usage.output_tokens"] == 50
    spans = receiver.wait(lambda ss: len(list(named(ss, "engine.accept"))) == 2, trace_id=trace_id,
                          what="the second engine's span")
    second = next(s for s in named(spans, "engine.accept") if s.span_id != first.span_id)
    assert second.resource["tokenfan.engine.address"] == addresses[1 - victim]
    assert second.parent_id == first.parent_id == gen.span_id and second.attributes["tokenfan.resume.tokens"] > 0


@pytest.fixture
def replicas(receiver: Receiver, ipc_dir: Path, tmp_path: Path) -> Iterator[tuple[str, Proc, str]]:
    """Two traced gateways on one synthetic engine and a Redis broker: the owner's URL and process, the replica's."""
    require("redis-server")
    redis = RedisServer(tmp_path)
    redis.start()
    address = f"ipc://{ipc_dir / 'traced-replicas.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "20", "--synthetic-ttft-ms", "5",
                          "--otlp-traces-endpoint", receiver.endpoint, name="engine-traced-replicas", env=FAST_EXPORT)
    procs = [engine]
    try:
        urls = []
        for k in "ab":
            proc, url = start_gateway(address, "--broker", redis.url, *LEASE, *NO_CLIENT_LIMITS, "--otlp-traces-endpoint",
                                      receiver.endpoint, name=f"gateway-traced-{k}", env=FAST_EXPORT)
            procs.append(proc)
            urls.append(url)
        yield urls[0], procs[1], urls[1]
    finally:
        stop_all(procs)
        redis.kill()


def read_to_the_end(urls: list[str], sid: str, out: list[str]) -> None:
    """An EventSource: read; when the connection drops without an end, resume on the next URL with Last-Event-ID."""
    last: str | None = None
    for url in urls:
        r = httpx.get(f"{url}/v1/streams/{sid}/events", headers={"Last-Event-ID": last} if last else {}, timeout=60)
        out.append(r.text)
        ids = [e["id"] for e in sse_events(r.text) if "id" in e]
        last = ids[-1] if ids else last
        if "data: [DONE]" in r.text:
            return


def test_a_listed_stream_handed_to_a_replica_is_one_trace_of_owner_adopter_and_readers(
        replicas: tuple[str, Proc, str], receiver: Receiver) -> None:
    owner, owner_proc, replica = replicas
    trace_id, parent = new_parent()
    sid = httpx.post(owner + "/v1/streams", json=chat(60), headers={"traceparent": traceparent(trace_id, parent)},
                     timeout=30).json()["id"]
    on_owner: list[str] = []
    on_replica: list[str] = []
    readers = [threading.Thread(target=read_to_the_end, args=([owner, replica], sid, on_owner)),
               threading.Thread(target=read_to_the_end, args=([replica], sid, on_replica))]
    for t in readers:
        t.start()
    time.sleep(1.0)
    owner_proc.popen.send_signal(signal.SIGTERM)  # --handover: the replica adopts the stream from its log
    for t in readers:
        t.join(60)
    assert "data: [DONE]" in on_owner[-1] and "data: [DONE]" in on_replica[-1] and len(on_owner) == 2
    assert owner_proc.popen.wait(30) == 0  # its spans were exported at its shutdown

    def complete(ss: list[Span]) -> bool:
        return len(list(named(ss, "stream.read"))) == 3 and any(s.name == "stream.adopt" for s in ss) and \
            len(list(named(ss, "engine.accept"))) == 2 and any(s.name.startswith("chat ") for s in ss)

    spans = receiver.wait(complete, 30, "owner, adopter, readers and engine spans", trace_id)
    (gen,) = [s for s in spans if s.name.startswith("chat ")]
    (adopt,) = named(spans, "stream.adopt")
    assert gen.parent_id == parent and adopt.parent_id == gen.span_id
    assert gen.resource["service.instance.id"] != adopt.resource["service.instance.id"]  # two gateways
    moved = adopt.event("adoption").attributes
    assert moved["tokenfan.adoption.old_owner"] and moved["tokenfan.adoption.events"] > 0
    assert moved["tokenfan.adoption.old_owner"] != moved["tokenfan.adoption.new_owner"]
    accepts = {s.parent_id: s for s in named(spans, "engine.accept")}
    assert set(accepts) == {gen.span_id, adopt.span_id} and accepts[adopt.span_id].attributes["tokenfan.resume.tokens"] > 0
    reads = list(named(spans, "stream.read"))
    assert all((trace_id, gen.span_id) in r.links or (trace_id, adopt.span_id) in r.links for r in reads)
    by_gateway = {(r.resource["service.instance.id"], r.parent_id) for r in reads}
    assert (gen.resource["service.instance.id"], gen.span_id) in by_gateway  # the owner's own reader
    assert (adopt.resource["service.instance.id"], gen.span_id) in by_gateway  # the replica's mirror reader
    (resumed,) = [r for r in reads if any(e.name == "resume" for e in r.events)]
    # it came back to the replica with Last-Event-ID: under the adopter's span, or the owner's if it came back
    # while the replica still mirrored the stream
    assert resumed.parent_id in (adopt.span_id, gen.span_id)
    assert resumed.resource["service.instance.id"] == adopt.resource["service.instance.id"]


@pytest.fixture
def h3_traced(receiver: Receiver, ipc_dir: Path, tmp_path: Path) -> Iterator[int]:
    """A traced gateway serving HTTP/3 and WebTransport: its UDP port."""
    cert, key = generate(tmp_path / "certs", days=13)
    address = f"ipc://{ipc_dir / 'traced-h3.sock'}"
    engine = start_engine(address, *ENGINE_ARGS, name="engine-traced-h3")
    port = free_port()
    try:
        gateway, _ = start_gateway(address, "--http3-port", str(port), "--http3-certfile", str(cert),
                                   "--http3-keyfile", str(key), "--otlp-traces-endpoint", receiver.endpoint,
                                   name="gateway-traced-h3", env=FAST_EXPORT)
    except BaseException:
        engine.stop()
        raise
    yield port
    stop_all([gateway, engine])


def test_http3_and_webtransport_requests_join_their_traceparent(h3_traced: int, receiver: Receiver) -> None:
    parents = {wt: new_parent() for wt in (False, True)}
    body = json.dumps(chat(4)).encode()

    async def main() -> None:
        origin = QuicOrigin("127.0.0.1", h3_traced, None)
        try:
            client = await origin.client()
            for wt, (trace_id, parent) in parents.items():
                head = {"content-type": "application/json", "traceparent": traceparent(trace_id, parent)}
                if wt:
                    await client.open_session(origin.authority)
                    _, resp = client.wt_request(RequestHead("POST", "/v1/chat/completions", head), body)
                else:
                    _, resp = client.request("POST", origin.authority, "/v1/chat/completions", head, body)
                await resp.done
                assert b"data: [DONE]" in b"".join(resp.chunks)
        finally:
            await origin.close()

    asyncio.run(main())
    for trace_id, parent in parents.values():
        gen = generation(receiver, trace_id, "the HTTP/3 or WebTransport request's span")
        assert gen.parent_id == parent and gen.attributes["gen_ai.usage.output_tokens"] == 4
