"""Responses API WebSocket mode, pure parts: what the official SDK sends is parsed, what we send
is what its types and helpers accept."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from openai.lib.responses_websocket import ResponsesWebSocketAccumulator
from openai.resources.responses.responses import ResponsesConnection
from openai.types.responses.responses_server_event import ResponsesServerEvent, ResponseWsError
from pydantic import TypeAdapter

from engine_worker import protocol as p
from gateway.api.lanes import Lanes, WsClientError
from gateway.api.responses.events import ResponseEvents
from gateway.api.responses.request import build_request, previous_response_not_found
from gateway.api.responses.ws import (
    TranscriptCache,
    client_error_event,
    parse_client_message,
    ws_error,
    ws_event,
    ws_text,
)
from gateway.config import Limits
from gateway.errors import APIError
from tests.test_responses_api import no_extra_fields

SERVER_EVENT = TypeAdapter(ResponsesServerEvent)


class _Socket:
    """Stands in for the websockets connection under the SDK's ResponsesConnection: records sends."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, data: str) -> None:
        self.sent.append(data)

    def close(self, **_: Any) -> None:
        pass


def sdk_sends(**create: Any) -> str:
    """The exact text the SDK's ``connection.response.create(**create)`` puts on the socket."""
    sock = _Socket()
    ResponsesConnection(sock).response.create(**create)  # type: ignore[arg-type]
    return sock.sent[-1]


def validate(ev: dict[str, Any]) -> Any:
    parsed = SERVER_EVENT.validate_python(ev)
    no_extra_fields(parsed)
    return parsed


def run_events(deltas: list[str], rid: str = "resp_1") -> list[dict[str, Any]]:
    b = ResponseEvents(rid, "m", 0)
    events = b.start()
    for d in deltas:
        events += b.delta(d)
    return events + b.finish("stop", p.Usage(3, len(deltas)))


# -- client messages -------------------------------------------------------------------------------


def test_the_sdks_response_create_parses_into_a_request() -> None:
    msg = parse_client_message(sdk_sends(
        model="m", input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], instructions="x",
        max_output_tokens=5, store=False, previous_response_id="resp_0", stream_id="lane-1"))
    assert msg.stream_id == "lane-1" and msg.generate
    assert (msg.request.previous_response_id, msg.request.store) == ("resp_0", False)
    req = build_request(msg.request, Limits(), [{"role": "user", "content": "before"}])
    assert req.chat.submit_fields["messages"] == [p.ChatMessage("system", "x"), p.ChatMessage("user", "before"),
                                                  p.ChatMessage("user", ["hi"])]
    assert req.max_tokens == 5


def test_a_default_lane_create_and_a_warmup() -> None:
    plain = parse_client_message(sdk_sends(model="m", input="hello"))
    assert plain.stream_id is None and plain.request.input == "hello"
    warm = parse_client_message(sdk_sends(model="m", input="ctx", generate=False))
    assert warm.generate is False


@pytest.mark.parametrize(("raw", "code", "param"), [
    ("{not json", "invalid_json", None),
    ("[1, 2]", "invalid_event", "type"),
    ('{"type": 5}', "invalid_event", "type"),
    ('{"type": "session.update"}', "invalid_event", "type"),
    ('{"type": "response.steer", "previous_response_id": "r", "input": "x"}', "unsupported_parameter", "type"),
    ('{"type": "response.create", "input": "x", "background": true}', "unsupported_parameter", "background"),
    ('{"type": "response.create", "input": "x", "stream_id": "bad id!"}', "invalid_stream_id", "stream_id"),
    ('{"type": "response.create", "input": "x", "stream_id": ""}', "invalid_stream_id", "stream_id"),
    ('{"type": "response.create", "input": "x", "generate": "no"}', "invalid_type", "generate"),
    ('{"type": "response.create", "input": "x", "tools": [{"type": "web_search"}]}', "unsupported_parameter",
     "tools[0]"),
    ('{"type": "response.create", "input": "x", "temperature": "hot"}', "invalid_type", "temperature"),
])
def test_bad_client_messages_get_the_protocols_error_event(raw: str, code: str, param: str | None) -> None:
    with pytest.raises(WsClientError) as e:
        parse_client_message(raw)
    ev = client_error_event(e.value)
    err = validate(ev)
    assert isinstance(err, ResponseWsError) and err.error.code == code and err.error.param == param
    assert err.status == 400 and err.error.type == "invalid_request_error" and err.error.message


def test_an_error_on_a_named_lane_echoes_its_stream_id() -> None:
    with pytest.raises(WsClientError) as e:
        parse_client_message('{"type": "response.create", "stream_id": "a", "input": "x", "top_logprobs": 2}')
    assert validate(client_error_event(e.value)).stream_id == "a"


