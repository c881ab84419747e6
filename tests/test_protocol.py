"""The engine wire protocol: typed, versioned, and strict about what it decodes."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from engine_worker import protocol as p


def test_every_message_round_trips() -> None:
    msgs: list[p.Message] = [
        p.Submit(request_id="r1", endpoint="chat.completions", sampling=p.Sampling(max_tokens=5, stop=["x"]),
                 messages=[p.ChatMessage("user", "hi")], trace_id="t"),
        p.Abort(request_ids=["r1", "r2"]),
        p.Ping(sent_ns=1),
        p.Accepted(request_id="r1", prompt_tokens=3),
        p.DeltaBatch(deltas=[p.Delta("r1", 0, "he", 1, 123), p.Delta("r1", 1, "llo", 1, 124, "stop", p.Usage(3, 2))]),
        p.Error(request_id="r1", code="engine_error", message="boom"),
        p.Heartbeat("e", "synthetic", "m", 2048, 1, 0, 5, 6),
    ]
    for m in msgs:
        assert p.decode(p.encode(m)) == m


def test_wrong_version_header_is_rejected() -> None:
    frames = p.encode(p.Ping(sent_ns=1))
    with pytest.raises(p.VersionMismatch, match="speaks wire protocol tokenfan/999, this process tokenfan/"):
        p.decode([b"tokenfan/999", frames[1]])
    with pytest.raises(p.WireError, match="unsupported protocol header"):
        p.decode([b"HTTP/1.1 200", frames[1]])


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode(["nope", 1]),
                                     msgspec.msgpack.encode(["ping", "not-an-int"]),
                                     # a str of invalid UTF-8: msgspec raises UnicodeDecodeError, not DecodeError
                                     # (one random frame in ~180 of the fuzz tests' did; it ended the engine's
                                     # receive loop, and the engine served nobody after it)
                                     b"\x92\xa4\xff\xfe\xfd\xfc\x01", b"\x92\xa4ping\xa3\xc3\x28\xa1"])
def test_malformed_payloads_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(p.WireError):
        p.decode([p.MAGIC, payload])


def test_a_pickle_is_never_executed() -> None:
    evil = pickle.dumps(p.Ping(sent_ns=1).__class__)  # any pickle is just bytes to the decoder
    with pytest.raises(p.WireError):
        p.decode([p.MAGIC, evil])


def test_frame_count_is_checked() -> None:
    with pytest.raises(p.WireError, match="expected 2 frames"):
        p.decode([p.MAGIC])


class SubmitBefore(msgspec.Struct, tag="submit", array_like=True, frozen=True):
    """``Submit`` as ``tokenfan/4`` had it before ``trace_headers`` was added at its end (2026-11-29)."""

    request_id: str
    endpoint: str
    sampling: p.Sampling
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None
    trace_id: str = ""
    body: bytes = b""
    stream: bool = True
    resume: list[int] = []
    resume_chars: int = 0
    resume_steps: p.EngineSteps = []


def test_submit_trace_headers_are_a_trailing_field_both_sides_of_tokenfan_4_read() -> None:
    """A gateway from before sends no trace context (the engine reads none); an engine from before reads a
    traced gateway's Submit and ignores the context."""
    traced = p.Submit("r", "chat.completions", p.Sampling(), messages=[p.ChatMessage("user", "hi")],
                      resume=[1, 2], trace_headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(traced), type=SubmitBefore)
    assert (old.request_id, old.resume, old.messages) == ("r", [1, 2], traced.messages)
    new = p.decode([p.MAGIC, msgspec.msgpack.encode(SubmitBefore("r", "completions", p.Sampling(), prompt="x"))])
    assert isinstance(new, p.Submit) and new.trace_headers == {} and new.prompt == "x"


class HeartbeatBefore(msgspec.Struct, tag="heartbeat", array_like=True, frozen=True):
    """``Heartbeat`` as ``tokenfan/4`` had it before ``version`` was added at its end."""

    engine_id: str
    backend: str
    model: str
    max_model_len: int
    running: int
    waiting: int
    ping_sent_ns: int
    sent_ns: int
    bad_frames: int = 0


def test_heartbeat_version_is_a_trailing_field_both_sides_of_tokenfan_4_read() -> None:
    """An engine from before sends no release (the gateway's /health shows none); a gateway from before reads a
    newer engine's heartbeat and ignores it."""
    new = p.Heartbeat("e", "synthetic", "m", 8, 1, 0, 2, 3, bad_frames=4, version="0.2.0")
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=HeartbeatBefore)
    assert (old.engine_id, old.bad_frames) == ("e", 4)
    back = p.decode([p.MAGIC, msgspec.msgpack.encode(HeartbeatBefore("e", "synthetic", "m", 8, 1, 0, 2, 3))])
    assert isinstance(back, p.Heartbeat) and back.version == "" and back.engine_id == "e"
