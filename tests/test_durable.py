"""The Durable Streams read side (gateway/api/durable): the protocol's rules on plain streams (offsets, the
trailer, ETag, cursor, SSE frames), then its HTTP answers from a real gateway (``gateway_url``), checked as the
protocol's server conformance suite checks a server's read side (PROTOCOL.md 5.5-5.8, 8, 9.1, 10)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from gateway.api.durable import protocol
from gateway.api.durable.framing import DurableSse
from gateway.core.streams import Event, Stream
from gateway.errors import ClientError


def log(n: int, state: str = "running") -> Stream:
    s = Stream(id="str-1", endpoint="chat.completions", model="m")
    for i in range(n):
        s.append(Event(i, {"i": i}, {"seq": i}, "x", None))
    if state != "running":
        s.finish(state)  # type: ignore[arg-type]
    return s


def test_offsets_sort_as_positions_do_and_are_never_a_sentinel() -> None:
    offsets = [protocol.offset(p) for p in (0, 1, 9, 10, 99, 100, 12345)]
    assert offsets == sorted(offsets) and len(set(map(len, offsets))) == 1
    assert not {"-1", "now"} & set(offsets)


def test_parse_offset_reads_the_sentinels_and_refuses_what_the_server_never_wrote() -> None:
    s = log(3)
    assert protocol.parse_offset(None, s) == protocol.parse_offset("-1", s) == 0
    assert protocol.parse_offset("now", s) == 3
    assert protocol.parse_offset(protocol.offset(2), s) == 2
    assert protocol.parse_offset(protocol.offset(50), s) == 50  # an open stream: a mirror may be behind
    for bad in ("", "a,b", "1 2", "-2", "x" * 300, "0" * 17):
        with pytest.raises(ClientError) as err:
            protocol.parse_offset(bad, s)
        assert err.value.status == 400 and err.value.param == "offset"
    with pytest.raises(ClientError):
        protocol.parse_offset(protocol.offset(5), log(3, "done"))  # past a closed stream's end


def test_a_stream_that_did_not_finish_ends_with_its_trailer_once() -> None:
    done, cancelled = log(2, "done"), log(2, "cancelled")
    assert protocol.messages(done, 0) == ([b'{"i":0}', b'{"i":1}'], 2) and protocol.tail(done) == 2
    assert protocol.messages(cancelled, 1) == ([b'{"i":1}', b'{"reason":"cancelled"}'], 3)
    assert protocol.messages(cancelled, 3) == ([], 3) and protocol.tail(cancelled) == 3
    assert protocol.messages(log(2), 2) == ([], 2)  # open: no trailer yet
    failed = log(1, "error")
    assert json.loads(protocol.messages(failed, 1)[0][0])["error"]["code"] == "stream_lost"
    assert protocol.messages(log(10), 0, limit=4) == ([b'{"i":%d}' % i for i in range(4)], 4)


def test_etags_vary_with_the_range_and_with_closure() -> None:
    tags = {protocol.etag("s", "0", 2, False), protocol.etag("s", "0", 2, True), protocol.etag("s", "1", 2, False)}
    assert len(tags) == 3 and protocol.etag("s", "0", 2, True).endswith(':c"')


def test_cursors_are_the_interval_and_never_go_back() -> None:
    now = protocol.CURSOR_EPOCH_S + 20 * 1000 + 5
    assert protocol.cursor(now, None) == "1000" == protocol.cursor(now, "999")
    assert protocol.cursor(now, "1000", lambda lo, hi: 1) == "1001"
    assert protocol.cursor(now, "1000", lambda lo, hi: 3600) == str(1000 + 180)
    assert protocol.cursor(now, "junk") == "1000"


def test_sse_frames_carry_each_message_then_its_control_and_the_end_closes() -> None:
    s = log(2)
    framing = DurableSse(s, 0, "77")
    first = framing.frame(s.events[0])
    assert first == (b'event: data\ndata: [{"i":0}]\n\nevent: control\n'
                     b'data: {"streamNextOffset":"0000000000000001","streamCursor":"77"}\n\n')
    assert b'"upToDate":true' in framing.frame(s.events[1])  # the newest message
    s.finish("cancelled")
    end = framing.ending(s).frame
    assert isinstance(end, bytes)
    assert end.startswith(b'event: data\ndata: [{"reason":"cancelled"}]\n\n')
    assert end.endswith(b'data: {"streamNextOffset":"0000000000000003","streamClosed":true,"upToDate":true}\n\n')
    past = DurableSse(s, 3, "77").ending(s).frame  # a reader that already had the trailer gets only the close
    assert isinstance(past, bytes) and past.startswith(b"event: control")
    assert protocol.sse_data([b'{"a":\n1}']) == b'event: data\ndata: [{"a":\ndata: 1}]\n\n'


# -- a real gateway -------------------------------------------------------------------------------------------


def finished(url: str, **extra: Any) -> str:
    r = httpx.post(url + "/v1/streams", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                             **extra}, timeout=30)
    durable = r.json()["durable_url"]
    deadline = time.monotonic() + 30
    while httpx.head(durable, timeout=10).headers.get("stream-closed") != "true":
        assert time.monotonic() < deadline, "the stream did not close"
        time.sleep(0.05)
    return durable  # type: ignore[no-any-return]


def test_catch_up_reads_head_and_etag(gateway_url: str) -> None:
    url = finished(gateway_url)
    head = httpx.head(url, timeout=10)
    assert head.status_code == 200 and head.headers["cache-control"] == "no-store"
    n = int(head.headers["stream-next-offset"])
    assert n > 3 and head.headers["x-content-type-options"] == "nosniff"
    whole = httpx.get(url, params={"offset": "-1"}, timeout=10)
    assert whole.json() == httpx.get(url, timeout=10).json() and len(whole.json()) == n
    assert whole.headers["content-type"] == "application/json" and "max-age=60" in whole.headers["cache-control"]
    assert whole.headers["stream-up-to-date"] == whole.headers["stream-closed"] == "true"
    assert whole.json()[1]["object"] == "chat.completion.chunk"
    again = httpx.get(url, params={"offset": "-1"}, headers={"If-None-Match": whole.headers["etag"]}, timeout=10)
    assert again.status_code == 304 and not again.content
    part = httpx.get(url, params={"offset": protocol.offset(3)}, timeout=10)
    assert part.json() == whole.json()[3:] and part.headers["etag"] != whole.headers["etag"]
    at_end = httpx.get(url, params={"offset": protocol.offset(n)}, timeout=10)
    assert at_end.json() == [] and at_end.headers["stream-closed"] == "true"
    now = httpx.get(url, params={"offset": "now"}, timeout=10)
    assert now.json() == [] and now.headers["cache-control"] == "no-store" and "etag" not in now.headers
    poll = httpx.get(url, params={"offset": protocol.offset(n), "live": "long-poll"}, timeout=10)
    assert poll.status_code == 204 and poll.headers["stream-closed"] == "true"  # at once: closed
    sse = httpx.get(url, params={"offset": "now", "live": "sse"}, timeout=10)
    assert sse.headers["content-type"] == "text/event-stream"
    closing = {"streamNextOffset": protocol.offset(n), "streamClosed": True, "upToDate": True}
    assert sse.text == "event: control\ndata: " + json.dumps(closing, separators=(",", ":")) + "\n\n"


def test_a_long_poll_waits_for_its_offset_and_answers_204_when_nothing_came(gateway_url: str) -> None:
    r = httpx.post(gateway_url + "/v1/streams", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2000}, timeout=30)  # 10 s: open throughout
    url = r.json()["durable_url"]
    try:
        far = protocol.offset(10_000)  # a position the open stream has not reached
        poll = httpx.get(url, params={"offset": far, "live": "long-poll", "timeout": "0.2"}, timeout=10)
        assert poll.status_code == 204 and poll.headers["stream-next-offset"] == far
        assert poll.headers["stream-up-to-date"] == "true" and poll.headers["stream-cursor"].isdigit()
        tail = httpx.head(url, timeout=10).headers["stream-next-offset"]
        got = httpx.get(url, params={"offset": tail, "live": "long-poll"}, timeout=30)  # the next message
        assert got.status_code == 200 and len(got.json()) >= 1 and got.headers["stream-next-offset"] > tail
        assert "stream-cursor" in got.headers and "stream-closed" not in got.headers
    finally:
        httpx.delete(f"{gateway_url}/v1/streams/{r.json()['id']}", timeout=30)
    closed = httpx.get(url, params={"offset": far, "live": "long-poll"}, timeout=10)
    assert closed.status_code == 400  # past the end, now that the end is known


def test_a_cancelled_stream_ends_with_its_trailer(gateway_url: str) -> None:
    r = httpx.post(gateway_url + "/v1/streams", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2000}, timeout=30)
    s = r.json()
    httpx.delete(f"{gateway_url}/v1/streams/{s['id']}", timeout=30)
    items = httpx.get(s["durable_url"], timeout=10)
    assert items.headers["stream-closed"] == "true" and items.json()[-1] == {"reason": "cancelled"}


def test_a_background_response_is_read_at_its_id(gateway_url: str) -> None:
    r = httpx.post(gateway_url + "/v1/responses", json={"input": "hi", "max_output_tokens": 5, "background": True},
                   timeout=30)
    rid = r.json()["id"]
    url = f"{gateway_url}/v1/streams/{rid}/durable"
    deadline = time.monotonic() + 30
    while httpx.head(url, timeout=10).headers.get("stream-closed") != "true":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    events = httpx.get(url, timeout=10).json()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")  # max_output_tokens: incomplete


@pytest.mark.parametrize(("query", "status", "param"), [
    ({"offset": "a,b"}, 400, "offset"), ({"offset": ""}, 400, "offset"), ({"live": "long-poll"}, 400, "offset"),
    ({"offset": "-1", "live": "websocket"}, 400, "live"),
    ({"offset": "-1", "live": "long-poll", "timeout": "999"}, 400, "timeout"),
])
def test_bad_reads_are_400s_in_the_openai_error_shape(gateway_url: str, query: dict[str, str], status: int,
                                                      param: str) -> None:
    url = finished(gateway_url)
    r = httpx.get(url, params=query, timeout=10)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert r.headers["x-content-type-options"] == "nosniff"


def test_unknown_streams_are_404_and_writes_405(gateway_url: str) -> None:
    r = httpx.get(gateway_url + "/v1/streams/str-nope/durable", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    url = finished(gateway_url)
    for method in ("PUT", "POST", "DELETE"):
        w = httpx.request(method, url, content=b"[1]", timeout=10)
        assert w.status_code == 405 and w.json()["error"]["code"] == "method_not_allowed"
