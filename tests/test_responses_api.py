"""The Responses API's pure parts against the installed official ``openai`` SDK.

Shapes are checked with the SDK's own pydantic types (strict validation, no unknown fields) and by
the unmodified SDK client itself, talking to an in-process transport that serves what the pure
modules build (``_Server`` below: the wiring the gateway routes do, minus the stream log)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx2
import msgspec
import openai
import pytest
from openai import BaseModel as SDKModel
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import TypeAdapter

from engine_worker import protocol as p
from gateway.api.chat_request import parse_request
from gateway.api.responses.chat import decode_transcript, encode_transcript
from gateway.api.responses.events import ResponseEvents, response_from_events
from gateway.api.responses.request import (
    CANCELLED_CODE,
    REFUSED,
    CreateRequest,
    build_request,
    decode_create,
    previous_response_not_found,
    response_expired,
    response_not_found,
)
from gateway.config import Limits
from gateway.core.delivery import resume_point
from gateway.errors import APIError
from tests.responses_requests import parse_create

EVENT = TypeAdapter(ResponseStreamEvent)
LIMITS = Limits(default_max_tokens=64, max_tokens_cap=512)


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "input": "hi", **fields}).encode()


def no_extra_fields(model: Any, path: str = "$") -> None:
    """Every field we send is one the SDK type declares (its models allow extras, so check)."""
    if isinstance(model, SDKModel):
        extra = model.model_extra or {}
        assert not extra, f"{path}: fields unknown to the SDK: {sorted(extra)}"
        for name in type(model).model_fields:
            no_extra_fields(getattr(model, name), f"{path}.{name}")
    elif isinstance(model, list):
        for i, item in enumerate(model):
            no_extra_fields(item, f"{path}[{i}]")


def validate_event(ev: dict[str, Any]) -> Any:
    parsed = EVENT.validate_python(ev, strict=False)
    assert parsed.type == ev["type"]
    no_extra_fields(parsed)
    return parsed


def validate_response(obj: dict[str, Any]) -> Response:
    parsed = Response.model_validate(obj)
    no_extra_fields(parsed)
    return parsed


def run(builder: ResponseEvents, deltas: list[str], finish: str = "stop", usage: p.Usage | None = None
        ) -> list[dict[str, Any]]:
    events = builder.start()
    for d in deltas:
        events += builder.delta(d)
    return events + builder.finish(finish, usage or p.Usage(prompt_tokens=7, completion_tokens=len(deltas)))


# -- request parsing -------------------------------------------------------------------------------


def test_string_input_becomes_one_user_message_after_the_instructions() -> None:
    req = parse_create(body(instructions="Be brief.", max_output_tokens=20, temperature=0.5, top_p=0.9), LIMITS)
    chat = req.chat
    assert chat.endpoint == "chat.completions" and chat.model == "m" and chat.stream  # the engine always streams
    assert chat.submit_fields["messages"] == [p.ChatMessage("system", "Be brief."), p.ChatMessage("user", "hi")]
    s = chat.submit_fields["sampling"]
    assert (s.max_tokens, s.temperature, s.top_p) == (20, 0.5, 0.9)


def test_a_responses_request_submits_exactly_what_the_equivalent_chat_request_submits() -> None:
    responses = parse_create(json.dumps({
        "model": "m", "instructions": "sys", "max_output_tokens": 33, "temperature": 0.2, "top_p": 0.5,
        "stream": False,
        "input": [{"role": "developer", "content": "dev"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                  {"type": "input_text", "text": "b"}]},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
                  {"role": "user", "content": "d"}]}).encode(), LIMITS)
    chat_body = {
        "model": "m", "max_tokens": 33, "temperature": 0.2, "top_p": 0.5, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "sys"}, {"role": "system", "content": "dev"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
                     {"role": "user", "content": "d"}]}  # text parts unjoined: vLLM's chat layer joins them
    ours, chat = responses.chat.to_submit("r", "t"), parse_request("chat.completions", chat_body, LIMITS).to_submit("r", "t")
    assert json.loads(ours.body) == json.loads(chat.body) == chat_body  # the engine streams: events are built per step
    assert msgspec.structs.replace(ours, body=b"") == msgspec.structs.replace(chat, body=b"")
    assert ours.messages is not None and ours.stream and not responses.stream


def test_max_output_tokens_defaults_and_limits() -> None:
    assert parse_create(body(), LIMITS).max_tokens == 64
    for bad in (0, 513):
        with pytest.raises(APIError) as e:
            parse_create(body(max_output_tokens=bad), LIMITS)
        assert e.value.status == 400 and e.value.param == "max_output_tokens"


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5)])
def test_sampling_out_of_range_names_the_field(field: str, value: float) -> None:
    with pytest.raises(APIError) as e:
        parse_create(body(**{field: value}), LIMITS)
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "invalid_value")


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "custom", "name": "g"}]}, "tools[1]"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning.summary"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"text": {"format": {"type": "grammar", "grammar": "x"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_file", "file_id": "file_1"}]}]}, "input[0].content[1]"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "web_search_call", "id": "ws_1"}]}, "input[1]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0]"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"}]},
     "input[0].encrypted_content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
])
def test_unsupported_fields_get_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_create(body(**fields), LIMITS)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "unsupported_parameter")
    assert param in e.value.message


def test_harmless_values_of_unsupported_fields_are_accepted() -> None:
    req = parse_create(body(tools=[], tool_choice="auto", reasoning={"effort": None, "summary": None}, include=[], truncation="disabled",
                            text={"format": {"type": "text"}, "verbosity": "medium"}, parallel_tool_calls=False,
                            service_tier="flex", user="u", safety_identifier="s", prompt_cache_key="k",
                            store=True, metadata={"k": "v"}, stream_options={"include_obfuscation": False},
                            some_future_field={"x": 1}), LIMITS)
    assert req.store and req.req.metadata == {"k": "v"}


def test_every_create_parameter_of_the_installed_sdk_is_handled() -> None:
    """A field of the SDK's create params that this parser does not know would be silently ignored:
    each must be typed on CreateRequest (supported or refused-unless-harmless)."""
    known = set(CreateRequest.__struct_fields__)
    sdk_fields = set(ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert sdk_fields - known == set()
    assert set(REFUSED) <= known


@pytest.mark.parametrize(("raw", "param", "code"), [
    (b"", None, "invalid_json"),
    (b"{nope", None, "invalid_json"),
    (b'{"input": 5}', "input", "invalid_type"),
    (b'{"input": "x", "temperature": "hot"}', "temperature", "invalid_type"),
    (b'{"input": [{"role": "robot", "content": "x"}]}', "input[0].role", "invalid_value"),
    (b'{"input": []}', "input", "invalid_value"),
    (b'{"model": "m"}', "input", "invalid_value"),
    (b'{"input": "x", "background": true, "store": false}', "store", "invalid_value"),
    (b'{"input": "x", "metadata": {"k": "' + b"v" * 513 + b'"}}', "metadata", "invalid_value"),
])
def test_malformed_requests_get_a_400(raw: bytes, param: str | None, code: str) -> None:
    with pytest.raises(APIError) as e:
        parse_create(raw, LIMITS)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_previous_response_history_goes_between_the_instructions_and_the_new_input() -> None:
    first = parse_create(body(input="What is 2+2?", instructions="Answer in digits."), LIMITS)
    history = decode_transcript(encode_transcript(first.transcript({"role": "assistant", "content": "4"})))
    assert history == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    req = decode_create(body(input="And 3+3?", instructions="Answer in words.", previous_response_id="resp_1"))
    second = build_request(req, LIMITS, history)
    assert second.chat.submit_fields["messages"] == [
        p.ChatMessage("system", "Answer in words."), p.ChatMessage("user", "What is 2+2?"),
        p.ChatMessage("assistant", "4"), p.ChatMessage("user", "And 3+3?")]
    assert second.transcript({"role": "assistant", "content": "six"})[-2:] == [
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "six"}]
    only_history = build_request(decode_create(b'{"previous_response_id": "resp_1"}'), LIMITS, history)
    assert only_history.input_messages == [] and json.loads(only_history.chat.submit_fields["body"])["messages"] == history


def test_a_transcript_from_an_older_gateway_still_decodes() -> None:
    old = msgspec.msgpack.encode([p.ChatMessage("user", "hi"), p.ChatMessage("assistant", "yo")])
    assert decode_transcript(old) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_previous_response_not_found_is_the_documented_error() -> None:
    err = previous_response_not_found("resp_x")
    assert (err.status, err.param, err.code) == (400, "previous_response_id", "previous_response_not_found")
    assert "resp_x" in err.message


def test_retrieval_errors_and_starting_after() -> None:
    assert (response_not_found("r").status, response_expired("r").status) == (404, 410)
    assert [resume_point(v, "starting_after") for v in (None, "", "-1", "0", "17")] == [-1, -1, -1, 0, 17]
    for bad in ("x", "-2", "1.5"):
        with pytest.raises(APIError) as e:
            resume_point(bad, "starting_after")
        assert (e.value.status, e.value.param) == (400, "starting_after")


# -- events ----------------------------------------------------------------------------------------


COMPLETED_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                   "response.output_text.done", "response.content_part.done", "response.output_item.done",
                   "response.completed"]


def test_a_completed_response_has_every_event_in_order_with_contiguous_sequence_numbers() -> None:
    req = parse_create(body(instructions="i", metadata={"a": "b"}, temperature=0.3), LIMITS)
    events = run(ResponseEvents("resp_1", "m", 1_700_000_000, req), ["Hel", "lo"],
                 usage=p.Usage(prompt_tokens=5, completion_tokens=2))
    assert [e["type"] for e in events] == COMPLETED_ORDER
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    parsed = [validate_event(e) for e in events]
    assert parsed[4].delta == "Hel" and parsed[4].logprobs == [] and parsed[4].item_id == parsed[2].item.id
    assert (parsed[4].output_index, parsed[4].content_index) == (0, 0)
    assert parsed[6].text == "Hello"
    final = parsed[-1].response
    assert final.status == "completed" and final.output_text == "Hello" and final.completed_at is not None
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (5, 2, 7)
    assert final.usage.input_tokens_details.cached_tokens == 0
    assert final.usage.output_tokens_details.reasoning_tokens == 0
    assert (final.instructions, final.metadata, final.temperature, final.model) == ("i", {"a": "b"}, 0.3, "m")
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []


def test_the_sdk_stream_accumulator_rebuilds_the_final_response() -> None:
    events = run(ResponseEvents("resp_1", "m", 0, parse_create(body(), LIMITS)), ["a", "b", "c"])
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for ev in events:
        state.handle_event(validate_event(ev))
    assert state._completed_response is not None and state._completed_response.output_text == "abc"


def test_length_ends_incomplete_with_max_output_tokens() -> None:
    events = run(ResponseEvents("resp_1", "m", 0, parse_create(body(max_output_tokens=2), LIMITS)), ["a", "b"],
                 finish="length")
    last = validate_event(events[-1])
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].status == "incomplete" and last.response.output_text == "ab"
    assert last.response.max_output_tokens == 2


def test_an_engine_failure_ends_with_response_failed() -> None:
    b = ResponseEvents("resp_1", "m", 0, parse_create(body(), LIMITS))
    events = b.start() + b.delta("par") + b.fail(APIError(503, "engine down", type="server_error",
                                                          code="engine_unavailable"))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = validate_event(events[-1])
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error" and last.response.error.message == "engine down"
    assert b.done and b.response()["status"] == "failed"
    assert validate_event(b.finish("error", None)[-1]).type == "response.failed"


def test_a_cancelled_response_ends_with_an_error_event_and_status_cancelled() -> None:
    b = ResponseEvents("resp_1", "m", 0, parse_create(body(background=True), LIMITS))
    events = b.start() + b.delta("x") + b.finish("abort", None)
    last = validate_event(events[-1])
    assert last.type == "error" and last.code == CANCELLED_CODE
    assert validate_event(events[-2]).item.status == "incomplete"
    assert validate_response(b.response()).status == "cancelled"
    assert response_from_events(events)["status"] == "cancelled"


def test_a_background_response_is_queued_until_in_progress() -> None:
    b = ResponseEvents("resp_1", "m", 0, parse_create(body(background=True), LIMITS))
    created = validate_event(b.created()[0])
    assert created.response.status == "queued" and created.response.background is True
    assert validate_response(b.response()).status == "queued"
    assert validate_event(b.in_progress()[0]).response.status == "in_progress"


def test_a_warmup_completes_with_no_output() -> None:
    b = ResponseEvents("resp_1", "m", 0, parse_create(body(), LIMITS))
    events = b.created() + b.in_progress() + b.finish("stop", p.Usage(3, 0))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert validate_event(events[-1]).response.output == []


def test_the_folded_log_is_the_response_object_at_every_point() -> None:
    b = ResponseEvents("resp_1", "m", 0, parse_create(body(), LIMITS))
    log: list[dict[str, Any]] = []
    for step in (b.created, b.in_progress, lambda: b.delta("one "), lambda: b.delta("two"),
                 lambda: b.finish("stop", p.Usage(1, 2))):
        log += step()
        folded = response_from_events(log)
        assert folded == b.response()
        validate_response(folded)
    assert response_from_events(log)["output"][0]["content"][0]["text"] == "one two"


def test_a_builder_rebuilt_from_a_log_prefix_continues_it() -> None:
    b = ResponseEvents("resp_1", "m", 0, parse_create(body(), LIMITS))
    log = b.start() + b.delta("a") + b.delta("b")
    resumed = ResponseEvents.from_events(log)
    tail = resumed.fail(APIError(502, "owner lost", type="server_error", code="owner_lost"))
    full = log + tail
    assert [e["sequence_number"] for e in full] == list(range(len(full)))
    assert validate_event(tail[0]).text == "ab" and validate_event(tail[-1]).response.output_text == "ab"


def test_merged_deltas_fold_to_the_same_text() -> None:
    """The slow-reader policy merges consecutive deltas into the last one's sequence_number."""
    events = run(ResponseEvents("resp_1", "m", 0, parse_create(body(), LIMITS)), ["a", "b", "c"])
    merged = {**events[6], "delta": "abc"}
    assert response_from_events(events[:4] + [merged] + events[7:]) == response_from_events(events)


