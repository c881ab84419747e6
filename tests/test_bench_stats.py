"""The bench's pure parts: the fast client's parsers (HTTP/1.1 chunked, SSE, WebSocket frames,
HTTP/2), chunk sampling, metrics and bootstrap statistics."""

from __future__ import annotations

from dataclasses import replace

import h2.config
import h2.connection
import numpy as np
import orjson
import pytest

from tokenfan_bench.stats.ab_difference import bootstrap_medians, median_difference, paired_differences
from tokenfan_bench.stats.metrics import ArmSamples, arm_metrics, itl_ns, saturation_point, summary_ms
from tokenfan_bench.wire.events import (
    OP_CLOSE,
    OP_TEXT,
    SseDecoder,
    WsDecoder,
    chunk_sample,
    decode_ws,
    sample_sse,
    ws_close_payload,
    ws_frame,
)
from tokenfan_bench.wire.http1 import HttpError, ResponseParser, request
from tokenfan_bench.wire.http2 import PING, SETTINGS, FrameReader, H2Client

MS = 1_000_000


def chunk(seq: int, emit_ns: int, text: str = "x", *, chat: bool = True, coalesced: int | None = None,
          finish: str | None = None) -> dict:
    tf = {"seq": seq, "emit_ns": emit_ns, "sent_ns": emit_ns}
    if coalesced:
        tf["coalesced"] = coalesced
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    choice["finish_reason"] = finish
    return {"choices": [choice], "tokenfan": tf}


def arm(transport: str, streams: dict[int, list[tuple[int, int, int]]], post_ns: int = 0) -> ArmSamples:
    """``streams``: stream id -> [(seq, emit_ns, recv_ns)], all content, live, uncoalesced."""
    rows = [(s, q, e, r) for s, evs in streams.items() for q, e, r in evs]
    a = ArmSamples(transport)
    a.stream, a.seq, a.emit_ns, a.recv_ns = (np.array(col, np.int64) for col in zip(*rows))
    a.sent_ns = a.emit_ns.copy()
    a.deltas = np.ones(len(rows), np.int64)
    a.content = np.ones(len(rows), bool)
    a.live = np.ones(len(rows), bool)
    a.sub_stream = np.array(list(streams), np.int64)
    a.post_ns = np.full(len(streams), post_ns, np.int64)
    a.connected_ns = np.full(len(streams), post_ns, np.int64)
    a.ok = np.ones(len(streams), bool)
    return a


# -- wire -------------------------------------------------------------------------------------


def test_sse_decoder_reassembles_events_split_across_reads_and_drops_comments():
    stream = b": tokenfan stream x\n\nretry: 1000\n\nid: 0\ndata: {\"a\":1}\n\nid: 1\ndata: {\"a\":2}\n\ndata: [DONE]\n\n"
    dec = SseDecoder()
    events = [ev for i in range(0, len(stream), 7) for ev in dec.feed(stream[i:i + 7])]
    assert [(e.event, e.id, e.data) for e in events] == [
        ("message", "0", b'{"a":1}'), ("message", "1", b'{"a":2}'), ("message", None, b"[DONE]")]


def test_sse_decoder_reports_named_events():
    (ev,) = SseDecoder().feed(b'event: error\ndata: {"error":{}}\n\n')
    assert ev.event == "error" and ev.data == b'{"error":{}}'


def test_chunk_sample_role_chunk_is_not_content_and_coalesced_counts_deltas():
    role = chunk(0, 5, "")
    role["choices"][0]["delta"]["role"] = "assistant"
    assert chunk_sample(role) == (0, 5, 5, 1, False, False, False)
    assert chunk_sample(chunk(7, 9, " hi", coalesced=3, finish="length")) == (7, 9, 9, 3, True, True, False)
    assert chunk_sample(chunk(2, 1, " hi", chat=False)).content
    assert not chunk_sample({"choices": [], "usage": {}, "tokenfan": {"seq": 9, "emit_ns": 1}}).content


