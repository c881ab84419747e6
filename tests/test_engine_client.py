"""The engine link against an in-process fake engine (a real ZeroMQ ROUTER): engine identity and
typed failures. No engine process, no timing assertions."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from engine_worker import protocol as p
from gateway.core.engine_client import EngineClient
from gateway.core.engine_pool import EnginePool, MigrationPolicy
from gateway.core.request import RequestHandle
from gateway.errors import EngineError, to_api_error


class FakeEngine:
    """A ROUTER that answers pings with heartbeats of ``engine_id`` and records what it receives."""

    def __init__(self, address: str, engine_id: str) -> None:
        self.address = address
        self.engine_id = engine_id
        self.received: list[p.Message] = []
        self.hold_pings = False  # keep pings unanswered (in ``held``) until the test releases them
        self.held: list[tuple[bytes, p.Ping]] = []
        self.got = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.identity = b""
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            identity, *body = await self.sock.recv_multipart()
            self.identity = identity
            msg = p.decode(body)
            self.received.append(msg)
            self.got.set()
            if isinstance(msg, p.Ping):
                if self.hold_pings:
                    self.held.append((identity, msg))
                else:
                    await self.beat(identity, msg)

    async def beat(self, identity: bytes, ping: p.Ping) -> None:
        await self.send(p.Heartbeat(engine_id=self.engine_id, backend="fake", model="m", max_model_len=64,
                                    running=0, waiting=0, ping_sent_ns=ping.sent_ns, sent_ns=p.now_ns()),
                        identity)

    async def send(self, msg: p.Message, identity: bytes | None = None) -> None:
        await self.sock.send_multipart([identity or self.identity, *p.encode(msg)])

    async def wait_for(self, pred: Callable[[p.Message], bool]) -> p.Message:
        while True:
            for m in self.received:
                if pred(m):
                    return m
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), 10)

    async def kill(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)
        self._ctx.term()


def submit(rid: str) -> p.Submit:
    return p.Submit(request_id=rid, endpoint="completions", sampling=p.Sampling(max_tokens=4), prompt="x")


async def until(pred: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def run(test: Callable[[str], Awaitable[None]]) -> None:
    with tempfile.TemporaryDirectory(prefix="tf-ec-") as d:
        asyncio.run(asyncio.wait_for(test(f"ipc://{Path(d) / 'e.sock'}"), 30))


async def first_failure(handle: RequestHandle) -> BaseException:
    with pytest.raises(EngineError) as info:
        async for _ in handle.deltas():
            pass
    return info.value


def test_heartbeat_with_a_new_engine_id_fails_the_old_instances_requests_but_not_later_ones() -> None:
    async def main(address: str) -> None:
        engine = FakeEngine(address, "old")
        client = EngineClient(address, heartbeat_interval=0.05, heartbeat_timeout=30)
        await client.start()
        try:
            await until(lambda: client.healthy, "first heartbeat")
            released: list[str] = []
            old = [client.submit(submit(f"r{i}")) for i in range(3)]
            for h in old:
                h.on_close.append(lambda h=h: released.append(h.request_id))
            await engine.wait_for(lambda m: isinstance(m, p.Submit) and m.request_id == "r2")
            await engine.send(p.Accepted(request_id="r0", prompt_tokens=1))
            assert await old[0].wait_accepted(5) == 1

            # Same connection, new instance (what the monitor cannot see): hold its first heartbeat until a
            # request was sent after the ping it answers; that request reached the new instance and lives.
            engine.engine_id, engine.hold_pings = "new", True
            await until(lambda: bool(engine.held), "a ping for the new instance")
            later = client.submit(submit("later"))
            await engine.wait_for(lambda m: isinstance(m, p.Submit) and m.request_id == "later")
            identity, ping = engine.held[0]
            engine.hold_pings = False
            await engine.beat(identity, ping)

            for h in old:
                err = await first_failure(h)
                assert isinstance(err, EngineError) and err.code == "engine_unavailable"
                assert "restarted" in err.message
                h.close()
            with pytest.raises(EngineError):
                await old[1].wait_accepted(5)
            assert sorted(released) == ["r0", "r1", "r2"]  # admission slots come back through on_close
            api = to_api_error(err)
            assert (api.status, api.code, api.retry_after) == (503, "engine_unavailable", 1.0)

            abort = await engine.wait_for(lambda m: isinstance(m, p.Abort))
            assert isinstance(abort, p.Abort) and sorted(abort.request_ids) == ["r0", "r1", "r2"]
            assert client.in_flight == 1 and not later.done
            await engine.send(p.Accepted(request_id="later", prompt_tokens=2))
            await engine.send(p.DeltaBatch(deltas=[p.Delta(request_id="later", seq=0, text="ok", token_count=1,
                                                           emit_ns=p.now_ns(), finish_reason="stop")]))
            assert await later.wait_accepted(5) == 2
            assert [d.text async for d in later.deltas() if d is not None] == ["ok"]

            st = client.status()
            assert st["engine_id"] == "new" and st["previous_engine_id"] == "old" and st["restarts"] == 1
            assert isinstance(st["engine_changed_at"], float)
        finally:
            await client.close()
            await engine.kill()

    run(main)


def test_with_migration_off_a_dropped_connection_fails_in_flight_requests_at_once_and_a_restart_is_counted() -> None:
    async def main(address: str) -> None:
        engine = FakeEngine(address, "first")
        pool = EnginePool([address], heartbeat_interval=0.05, heartbeat_timeout=30,
                          migration=MigrationPolicy(limit=0))
        client = pool.clients[0]
        await pool.start()
        try:
            await until(lambda: pool.healthy, "first heartbeat")
            handles = [pool.submit(submit(f"q{i}")) for i in range(5)]
            await engine.wait_for(lambda m: isinstance(m, p.Submit) and m.request_id == "q4")
            waiter = asyncio.ensure_future(handles[0].wait_accepted(60))
            await engine.kill()  # what kill -9 looks like from here: the connection drops

            for h in handles[1:]:
                err = await first_failure(h)
                assert isinstance(err, EngineError) and err.code == "engine_unavailable"
            with pytest.raises(EngineError):
                await waiter
            assert client.in_flight == 0 and client.link.disconnects == 1
            assert not pool.healthy  # nothing is sent into the gap before the next heartbeat
            with pytest.raises(EngineError) as refused:
                pool.submit(submit("gap"))
            assert refused.value.code == "engine_unavailable"

            engine = FakeEngine(address, "second")
            await until(lambda: pool.healthy, "heartbeat of the new instance")
            [st] = pool.status()
            assert (st["engine_id"], st["previous_engine_id"], st["restarts"]) == ("second", "first", 1)
            h = pool.submit(submit("after"))
            await engine.wait_for(lambda m: isinstance(m, p.Submit) and m.request_id == "after")
            await engine.send(p.Accepted(request_id="after", prompt_tokens=3))
            assert await h.wait_accepted(5) == 3
        finally:
            await pool.close()
            await engine.kill()

    run(main)


def test_a_lost_request_continues_on_the_restarted_engine_from_the_tokens_delivered() -> None:
    """kill -9 of the only engine: the request waits for its restart, then is re-submitted as a continuation
    (same request, the output token ids and characters delivered so far, a new engine id); the deltas of the
    new instance reach the same handle, and the gap is counted."""
    async def main(address: str) -> None:
        engine = FakeEngine(address, "first")
        pool = EnginePool([address], heartbeat_interval=0.05, heartbeat_timeout=30,
                          migration=MigrationPolicy(limit=1, wait=20))
        await pool.start()
        try:
            await until(lambda: pool.healthy, "first heartbeat")
            h = pool.submit(p.Submit(request_id="q", endpoint="completions", prompt="x",
                                     sampling=p.Sampling(max_tokens=6, presence_penalty=0.0)))
            # deltas without token ids (an engine that does not report them): nothing to continue from
            unknown = pool.submit(p.Submit(request_id="pp", endpoint="completions", prompt="x",
                                           sampling=p.Sampling(max_tokens=6)))
            await engine.wait_for(lambda m: isinstance(m, p.Submit) and m.request_id == "pp")
            for rid in ("q", "pp"):
                await engine.send(p.Accepted(request_id=rid, prompt_tokens=3))
            await engine.send(p.DeltaBatch([p.Delta("q", 0, " a", 1, 1, token_ids=[7]),
                                            p.Delta("q", 1, " bé", 2, 2, token_ids=[8, 9]),
                                            p.Delta("pp", 0, " z", 1, 1)]))
            got = [await anext(aiter(h.deltas())) for _ in range(2)]
            assert [d.text for d in got] == [" a", " bé"]
            await engine.kill()
            err = await first_failure(unknown)
            assert isinstance(err, EngineError) and err.code == "engine_unavailable"

            engine = FakeEngine(address, "second")
            cont = await engine.wait_for(lambda m: isinstance(m, p.Submit))
            assert isinstance(cont, p.Submit)
            assert (cont.request_id, cont.resume, cont.resume_chars, cont.prompt) == ("q.m1", [7, 8, 9], 5, "x")
            assert cont.sampling == h.submit.sampling
            await engine.send(p.Accepted(request_id="q.m1", prompt_tokens=6))
            await engine.send(p.DeltaBatch([p.Delta("q.m1", 0, " c", 1, 3, "length", p.Usage(3, 4),
                                                    token_ids=[10])]))
            rest = [d async for d in h.deltas()]
            assert [d.text for d in rest] == [" c"] and rest[-1].finish_reason == "length"
            assert h.output_ids == [7, 8, 9, 10] and h.migrations == 1
            assert pool.migrations.outcomes == {"continued": 1, "refused": 1, "timeout": 0, "failed": 0}
            assert sum(pool.migrations.gap.counts) == 1
        finally:
            await pool.close()
            await engine.kill()

    run(main)


def test_a_lost_request_fails_when_no_engine_comes_back_within_the_wait() -> None:
    async def main(address: str) -> None:
        engine = FakeEngine(address, "only")
        pool = EnginePool([address], heartbeat_interval=0.05, heartbeat_timeout=30,
                          migration=MigrationPolicy(limit=3, wait=0.3))
        await pool.start()
        try:
            await until(lambda: pool.healthy, "first heartbeat")
            h = pool.submit(submit("q"))
            await engine.wait_for(lambda m: isinstance(m, p.Submit))
            await engine.send(p.Accepted(request_id="q", prompt_tokens=3))
            await engine.kill()
            err = await first_failure(h)
            assert isinstance(err, EngineError) and err.code == "engine_unavailable" and "within 0.3s" in err.message
            assert pool.migrations.outcomes["timeout"] == 1
        finally:
            await pool.close()

    run(main)


def test_engine_error_message_is_typed_and_mapped_only_at_the_edge() -> None:
    async def main(address: str) -> None:
        engine = FakeEngine(address, "e")
        client = EngineClient(address, heartbeat_interval=0.05, heartbeat_timeout=30)
        await client.start()
        try:
            await until(lambda: client.healthy, "first heartbeat")
            h = client.submit(submit("bad"))
            await engine.wait_for(lambda m: isinstance(m, p.Submit))
            await engine.send(p.Error(request_id="bad", code="context_length_exceeded", message="too long",
                                      param="messages"))
            with pytest.raises(EngineError) as info:
                await h.wait_accepted(5)
            assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
            api = to_api_error(info.value)
            assert (api.status, api.code, api.param) == (400, "context_length_exceeded", "messages")
        finally:
            await client.close()
            await engine.kill()

    run(main)


def test_routing_load_counts_submits_the_answered_ping_did_not_see() -> None:
    async def main(address: str) -> None:
        engine = FakeEngine(address, "e")
        client = EngineClient(address, heartbeat_interval=0.05, heartbeat_timeout=30)
        await client.start()
        try:
            await until(lambda: client.healthy, "first heartbeat")
            engine.hold_pings = True
            engine.held.clear()
            await until(lambda: bool(engine.held), "a held ping")
            handles = [client.submit(submit(f"r{i}")) for i in range(2)]
            await engine.wait_for(lambda m: isinstance(m, p.Submit) and m.request_id == "r1")
            identity, ping = engine.held[0]
            await engine.beat(identity, ping)  # load 0, measured before the two submits were read
            await until(lambda: client.last_heartbeat is not None
                        and client.last_heartbeat.ping_sent_ns == ping.sent_ns, "the held heartbeat")
            assert client.routing_load() == 2  # a burst must not all go to the engine that looked idle
            engine.hold_pings = False
            # A heartbeat answering a ping sent after both submits: the engine's own count is all there is.
            await until(lambda: client.routing_load() == 0, "a later heartbeat")
            for h in handles:
                h.close()
        finally:
            await client.close()
            await engine.kill()

    run(main)


class _Recorder:
    """A request's sink that records each delta's seq in ``order``; its first delta lets the rest of the
    engine's burst reach the socket (the loop is held a moment) and schedules a callback beside the reader."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def on_delta(self, d: p.Delta, step: object) -> None:
        self.order.append(f"d{d.seq}")
        if d.seq == 0:
            time.sleep(0.3)  # not a timing assertion: the burst is queued whole, or the test asks less of it
            asyncio.get_running_loop().call_soon(self.order.append, "callback")

    def on_failure(self, err: object) -> None:
        self.order.append("failed")


def test_the_reader_delivers_one_engine_step_per_loop_turn_so_other_callbacks_run_between_queued_steps() -> None:
    async def main(address: str) -> None:
        engine = FakeEngine(address, "e")
        client = EngineClient(address, heartbeat_interval=0.05, heartbeat_timeout=30)
        await client.start()
        try:
            await until(lambda: client.healthy, "first heartbeat")
            handle = client.submit(submit("r"))
            await engine.wait_for(lambda m: isinstance(m, p.Submit))
            order: list[str] = []
            handle.sink = _Recorder(order)  # type: ignore[assignment]
            for seq in range(20):  # a gateway behind its engine finds a queue of steps
                await engine.send(p.DeltaBatch(deltas=[p.Delta(request_id="r", seq=seq, text="t", token_count=1,
                                                               emit_ns=p.now_ns())]))
            await until(lambda: "d19" in order, "every step")
            # the callback scheduled at the first step ran right after it, not after the whole queue
            assert order.index("callback") == 1, order
            handle.close()
        finally:
            await client.close()
            await engine.kill()

    run(main)
