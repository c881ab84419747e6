"""The broker's Redis records (gateway.scaleout.broker_codec): plain values in, field dicts out, and back."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.broker import Backoff, redact


def test_header_round_trips_with_its_owner() -> None:
    fields = codec.encode_header("chat.completions", "tiny-llama", "gw-1")
    assert codec.decode(fields) == codec.Header("chat.completions", "tiny-llama", "gw-1")


def test_header_from_a_writer_without_owner_decodes_with_empty_owner() -> None:
    assert codec.decode({b"created": b"m", b"endpoint": b"completions"}) == codec.Header("completions", "m", "")


def test_event_round_trips_chunk_text_and_finish_reason() -> None:
    chunk = {"id": "c1", "choices": [{"index": 0, "text": "héllo"}], "tokenfan": {"seq": 3, "emit_ns": 1}}
    assert codec.decode(codec.encode_event(3, chunk, "héllo", "stop")) == codec.EventEntry(3, chunk, "héllo", "stop")


def test_event_without_finish_reason_decodes_to_none() -> None:
    entry = codec.decode(codec.encode_event(0, {"choices": []}, "", None))
    assert isinstance(entry, codec.EventEntry) and entry.finish_reason is None and entry.text == ""


def test_end_round_trips_state_count_and_error_with_its_status() -> None:
    err = APIError(503, "engine went away", type="server_error", code="engine_unavailable", retry_after=1.0)
    entry = codec.decode(codec.encode_end("error", 7, err))
    assert isinstance(entry, codec.EndEntry) and entry.state == "error" and entry.events == 7
    assert entry.error is not None and entry.error.status == 503 and entry.error.body() == err.body()


def test_clean_end_has_no_error_and_an_unknown_count_decodes_to_none() -> None:
    assert codec.decode(codec.encode_end("done", 12, None)) == codec.EndEntry("done", 12, None)
    assert codec.decode(codec.encode_end("cancelled", None, None)) == codec.EndEntry("cancelled", None, None)


@pytest.mark.parametrize("fields", [
    {},
    {b"unknown": b"x"},
    {b"seq": b"x", b"data": b"{}", b"text": b""},
    {b"seq": b"-1", b"data": b"{}", b"text": b""},
    {b"seq": b"1", b"data": b"not json", b"text": b""},
    {b"seq": b"1", b"data": b"[1]", b"text": b""},
    {b"seq": b"1", b"data": b"{}"},
    {b"seq": b"1", b"data": b"{}", b"text": b"\xff"},
    {b"end": b"running", b"events": b"1", b"error": b""},
    {b"end": b"error", b"events": b"1", b"error": b'{"error": {}}'},
    {b"end": b"done", b"events": b"many", b"error": b""},
])
def test_records_that_are_not_ours_raise_codec_error(fields: codec.Fields) -> None:
    with pytest.raises(codec.CodecError):
        codec.decode(fields)


@pytest.mark.parametrize(("seq", "have", "where"), [
    (0, 0, "append"), (5, 5, "append"), (4, 5, "repeat"), (0, 5, "repeat"), (6, 5, "hole"), (1, 0, "hole"),
])
def test_events_are_placed_by_seq(seq: int, have: int, where: str) -> None:
    assert codec.place(seq, have) == where


def test_an_end_is_complete_only_when_its_count_matches() -> None:
    assert codec.end_is_complete(codec.EndEntry("done", 3, None), 3)
    assert not codec.end_is_complete(codec.EndEntry("done", 4, None), 3)
    assert codec.end_is_complete(codec.EndEntry("error", None, None), 3)


def test_cancel_request_round_trips_and_garbage_raises() -> None:
    req = codec.CancelRequest("str-1", codec.ack_key("n1"))
    assert codec.decode_cancel(codec.encode_cancel(req)) == req
    for bad in (b"str-1", b"{}", b"[1]", b"\xff"):
        with pytest.raises(codec.CodecError):
            codec.decode_cancel(bad)


def test_keys_are_namespaced() -> None:
    assert codec.stream_key("a") == "tokenfan:{a}:s" and codec.known_key("a") == "tokenfan:{a}:k"
    assert codec.lease_key("g") == "tokenfan:gw:{g}" and codec.ack_key("n") == "tokenfan:ack:n"


def test_every_key_of_one_stream_is_in_one_hash_slot() -> None:
    """A Redis Cluster runs a script only on keys of one slot: the fencing scripts touch a stream's key, its
    epoch, its marker and its transcript, and the lease pipeline a gateway's lease and presence channel."""
    from redis.crc import key_slot

    for sid in ("str-1", "resp_abc", "ui-chat:chat}{x", "{odd}"):
        keys = (codec.stream_key(sid), codec.known_key(sid), codec.epoch_key(sid), codec.transcript_key(sid),
                codec.adopt_key(sid, "gw1"))
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
    assert key_slot(codec.lease_key("g1").encode()) == key_slot(codec.presence_channel("g1").encode())
    assert key_slot(codec.stream_key("str-1").encode()) != key_slot(codec.stream_key("str-2").encode())


def test_backoff_grows_to_its_cap_and_resets() -> None:
    b = Backoff(cap=1.0, first=0.1)
    delays = [b.next() for _ in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(0.5 <= d <= 1.0 for d in delays[5:])
    b.reset()
    assert b.next() <= 0.1


def test_redact_hides_only_the_password() -> None:
    assert redact("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact("redis://redis:6379/0") == "redis://redis:6379/0"


def test_an_adopters_header_names_where_it_continues_and_a_creators_does_not() -> None:
    adopter = codec.decode(codec.encode_header("completions", "m", "gw-b", epoch=2, at=17))
    creator = codec.decode(codec.encode_header("completions", "m", "gw-a", epoch=1))
    assert isinstance(adopter, codec.Header) and adopter.at == 17
    assert isinstance(creator, codec.Header) and creator.at is None


def test_held_reads_the_events_a_log_holds_back_over_headers() -> None:
    header = codec.encode_header("completions", "m", "gw")
    ev = codec.encode_event(4, {}, "x", None)
    end = codec.encode_end("done", 5, None)
    assert codec.held([]) == 0 and codec.held([header]) == 0
    assert codec.held([ev, header]) == 5
    assert codec.held([header, header, ev]) == 5  # an adopter's header (or two) after the events it adopted
    assert codec.held([end, ev]) == -1
