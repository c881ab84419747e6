"""The engine's ZeroMQ socket, spoken to directly: isolation between gateways, junk frames, permissions."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import msgspec
import zmq

from engine_worker import protocol as p
from tests.procs import start_engine


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(address)
    return s


def recv(s: zmq.Socket) -> p.Message:
    return p.decode(s.recv_multipart())


def submit(rid: str, max_tokens: int = 5) -> list[bytes]:
    return p.encode(p.Submit(request_id=rid, endpoint="completions", prompt="x",
                             sampling=p.Sampling(max_tokens=max_tokens)))


def collect(s: zmq.Socket, until_finished: set[str]) -> dict[str, list[p.Delta]]:
    out: dict[str, list[p.Delta]] = {}
    pending = set(until_finished)
    while pending:
        msg = recv(s)
        if isinstance(msg, p.DeltaBatch):
            for d in msg.deltas:
                out.setdefault(d.request_id, []).append(d)
                if d.finish_reason:
                    pending.discard(d.request_id)
    return out


def test_each_gateway_gets_only_its_own_deltas(synthetic_engine: str) -> None:
    ctx = zmq.Context()
    a, b = dealer(ctx, synthetic_engine), dealer(ctx, synthetic_engine)
    try:
        a.send_multipart(submit("iso-a1"))
        a.send_multipart(submit("iso-a2"))
        b.send_multipart(submit("iso-b1"))
        got_a = collect(a, {"iso-a1", "iso-a2"})
        got_b = collect(b, {"iso-b1"})
        assert set(got_a) == {"iso-a1", "iso-a2"} and set(got_b) == {"iso-b1"}
        for deltas in (*got_a.values(), *got_b.values()):
            assert [d.seq for d in deltas] == list(range(len(deltas)))
            assert deltas[-1].usage == p.Usage(prompt_tokens=1, completion_tokens=5)
            assert all(d.emit_ns > 0 for d in deltas)
    finally:
        a.close()
        b.close()
        ctx.term()


def test_junk_frames_are_dropped_and_the_engine_keeps_serving(synthetic_engine: str) -> None:
    ctx = zmq.Context()
    s = dealer(ctx, synthetic_engine)
    try:
        junk = [[b"hello"], [b"tokenfan/0", b"x"], [p.MAGIC, b"\xff\xfe"], [p.MAGIC, msgspec.msgpack.encode([1, 2])],
                [p.MAGIC, msgspec.msgpack.encode(["submit", "r", "bogus-endpoint"])], [b"", b"", b""],
                [p.MAGIC, os.urandom(4096)], p.encode(p.Heartbeat("x", "y", "z", 1, 0, 0, 0, 0)),
                [p.MAGIC, b"\x92\xa4\xff\xfe\xfd\xfc\x01"]]  # invalid UTF-8 (it once ended the receive loop)
        for frames in junk:
            s.send_multipart(frames)
        s.send_multipart(p.encode(p.Ping(sent_ns=42)))
        while True:
            msg = recv(s)
            if isinstance(msg, p.Heartbeat):
                assert msg.ping_sent_ns == 42
                break
        s.send_multipart(submit("after-junk", 3))
        assert len(collect(s, {"after-junk"})["after-junk"]) >= 1
    finally:
        s.close()
        ctx.term()


def test_rejected_requests_get_a_typed_error(synthetic_engine: str) -> None:
    ctx = zmq.Context()
    s = dealer(ctx, synthetic_engine)
    try:
        s.send_multipart(submit("too-long", 100_000))
        msg = recv(s)
        assert isinstance(msg, p.Error) and msg.code == "context_length_exceeded" and msg.request_id == "too-long"
    finally:
        s.close()
        ctx.term()


def test_abort_stops_a_request_within_a_step(synthetic_engine: str) -> None:
    """Deltas already queued when the abort lands may still arrive; after them the request goes quiet for good.

    Without the abort the 1500 tokens at 200 tok/s would keep coming for 7.5 s, so a 300 ms silence
    within 3 s of the abort (and no finish) shows the engine stopped the request.
    """
    ctx = zmq.Context()
    s = dealer(ctx, synthetic_engine)
    try:
        s.send_multipart(submit("to-abort", 1500))
        while not isinstance(first := recv(s), p.DeltaBatch):
            pass
        seen = [d.seq for d in first.deltas]
        s.send_multipart(p.encode(p.Abort(request_ids=["to-abort"])))
        s.setsockopt(zmq.RCVTIMEO, 300)
        deadline = time.monotonic() + 3.0
        late: list[p.Delta] = []
        quiet = False
        while time.monotonic() < deadline:
            try:
                msg = recv(s)
            except zmq.Again:
                quiet = True
                break
            if isinstance(msg, p.DeltaBatch):
                late.extend(msg.deltas)
        assert quiet, f"{len(late)} deltas kept coming for 3 s after the abort"
        assert all(d.finish_reason is None for d in late)
        assert [d.seq for d in late] == list(range(seen[-1] + 1, seen[-1] + 1 + len(late)))  # in flight, in order
        assert len(late) < 200
    finally:
        s.close()
        ctx.term()


def test_ipc_socket_is_private_to_its_user(synthetic_engine: str) -> None:
    path = Path(synthetic_engine.removeprefix("ipc://"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_request_aborted_before_it_starts_frees_its_place(ipc_dir: Path) -> None:
    """A submit and its abort read in one burst: the request task is cancelled before it ever runs. Its
    place in the engine (``--max-queue``) must come back, and heartbeats must not count it as waiting."""
    address = f"ipc://{ipc_dir / 'abort-early.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--max-queue", "2", name="engine-abort-early")
    ctx = zmq.Context()
    s = dealer(ctx, address)
    try:
        for i in range(4):
            s.send_multipart(submit(f"early-{i}", 1000))
            s.send_multipart(p.encode(p.Abort(request_ids=[f"early-{i}"])))
        deadline = time.monotonic() + 10
        while True:  # pings until the engine reports itself idle
            s.send_multipart(p.encode(p.Ping(sent_ns=p.now_ns())))
            msg = recv(s)
            while not isinstance(msg, p.Heartbeat):
                msg = recv(s)
            if (msg.running, msg.waiting) == (0, 0):
                break
            assert time.monotonic() < deadline, f"engine still reports running={msg.running} waiting={msg.waiting}"
            time.sleep(0.1)
        s.send_multipart(submit("after", 3))
        s.send_multipart(submit("after-2", 3))
        got = collect(s, {"after", "after-2"})
        assert got["after"][-1].usage == p.Usage(prompt_tokens=1, completion_tokens=3)
        assert got["after-2"][-1].finish_reason is not None
    finally:
        s.close()
        ctx.term()
        engine.stop()