def test_stream_is_implicit_over_websocket() -> None:
    assert parse_client_message('{"type": "response.create", "input": "x", "stream": false}').request.stream is None


# -- server events ---------------------------------------------------------------------------------


def test_every_response_event_is_a_websocket_server_event_with_its_lane() -> None:
    events = run_events(["a", "b"])
    for ev in events:
        assert validate(ws_event(ev)).stream_id is None
        named = ws_event(ev, "lane-1")
        assert validate(named).stream_id == "lane-1"
        assert orjson.loads(ws_text(orjson.dumps(ev), "lane-1")) == named
        assert orjson.loads(ws_text(orjson.dumps(ev))) == ev


def test_an_in_log_error_event_becomes_the_websocket_error_shape() -> None:
    b = ResponseEvents("resp_1", "m", 0)
    events = b.start() + b.cancel()
    err = validate(ws_event(events[-1], "l"))
    assert isinstance(err, ResponseWsError)
    assert (err.error.code, err.sequence_number, err.stream_id) == ("response_cancelled", len(events) - 1, "l")


def test_previous_response_not_found_as_a_websocket_error() -> None:
    err = validate(ws_error(previous_response_not_found("resp_x"), "lane"))
    assert (err.status, err.error.code, err.error.param) == (400, "previous_response_not_found",
                                                             "previous_response_id")


def test_the_sdks_websocket_accumulator_rebuilds_the_final_response() -> None:
    acc = ResponsesWebSocketAccumulator()
    for ev in run_events(["He", "llo"]):
        acc.add_event(validate(ws_event(ev, "x")))
    assert acc.get_final_response().output_text == "Hello"


# -- lanes -----------------------------------------------------------------------------------------


def test_one_lane_runs_its_requests_fifo_one_at_a_time() -> None:
    lanes: Lanes[str] = Lanes()
    assert lanes.submit(None, "r1") == [(None, "r1")]
    assert lanes.submit(None, "r2") == [] and lanes.submit(None, "r3") == []
    assert lanes.finished(None) == [(None, "r2")]
    assert lanes.finished(None) == [(None, "r3")]
    assert lanes.finished(None) == [] and lanes.active == 0 and lanes.pending == 0


def test_lanes_run_concurrently_up_to_the_active_limit_then_take_turns() -> None:
    lanes: Lanes[str] = Lanes(max_active=2)
    assert lanes.submit("a", "a1") == [("a", "a1")]
    assert lanes.submit("b", "b1") == [("b", "b1")]
    assert lanes.submit("c", "c1") == [] and lanes.submit("a", "a2") == [] and lanes.submit(None, "d1") == []
    assert lanes.finished("a") == [("c", "c1")]  # c was waiting; a's next one goes behind d
    assert lanes.finished("b") == [(None, "d1")]
    assert lanes.finished("c") == [("a", "a2")]
    assert lanes.active == 2 and lanes.pending == 0


def test_lane_limits_give_the_documented_errors() -> None:
    lanes: Lanes[int] = Lanes(max_active=1, max_named=2, max_pending=2)
    lanes.submit("a", 1)
    lanes.submit("b", 2)
    with pytest.raises(WsClientError) as e:
        lanes.submit("c", 3)
    assert e.value.error.code == "websocket_stream_limit_reached" and e.value.stream_id == "c"
    lanes.submit(None, 4)  # the default lane does not count as named
    with pytest.raises(WsClientError) as e:
        lanes.submit("a", 5)
    assert e.value.error.status == 429
    with pytest.raises(RuntimeError):
        Lanes[int]().finished(None)


# -- previous_response_id cache ----------------------------------------------------------------------


def test_transcript_cache_is_lru_bounded_by_entries_and_characters() -> None:
    cache = TranscriptCache(max_entries=2, max_chars=10)
    t = [{"role": "user", "content": "abc"}]
    cache.put("r1", t)
    cache.put("r2", t)
    assert cache.get("r1") == t  # r1 is now the most recent
    cache.put("r3", t)
    assert cache.get("r2") is None and cache.get("r1") == t and cache.get("r3") == t
    call = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "fn", "arguments": "{}" + " " * 4}}]}]
    cache.put("big", call)  # 2 + 6 (name and arguments) + 3 + 3 > 10: oldest go
    assert cache.get("big") is not None and len(cache) == 1
    cache.put("huge", [{"role": "user", "content": "x" * 11}])  # larger than the whole cache: not kept
    assert cache.get("huge") is None
    cache.evict("big")
    assert len(cache) == 0


def test_error_messages_are_json_text() -> None:
    text = json.dumps(ws_error(APIError(400, "m", code="c")))
    assert json.loads(text)["error"]["code"] == "c"