@pytest.mark.parametrize("status", ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"])
def test_the_response_object_validates_in_every_status(status: str) -> None:
    b = ResponseEvents("resp_1", "m", 0, parse_create(body(background=True), LIMITS))
    if status != "queued":
        b.start()
        b.delta("t")
    {"completed": lambda: b.finish("stop", p.Usage(1, 1)), "incomplete": lambda: b.finish("length", p.Usage(1, 1)),
     "failed": lambda: b.fail(APIError(500, "x", type="server_error", code="engine_error")),
     "cancelled": b.cancel}.get(status, list)()
    assert validate_response(b.response()).status == status


# -- the unmodified SDK against what these modules build -------------------------------------------


class _Server:
    """In-process Responses endpoints over the pure modules: each response's events are kept as a
    list (the stream log's stand-in); GET replays it after ``starting_after``; cancel ends it."""

    def __init__(self, deltas: list[str], finish: str = "stop") -> None:
        self.deltas = deltas
        self.finish = finish
        self.logs: dict[str, list[dict[str, Any]]] = {}
        self.builders: dict[str, ResponseEvents] = {}
        self.requests: list[dict[str, Any]] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        try:
            if request.method == "POST" and path == "/v1/responses":
                return self.create(request.content)
            m = re.fullmatch(r"/v1/responses/([^/]+)(/cancel)?", path)
            if m and request.method == "POST" and m.group(2):
                b = self.builders[m.group(1)]
                if not b.done:
                    self.logs[b.id] += b.cancel()
                return httpx2.Response(200, json=b.response())
            if m and request.method == "GET":
                rid = m.group(1)
                if rid not in self.logs:
                    raise APIError(404, f"No response found with id '{rid}'.", code="not_found")
                if request.url.params.get("stream") == "true":
                    after = int(request.url.params.get("starting_after", -1))
                    return self.sse([e for e in self.logs[rid] if e["sequence_number"] > after])
                return httpx2.Response(200, json=self.builders[rid].response())
        except APIError as err:
            return httpx2.Response(err.status, content=err.to_bytes(), headers={"content-type": "application/json"})
        return httpx2.Response(404)

    def create(self, raw: bytes) -> httpx2.Response:
        self.requests.append(json.loads(raw))
        req = parse_create(raw, LIMITS)
        b = ResponseEvents(f"resp_{len(self.logs)}", req.chat.model or "m", 0, req)
        log = run(b, self.deltas, self.finish)
        self.logs[b.id], self.builders[b.id] = log, b
        return self.sse(log) if req.stream else httpx2.Response(200, json=b.response())

    @staticmethod
    def sse(events: list[dict[str, Any]]) -> httpx2.Response:
        data = b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in events)
        return httpx2.Response(200, content=data, headers={"content-type": "text/event-stream"})


