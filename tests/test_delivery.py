"""The one-pass token path and its accounting, without a gateway: a real ZeroMQ engine link, real
:class:`gateway.core.generation.Generation` / :class:`gateway.core.streams.Stream` / :class:`gateway.core.delivery.Reader`,
connections over real loopback sockets with uvicorn's own flow control, and an injected clock."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine_worker import protocol as p
from gateway.api.chat_render import ChatRenderer, ChunkTemplate
from gateway.api.chat_request import ChunkBuilder
from gateway.api.openai.framing import OPENAI_SSE, MuxWs
from gateway.core.backpressure import SlowConsumerPolicy
from gateway.core.conn import HttpConn, WsConn
from gateway.core.delivery import Reader, ReaderMeter
from gateway.core.engine_client import EngineClient
from gateway.core.engine_link import EngineLink
from gateway.core.follow import Watchdog, follow
from gateway.core.generation import Generation
from gateway.core.metrics import (
    _LAT_BUCKETS,
    INJECTED_DELAY,
    DeliveryCollector,
    HotCounter,
    HotHistogram,
    TransportMetrics,
)
from gateway.core.request import RequestHandle
from gateway.core.sse import decode
from gateway.core.step import Step
from gateway.core.streams import ChunkEvent, Event, Stream
from gateway.errors import APIError
from tests.test_engine_client import FakeEngine, run, submit, until
from tokenfan_bench.cpu.step_pass_cost import SCOPE, HttpCycle, WsProto


class Clock:
    """An injected step clock: (monotonic s, epoch ns), advanced by the test."""

    def __init__(self) -> None:
        self.now = 100.0
        self.wall_ns = 1_000_000_000_000

    def __call__(self) -> tuple[float, int]:
        return self.now, self.wall_ns

    def advance(self, s: float) -> None:
        self.now += s
        self.wall_ns += int(s * 1e9)


class Peer:
    """The client end of a real loopback connection: everything the server side wrote."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    async def read(self, until_bytes: int) -> bytes:
        loop = asyncio.get_running_loop()
        while len(self.data) < until_bytes:
            self.data += await loop.sock_recv(self.sock, 1 << 16)
        return self.data


class ServerSide(asyncio.Protocol):
    """The server end: only its transport is used."""


async def loopback() -> tuple[asyncio.Transport, Peer]:
    a, b = socket.socketpair()
    b.setblocking(False)
    transport, _ = await asyncio.get_running_loop().create_connection(ServerSide, sock=a)
    return transport, Peer(b)  # type: ignore[return-value]


def builder(rid: str = "chatcmpl-1", include_usage: bool = False) -> ChunkBuilder:
    return ChunkBuilder("chat.completions", rid, "m", include_usage=include_usage)


def metrics() -> TransportMetrics:
    return TransportMetrics()


def test_the_template_renders_the_builders_own_bytes_for_any_text() -> None:
    for endpoint in ("chat.completions", "completions"):
        for usage in (False, True):
            b = ChunkBuilder(endpoint, "id-1", "m\"odel", include_usage=usage)  # type: ignore[arg-type]
            t = ChunkTemplate(b)
            for text in ("", "hi", " \"quoted\"\n", "é\u2028\x00", "\\"):
                assert t.render(text) == orjson.dumps(b.delta_chunk(text, None))


def test_hot_histogram_exports_what_prometheus_clients_histogram_does() -> None:
    values = [0.0, 0.0005, 0.0007, 0.001, 0.05, 0.3, 2.0, 31.0, 0.02, 0.0199]
    ref = CollectorRegistry()
    h = Histogram("x", "x", buckets=_LAT_BUCKETS, registry=ref)
    hot = HotHistogram()
    for v in values:
        h.observe(v)
        hot.observe(v)
    family = next(iter(ref.collect()))
    expected = {s.labels["le"]: s.value for s in family.samples if s.name == "x_bucket"}
    assert dict(hot.buckets()) == expected
    assert abs(hot.sum - sum(values)) < 1e-12


def test_collector_exports_the_hot_counters_under_the_documented_names() -> None:
    c = DeliveryCollector()
    c.transports["ws"].chunks.inc(3)
    c.tokens.inc(7)
    reg = CollectorRegistry()
    reg.register(c)
    text = generate_latest(reg).decode()
    assert 'tokenfan_chunks_sent_total{transport="ws"} 3.0' in text
    assert "tokenfan_tokens_generated_total 7.0" in text
    assert 'tokenfan_inter_token_latency_seconds_count{transport="sse"} 0.0' in text
    assert INJECTED_DELAY not in text  # only a gateway started with --inject-delay times its sleeps


