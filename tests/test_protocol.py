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