# -- metrics ----------------------------------------------------------------------------------


def test_summary_uses_numpy_linear_percentiles_in_ms():
    x = np.arange(1, 1001) * MS
    s = summary_ms(x)
    assert s["n"] == 1000 and s["mean"] == pytest.approx(500.5)
    assert s["p50"] == pytest.approx(np.percentile(np.arange(1, 1001), 50))
    assert s["p99.9"] == pytest.approx(np.percentile(np.arange(1, 1001), 99.9))
    assert summary_ms(np.array([]))["p99"] is None


def test_itl_pools_gaps_within_each_subscriber_only():
    a = arm("sse", {1: [(1, 0, 10), (2, 0, 30)], 2: [(1, 0, 1000), (2, 0, 1005), (3, 0, 1025)]})
    assert sorted(itl_ns(a).tolist()) == [5, 20, 20]


def test_arm_metrics_ttft_e2e_delivery_and_rate_follow_their_definitions():
    # one stream: request at 0, tokens emitted every 50 ms from 20 ms, received 1 ms later
    evs = [(k + 1, (20 + 50 * k) * MS, (21 + 50 * k) * MS) for k in range(11)]
    m = arm_metrics(arm("ws", {1: evs}), wall_s=1.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(21)
    assert m["e2e_ms"]["p50"] == pytest.approx(521)
    assert m["delivery_ms"]["p99"] == pytest.approx(1)
    assert m["itl_ms"]["mean"] == pytest.approx(50)
    assert m["tokens_per_s"]["p50"] == pytest.approx(20)
    assert m["errors"] == 0 and m["content_events"] == 11


# -- statistics -------------------------------------------------------------------------------


def test_cluster_bootstrap_with_singleton_clusters_matches_brute_force_resampling():
    rng = np.random.default_rng(3)
    v = rng.normal(size=301)
    fast = bootstrap_medians(v, np.arange(v.size), 4000, np.random.default_rng(1))
    brute = np.median(v[np.random.default_rng(2).integers(0, v.size, (4000, v.size))], axis=1)
    assert np.percentile(fast, [2.5, 50, 97.5]) == pytest.approx(np.percentile(brute, [2.5, 50, 97.5]), abs=0.03)


def _two_arms(shift_ns: int, n_streams: int = 40, tokens: int = 30, seed: int = 0, order_ns: int = 0,
              signs: tuple[int, ...] = (1, -1)):
    """Arm B receives every token ``shift_ns`` after arm A, plus jitter; ``order_ns``: a fixed
    per-stream offset with the sign ``signs[stream % len(signs)]`` (the gateway's fixed write order
    between two same-transport subscribers of one stream)."""
    rng = np.random.default_rng(seed)
    a, b = {}, {}
    for s in range(n_streams):
        sign = signs[s % len(signs)]
        evs_a, evs_b = [], []
        for k in range(1, tokens + 1):
            emit = k * 50 * MS
            ra = emit + int(rng.exponential(0.5 * MS))
            evs_a.append((k, emit, ra))
            evs_b.append((k, emit, ra + shift_ns + sign * order_ns + int(rng.normal(0, 20_000))))
        a[s], b[s] = evs_a, evs_b
    return a, b


def test_paired_difference_recovers_a_known_shift():
    a, b = _two_arms(1 * MS)
    d = median_difference(arm("sse", a), arm("ws", b), paired=True, seed=0)
    assert d["median"] == pytest.approx(1.0, abs=0.02)
    assert d["ci95"][0] < 1.0 < d["ci95"][1] or d["ci95"][1] - d["ci95"][0] < 0.02
    assert d["streams"] == 40


@pytest.mark.parametrize("seed", range(5))
def test_aa_interval_contains_zero_when_per_stream_write_order_is_balanced(seed):
    a, b = _two_arms(0, seed=seed, order_ns=85_000)
    d = median_difference(arm("sse", a), arm("sse", b), paired=True, seed=seed)
    assert d["ci95"][0] <= 0 <= d["ci95"][1]


def test_stream_cluster_interval_is_wider_than_a_token_bootstrap_when_streams_differ():
    a, b = _two_arms(0, n_streams=40, seed=2, order_ns=85_000, signs=(1, 1, -1))
    d, s = paired_differences(arm("sse", a), arm("sse", b))
    rng = np.random.default_rng(0)
    by_stream = np.percentile(bootstrap_medians(d, s, 1000, rng), [2.5, 97.5])
    by_token = np.percentile(bootstrap_medians(d, np.arange(d.size), 1000, rng), [2.5, 97.5])
    assert np.ptp(by_stream) > 2 * np.ptp(by_token)


def test_unpaired_difference_of_medians_recovers_a_shift():
    a, b = _two_arms(2 * MS, seed=4)
    b = {s + 1000: evs for s, evs in b.items()}  # separate streams
    d = median_difference(arm("sse", a), arm("ws", b), paired=False, seed=0)
    assert d["median"] == pytest.approx(2.0, abs=0.15)
    assert d["ci95"][0] < 2.0 < d["ci95"][1]


def test_unpaired_difference_drops_the_paths_known_jitter_and_only_that():
    """Each arm's tokens carry a large path delay known per token (``path_ns``, as the shaping proxy's seeded
    jitter): without it the 2 ms shift is lost in the noise; with it the interval is tight around 2 ms. The
    arms' delivery percentiles stay raw, and pooling an arm without a path keeps the rows aligned."""
    a, b = _two_arms(2 * MS, seed=4)
    b = {s + 1000: evs for s, evs in b.items()}
    A, B = arm("sse", a), arm("ws", b)
    rng = np.random.default_rng(7)
    for x in (A, B):
        x.path_ns = rng.uniform(-20 * MS, 20 * MS, x.recv_ns.size)
        x.recv_ns = x.recv_ns + x.path_ns.astype(np.int64)
    noisy = median_difference(replace(A, path_ns=np.zeros(0)), replace(B, path_ns=np.zeros(0)), paired=False, seed=0)
    kept = median_difference(A, B, paired=False, seed=0)
    assert noisy["ci95"][1] - noisy["ci95"][0] > 5 * (kept["ci95"][1] - kept["ci95"][0])
    assert kept["ci95"][0] < 2.0 < kept["ci95"][1] and kept["ci95"][1] - kept["ci95"][0] < 0.6
    assert "known jitter removed" in kept["method"] and "known jitter" not in noisy["method"]
    assert arm_metrics(A, 1.0)["delivery_ms"] == arm_metrics(replace(A, path_ns=np.zeros(0)), 1.0)["delivery_ms"]
    pooled = ArmSamples.concat("sse", [A, arm("sse", {5000: [(1, MS, 2 * MS)]})])
    assert pooled.path_ns.size == pooled.recv_ns.size and pooled.path_ns[-1] == 0


def test_saturation_point_is_the_lowest_concurrency_past_the_threshold():
    assert saturation_point([1000, 10, 100], [80.0, 2.0, 60.0]) == 100
    assert saturation_point([1, 10], [1.0, None]) is None


# -- the fast client's parsers: HTTP/1.1, SSE, WebSocket frames, HTTP/2 ----------------------------

SSE_BODY = [b": tokenfan stream x\n\nretry: 1000\n\n", b'id: 0\ndata: {"a":1}\n\n',
            b'id: 1\ndata: {"a":', b'2}\n\nevent: end\ndata: {"reason":"cancelled"}\n\n', b"data: [DONE]\n\n"]
SSE_EVENTS = [("message", "0", b'{"a":1}'), ("message", "1", b'{"a":2}'), ("end", None, b'{"reason":"cancelled"}'),
              ("message", None, b"[DONE]")]


def chunked_response(parts: list[bytes]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x;ext=1\r\n%b\r\n" % (len(p), p) if i == 1 else b"%x\r\n%b\r\n" % (len(p), p)
                           for i, p in enumerate(parts)) + b"0\r\nx-trailer: 1\r\n\r\n"


def decode_sse_response(pieces: list[bytes]) -> tuple[ResponseParser, list[tuple[str, str | None, bytes]]]:
    parser, dec, events = ResponseParser(), SseDecoder(), []
    for piece in pieces:
        events += [(e.event, e.id, e.data) for e in dec.feed(parser.feed(piece))]
    return parser, events


def test_sse_over_chunked_http1_gives_the_same_events_split_at_every_byte_offset():
    raw = chunked_response(SSE_BODY)
    for i in range(len(raw) + 1):
        parser, events = decode_sse_response([raw[:i], raw[i:]])
        assert events == SSE_EVENTS, i
        assert parser.complete and parser.head == (200, {"content-type": "text/event-stream",
                                                         "transfer-encoding": "chunked"})


def test_sse_over_chunked_http1_byte_by_byte_and_with_a_following_response():
    raw = chunked_response(SSE_BODY)
    parser, events = decode_sse_response([raw[i:i + 1] for i in range(len(raw))] + [b"HTTP/1.1 204"])
    assert events == SSE_EVENTS and parser.complete and parser.leftover == b"HTTP/1.1 204"


def test_http1_body_by_content_length_and_until_close():
    raw = b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello"
    for i in range(len(raw) + 1):
        p = ResponseParser()
        assert p.feed(raw[:i]) + p.feed(raw[i:]) == b"hello" and p.complete and p.head.status == 201
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\n\r\nab") + p.feed(b"c") == b"abc" and not p.complete
    p.eof()
    assert p.complete
    assert ResponseParser().feed(b"HTTP/1.1 204 No Content\r\n\r\n") == b""


@pytest.mark.parametrize("raw", [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
                                 b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcXY",
                                 b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"])
def test_http1_parser_refuses_malformed_responses(raw: bytes):
    with pytest.raises(HttpError):
        ResponseParser().feed(raw)


def test_http1_cut_response_is_an_error_at_eof():
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab")
    with pytest.raises(HttpError):
        p.eof()


def test_http1_request_bytes():
    assert request("POST", "/v1/streams", "h:1", {"content-type": "application/json"}, b"{}") == (
        b"POST /v1/streams HTTP/1.1\r\nhost: h:1\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")


def test_websocket_frames_masked_or_not_split_at_every_byte_offset():
    mask = b"\x01\x02\x03\x04"
    frames = [ws_frame(OP_TEXT, b'{"type":"chunk"}'), ws_frame(OP_TEXT, b"x" * 300, mask),
              ws_frame(OP_TEXT, b"y" * 70_000), ws_frame(OP_CLOSE, ws_close_payload(1000, "done"), mask)]
    raw = b"".join(frames)
    for i in list(range(400)) + [len(raw) - 3, len(raw)]:
        dec = WsDecoder()
        got = dec.feed(raw[:i]) + dec.feed(raw[i:])
        assert [(f.opcode, f.fin, f.payload) for f in got] == [
            (OP_TEXT, True, b'{"type":"chunk"}'), (OP_TEXT, True, b"x" * 300), (OP_TEXT, True, b"y" * 70_000),
            (OP_CLOSE, True, b"\x03\xe8done")], i


def test_chunk_samples_from_bytes_match_the_decoded_dict_path():
    for c in (chunk(7, 9, " hi", coalesced=3, finish="length"), chunk(2, 1, " hi", chat=False), chunk(0, 5, "")):
        raw = orjson.dumps(c)
        assert sample_sse(raw) == chunk_sample(c)
        msg, sample = decode_ws(orjson.dumps({"type": "chunk", "seq": 1, "data": c}))
        assert msg.type == "chunk" and sample == chunk_sample(c)
    msg, sample = decode_ws(b'{"type":"done","reason":"cancelled"}')
    assert sample is None and msg.reason == "cancelled"
    with pytest.raises(ValueError):
        sample_sse(b'{"choices":[]}')  # no tokenfan stamps: not a fan-out chunk


def _h2_server_bytes() -> tuple[bytes, int]:
    """What an HTTP/2 server (the ``h2`` library) answers to our client's request: SSE on stream 1."""
    client = H2Client()
    sid = client.open([(":method", "GET"), (":scheme", "http"), (":authority", "x"), (":path", "/e")], True)
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    events = server.receive_data(client.data_to_send())
    assert [type(e).__name__ for e in events] == ["RemoteSettingsChanged", "WindowUpdated", "RequestReceived",
                                                  "StreamEnded"]
    assert events[2].headers[3] == (b":path", b"/e")
    server.send_headers(sid, [(":status", "200"), ("content-type", "text/event-stream")])
    for part in SSE_BODY:
        server.send_data(sid, part, pad_length=3 if part == SSE_BODY[1] else None)
    server.ping(b"12345678")
    server.end_stream(sid)
    return server.data_to_send(), sid


def test_h2_client_reads_a_real_h2_servers_answer_split_at_every_byte_offset():
    raw, sid = _h2_server_bytes()
    for i in range(len(raw) + 1):
        client = H2Client()
        client.open([(":method", "GET"), (":scheme", "http"), (":authority", "x"), (":path", "/e")], True)
        client.data_to_send()
        evs = client.receive(raw[:i]) + client.receive(raw[i:])
        heads = [e for e in evs if e[0] == "headers"]
        assert heads == [("headers", sid, [(":status", "200"), ("content-type", "text/event-stream")], False)]
        dec = SseDecoder()
        got = [(e.event, e.id, e.data) for k, s, v, _ in evs if k == "data" for e in dec.feed(v)]
        assert got == SSE_EVENTS, i
        assert [e for e in evs if e[0] == "data"][-1][3] is True  # END_STREAM on the last DATA frame
        acks = FrameReader().feed(client.data_to_send())
        assert [(f.type, f.flags) for f in acks] == [(SETTINGS, 1), (PING, 1)]


def test_h2_client_opens_odd_streams_and_the_server_sees_its_settings():
    client = H2Client()
    get = [(":method", "GET"), (":scheme", "https"), (":authority", "x"), (":path", "/")]
    assert [client.open(get, True) for _ in range(3)] == [1, 3, 5]
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.receive_data(client.data_to_send())
    assert server.remote_settings.initial_window_size == 2**31 - 1 and server.remote_settings.enable_push == 0
    assert server.outbound_flow_control_window == 2**31 - 1


def test_a_gap_ending_at_a_migrated_event_is_not_an_inter_token_gap() -> None:
    """The first event after a generation moved to another engine (``tokenfan.migrated``) follows a failover's
    gap: a transport comparison must not count it."""
    from tokenfan_bench.clients.recorder import Recorder, to_samples
    from tokenfan_bench.stats.metrics import itl_ns

    rec = Recorder(0, 0)
    for k, (recv, migrated) in enumerate([(10, False), (20, False), (900, True), (910, False)]):
        chunk = {"choices": [{"delta": {"content": "x"}}], "tokenfan": {"seq": k, "emit_ns": recv, "sent_ns": recv}}
        if migrated:
            chunk["tokenfan"]["migrated"] = True
        rec.add(recv, chunk)
    rec.done = True
    assert list(itl_ns(to_samples("sse", [rec]))) == [10, 10]
    plain = Recorder(1, 0)
    for k, recv in enumerate((10, 20, 900)):
        plain.add(recv, {"choices": [{"delta": {"content": "x"}}], "tokenfan": {"seq": k, "emit_ns": 0}})
    assert list(itl_ns(to_samples("sse", [plain]))) == [10, 880]