def test_an_injected_delay_is_timed_once_per_write_of_the_readers_loop() -> None:
    """``--inject-delay``: each write of the reader's own loop sleeps first, and that sleep is observed
    into the transport's injected-delay histogram (one per write, however many chunks it carries)."""

    async def main() -> None:
        c = DeliveryCollector()
        c.inject({"sse": 0.001})
        transport, _peer = await loopback()
        conn = HttpConn(SCOPE, HttpCycle(transport).send, linger=1.0)
        reader = Reader(OPENAI_SSE, conn, ReaderMeter(metrics(), 0.0), delay=0.001, slept=c.injected["sse"])
        ev = [Event(i, {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]},
                    {"seq": i, "emit_ns": 0}, f"t{i}", None) for i in range(3)]
        await reader.write(ev[:2])
        await reader.write(ev[2:])
        h = c.injected["sse"]
        assert sum(h.counts) == 2 and h.sum > 0
        transport.close()

    asyncio.run(main())


def test_a_reader_counts_each_chunk_once_and_measures_gaps_across_both_paths() -> None:
    """The first content chunk goes out in the publisher's pass, later ones from the reader's own loop
    (and back): one TTFT, one chunk each, and every gap from the previous content write."""

    async def main() -> None:
        clock = Clock()
        m = metrics()
        meter = ReaderMeter(m, t0=clock.now - 0.5)
        transport, _peer = await loopback()
        cycle = HttpCycle(transport)
        conn = HttpConn(SCOPE, cycle.send, linger=1.0)
        reader = Reader(OPENAI_SSE, conn, meter, clock=clock)
        ev = [Event(i, {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]},
                    {"seq": i, "emit_ns": clock.wall_ns}, f"t{i}", None) for i in range(4)]

        clock.advance(0.010)
        assert reader.write_now(ev[0], Step(*clock()))  # direct, inside a step; flushed by the step
        clock.advance(0.020)
        await reader.write([ev[1], ev[2]])  # the reader's own loop: one write of two chunks
        clock.advance(0.030)
        step = Step(*clock())
        assert reader.write_now(ev[3], step)
        step.flush()

        assert m.chunks.value == 4
        assert m.ttft.counts[bisect(0.51)] == 1 and sum(m.ttft.counts) == 1
        gaps = [b for b, n in zip(_LAT_BUCKETS, m.itl.counts, strict=False) if n]
        assert sum(m.itl.counts) == 2 and abs(m.itl.sum - 0.050) < 1e-9  # 20 ms + 30 ms, not the stream
        assert gaps == [0.02, 0.05]
        assert sum(m.delivery.counts) == 3  # one observation per write
        transport.close()

    asyncio.run(main())


def dechunk(raw: bytes) -> bytes:
    """The body of the complete HTTP/1.1 chunks in ``raw``."""
    body = b""
    while b"\r\n" in raw:
        size, _, rest = raw.partition(b"\r\n")
        n = int(size, 16)
        if len(rest) < n + 2:
            break
        body, raw = body + rest[:n], rest[n + 2:]
    return body


def bisect(v: float) -> int:
    from bisect import bisect_left

    return bisect_left(_LAT_BUCKETS, v)


def test_http_direct_writes_of_one_step_are_one_chunk_and_stop_at_the_high_water_mark() -> None:
    async def main() -> None:
        transport, peer = await loopback()
        cycle = HttpCycle(transport)
        conn = HttpConn(SCOPE, cycle.send, linger=1.0)
        step = Step(0.0, 0)
        assert conn.write_now(b"data: a\n\n", step) and conn.write_now(b"data: b\n\n", step)
        await asyncio.sleep(0)
        assert peer.data == b""  # nothing written before the step's flush
        step.flush()
        assert await peer.read(24) == b"12\r\ndata: a\n\ndata: b\n\n\r\n"  # one chunk, both frames
        cycle.flow.pause_writing()  # what uvicorn does above the transport's high-water mark
        assert not conn.write_now(b"data: c\n\n", None)
        cycle.flow.resume_writing()
        assert conn.write_now(b"data: c\n\n", None)  # outside a step: written at once
        assert (await peer.read(24 + 14))[24:] == b"9\r\ndata: c\n\n\r\n"
        transport.close()

    asyncio.run(main())