def sdk_client(server: _Server) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://gateway.test/v1", api_key="k", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(server)),
                         _strict_response_validation=True)


def test_sdk_streams_a_response_and_gets_typed_events() -> None:
    client = sdk_client(_Server(["Hel", "lo"]))
    events = list(client.responses.create(model="m", input="hi", stream=True, max_output_tokens=9))
    assert [e.type for e in events] == COMPLETED_ORDER
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert events[-1].response.usage.output_tokens == 2  # type: ignore[union-attr]


def test_sdk_stream_helper_returns_the_final_response() -> None:
    client = sdk_client(_Server(["a", "b"]))
    with client.responses.stream(model="m", input=[{"role": "user", "content": "hi"}],
                                 instructions="x") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == "ab" and final.output_text == "ab" and final.status == "completed"


def test_sdk_non_streaming_create_and_retrieve() -> None:
    server = _Server(["x", "y"], finish="length")
    client = sdk_client(server)
    resp = client.responses.create(model="m", input="hi", max_output_tokens=2, metadata={"k": "v"})
    assert resp.status == "incomplete" and resp.output_text == "xy"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id and again.output_text == "xy" and again.metadata == {"k": "v"}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")


def test_sdk_resumes_with_starting_after_and_gets_exactly_the_missing_events() -> None:
    server = _Server(["a", "b", "c", "d"])
    client = sdk_client(server)
    first = client.responses.create(model="m", input="hi", background=True, stream=True)
    seen = []
    for ev in first:  # the connection "drops" after the second delta
        seen.append(ev)
        if ev.type == "response.output_text.delta" and ev.delta == "b":
            first.close()
            break
    rid, last = seen[0].response.id, seen[-1].sequence_number  # type: ignore[union-attr]
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=last))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(server.logs[rid])))
    assert "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta") == "abcd"
    with client.responses.stream(response_id=rid, starting_after=last) as stream:  # the helper filters itself
        assert [e.sequence_number for e in stream] == [e.sequence_number for e in rest]
        assert stream.get_final_response().output_text == "abcd"


def test_sdk_cancel_returns_the_cancelled_response() -> None:
    server = _Server(["a"])
    client = sdk_client(server)
    resp = client.responses.create(model="m", input="hi", background=True)
    server.builders[resp.id] = b = ResponseEvents(resp.id, "m", 0, parse_create(body(background=True), LIMITS))
    server.logs[resp.id] = b.start() + b.delta("par")
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled" and cancelled.output_text == "par"
    tail = list(client.responses.retrieve(resp.id, stream=True, starting_after=4))
    assert tail[-1].type == "error" and tail[-1].code == CANCELLED_CODE  # type: ignore[union-attr]


def test_sdk_sees_an_unsupported_field_as_a_bad_request_naming_it() -> None:
    client = sdk_client(_Server(["a"]))
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    assert e.value.param == "tools[0]" and e.value.code == "unsupported_parameter"