def test_a_connection_without_uvicorns_flow_control_never_takes_direct_writes() -> None:
    async def main() -> None:
        async def send(message: dict[str, Any]) -> None:
            pass

        assert not HttpConn({}, send, linger=1.0).write_now(b"x", None)  # no server port
        assert not WsConn({}, send, linger=1.0).write_now(b"x", None)
        assert not HttpConn(SCOPE, send, linger=1.0).write_now(b"x", None)  # a port, not its server's send
        assert not WsConn(SCOPE, send, linger=1.0).write_now(b"x", None)

    asyncio.run(main())


def ws_messages(data: bytes) -> list[bytes]:
    out = []
    while data:
        n = data[1] & 0x7F
        head = 2
        if n == 126:
            n, head = int.from_bytes(data[2:4], "big"), 4
        assert data[0] == 0x81  # FIN + text, unmasked
        out.append(data[head:head + n])
        data = data[head + n:]
    return out


def engine_link_test(body: Callable[[EngineClient, FakeEngine, Clock], Awaitable[None]]) -> None:
    async def main(address: str) -> None:
        engine = FakeEngine(address, "e1")
        clock = Clock()
        client = EngineClient(address, heartbeat_interval=0.05, clock=clock)
        await client.start()
        try:
            await until(lambda: client.healthy, "the first heartbeat")
            await body(client, engine, clock)
        finally:
            await client.close()
            await engine.kill()

    run(main)


def test_one_engine_step_is_one_pass_and_one_write_per_connection() -> None:
    """Two generations multiplexed on one WebSocket (as on /v1/ws): the deltas of one DeltaBatch are
    rendered, appended, written in the engine link's pass and leave in one transport write, each as
    the same chunk the builder makes; the step's clock stamps every event."""

    async def body(client: EngineClient, engine: FakeEngine, clock: Clock) -> None:
        transport, peer = await loopback()
        writes: list[int] = []
        real_write = transport.write

        def counted(data: Any) -> None:
            writes.append(1)
            real_write(data)

        transport.write = counted  # type: ignore[method-assign]
        conn = WsConn(SCOPE, WsProto(transport).send, linger=1.0)
        assert conn._writer is not None
        tokens = HotCounter()
        m = metrics()
        readers = []
        builders: dict[str, ChunkBuilder] = {}
        for rid in ("a", "b"):
            handle = client.submit(submit(rid))
            stream = Stream(rid, "chat.completions", "m", listed=False)
            builders[rid] = builder(rid)
            gen = Generation(stream, handle, ChatRenderer(builders[rid]), tokens)
            gen.start()
            reader = Reader(MuxWs(rid), conn, ReaderMeter(m, clock.now), clock=clock)
            policy = SlowConsumerPolicy()

            async def write(batch: list[Event], reader: Reader = reader) -> None:
                await reader.write(batch)

            task = asyncio.create_task(follow(stream, "ws", -1, write, policy, Watchdog(10, None), reader=reader))
            readers.append((stream, task))
        await asyncio.sleep(0.01)  # both readers parked, caught up
        await engine.send(p.DeltaBatch(deltas=[p.Delta("a", 0, "Hel", 1, 5), p.Delta("b", 0, "Wor", 1, 6)]))
        await until(lambda: all(len(s.events) == 2 for s, _ in readers), "the step's events")
        assert len(writes) == 1  # one write for the connection's whole step
        data = await peer.read(1)
        while len(ws_messages(data)) < 4:
            data = await peer.read(len(data) + 1)
        msgs = [orjson.loads(x) for x in ws_messages(data)]
        assert [(x["id"], x["data"]["choices"][0]["delta"]) for x in msgs] == [
            ("a", {"role": "assistant", "content": ""}), ("a", {"content": "Hel"}),
            ("b", {"role": "assistant", "content": ""}), ("b", {"content": "Wor"})]
        assert msgs[1]["data"] == builders["a"].delta_chunk("Hel", None)  # same builder: same "created" second
        assert {ev.timing["sent_ns"] for s, _ in readers for ev in s.events} == {clock.wall_ns}
        assert m.chunks.value == 4 and tokens.value == 2
        assert all(s.events[-1].seq == 1 for s, _ in readers)
        await engine.send(p.DeltaBatch(deltas=[p.Delta("a", 1, "!", 1, 7, "stop", p.Usage(1, 2)),
                                               p.Delta("b", 1, "", 1, 8, "length", p.Usage(1, 2))]))
        assert [await t for _, t in readers] == [2, 2]  # each reader followed to the end: seq 0..2
        assert [s.state for s, _ in readers] == ["done", "done"]
        transport.close()

    engine_link_test(body)


def test_a_reader_behind_the_tail_is_woken_not_written_by_the_pass() -> None:
    """A reader whose transport is paused (above the high-water mark) gets nothing in the pass; its own
    loop sends what it missed, in order, once it can."""

    async def main() -> None:
        clock = Clock()
        transport, peer = await loopback()
        cycle = HttpCycle(transport)
        conn = HttpConn(SCOPE, cycle.send, linger=1.0)
        stream = Stream("s", "chat.completions", "m", listed=False)
        m = metrics()
        reader = Reader(OPENAI_SSE, conn, ReaderMeter(m, clock.now), clock=clock)
        task = asyncio.create_task(follow(stream, "sse", -1, reader.write, SlowConsumerPolicy(),
                                          Watchdog(10, None), reader=reader))
        await asyncio.sleep(0)
        gen_builder = builder()
        renderer = ChatRenderer(gen_builder)
        cycle.flow.pause_writing()
        for ev in renderer.step(p.Delta("s", 0, "x", 1, 1)):
            stream.publish(ev, Step(*clock()))
        assert peer.data == b""
        cycle.flow.resume_writing()
        for ev in renderer.step(p.Delta("s", 1, "y", 1, 2, "stop", p.Usage(1, 2))):
            stream.publish(ev, None)
        stream.finish("done")
        assert await task == 2
        raw = await peer.read(1)
        while (body := dechunk(raw)).count(b"\n\n") < 3:
            raw = await peer.read(len(raw) + 1)
        texts = [orjson.loads(e.data)["choices"][0]["delta"].get("content") for e in decode(body)]
        assert texts == ["", "x", "y"]
        assert m.chunks.value == 3
        transport.close()

    asyncio.run(main())


class Closing:
    """A renderer with closing events (as the Responses API's), to see them appended on failure and cancel."""

    def __init__(self) -> None:
        self.chat = ChatRenderer(builder())

    def opening(self) -> list[ChunkEvent]:
        return [ChunkEvent({"type": "opened"}, 1, "", 0)]

    def step(self, d: p.Delta) -> list[ChunkEvent]:
        return self.chat.step(d)

    def closing(self, err: APIError | None) -> list[ChunkEvent]:
        return [ChunkEvent({"type": "failed" if err else "cancelled"}, 1, "", 0)]


def test_deltas_that_arrived_before_the_generation_attached_are_rendered_in_order_then_live_ones() -> None:
    async def main() -> None:
        handle = RequestHandle(EngineLink("ipc:///nonexistent"),
                               p.Submit("r", "chat.completions", p.Sampling(), trace_id="t"))
        step = Step(1.0, 2)
        handle.push(p.Delta("r", 0, "a", 1, 5), step)  # queued: no generation yet
        stream = Stream("r", "chat.completions", "m", listed=False)
        tokens = HotCounter()
        gen = Generation(stream, handle, Closing(), tokens)
        gen.start()
        handle.push(p.Delta("r", 1, "b", 1, 6, "stop", p.Usage(1, 2)), step)
        assert [e.payload.get("type") or e.payload["choices"][0]["delta"] for e in stream.events] == [
            "opened", {"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
        assert stream.state == "done" and gen.ended.result() is None and tokens.value == 2

    asyncio.run(main())


def test_a_failed_or_cancelled_generation_appends_its_closing_events_then_ends_once() -> None:
    async def main() -> None:
        for cancel in (False, True):
            handle = RequestHandle(EngineLink("ipc:///nonexistent"),
                                   p.Submit("r", "chat.completions", p.Sampling(), trace_id="t"))
            stream = Stream("r", "chat.completions", "m", listed=False)
            gen = Generation(stream, handle, Closing(), HotCounter())
            gen.start()
            handle.push(p.Delta("r", 0, "a", 1, 5), Step(1.0, 2))
            err = APIError(503, "engine gone", code="engine_unavailable")
            if cancel:
                gen.cancel()
            else:
                handle.fail(err)
            gen.on_failure(err)  # a second end changes nothing
            kinds = [e.payload.get("type") for e in stream.events]
            assert kinds == ["opened", None, None, "cancelled" if cancel else "failed"]
            assert stream.state == ("cancelled" if cancel else "error")
            assert gen.ended.cancelled() if cancel else gen.ended.result() is err

    asyncio.run(main())
