"""The Responses API's function tools, structured output and reasoning items, without an engine.

The request side: a Responses request becomes the chat body vLLM's OpenAI layer serves (tools,
``tool_choice``, ``text.format``, ``function_call`` / ``function_call_output`` items, a stored
transcript). The event side: vLLM's chat chunks (``delta.reasoning``, ``delta.content``,
``delta.tool_calls``) become reasoning, message and ``function_call`` items, checked with the official
SDK's types, its stream accumulator and the unmodified client (``responses.parse`` with a Pydantic model).
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from pydantic import BaseModel

from engine_worker import protocol as p
from gateway.api.responses.chat import decode_transcript, encode_transcript, responses_param
from gateway.api.responses.events import ResponseEvents, response_from_events
from gateway.api.responses.request import build_request, decode_create
from gateway.api.responses.stream import RESPONSES_MERGE
from gateway.core.merge import coalesce
from gateway.core.streams import encode_event
from gateway.errors import APIError
from tests.responses_requests import parse_create
from tests.test_responses_api import LIMITS, _Server, sdk_client, validate_event, validate_response

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


def chat_body(**fields: Any) -> dict[str, Any]:
    req = parse_create(json.dumps({"model": "m", "input": "Weather in Paris?", **fields}).encode(), LIMITS)
    return json.loads(req.chat.submit_fields["body"])  # type: ignore[no-any-return]


# -- request -> chat body --------------------------------------------------------------------------


def test_function_tools_tool_choice_and_text_format_become_their_chat_forms() -> None:
    body = chat_body(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                     parallel_tool_calls=False, reasoning={"effort": "low"},
                     text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}})
    assert body["tools"] == [CHAT_WEATHER]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False and body["reasoning_effort"] == "low"
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA,
                                                                             "strict": True}}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert chat_body(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_body(text={"format": {"type": "text"}})


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_string_tool_choices_pass_as_they_are(choice: str) -> None:
    assert chat_body(tools=[WEATHER], tool_choice=choice)["tool_choice"] == choice


def test_tool_choice_without_tools_reaches_the_engine_only_when_it_asks_for_a_call() -> None:
    assert "tool_choice" not in chat_body(tool_choice="auto") and "tools" not in chat_body(tool_choice="none")
    assert chat_body(tool_choice="required")["tool_choice"] == "required"  # the engine refuses it, as vLLM does


def test_a_tool_request_leaves_the_plain_path_and_a_plain_one_keeps_it() -> None:
    tools = parse_create(json.dumps({"input": "x", "tools": [WEATHER]}).encode(), LIMITS)
    assert "messages" not in tools.chat.submit_fields  # vLLM's layer: the body only
    plain = parse_create(json.dumps({"input": "x"}).encode(), LIMITS)
    assert plain.chat.submit_fields["messages"] == [p.ChatMessage("user", "x")]


def test_vllm_extension_fields_are_forwarded_for_the_engine_to_validate() -> None:
    body = chat_body(structured_outputs={"regex": "a+"}, chat_template_kwargs={"enable_thinking": False}, seed=3,
                     some_future_field=1)
    assert body["structured_outputs"] == {"regex": "a+"} and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["seed"] == 3 and "some_future_field" not in body


def test_function_call_and_output_items_become_an_assistant_tool_call_and_a_tool_message() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}',
            "id": "fc_1", "status": "completed"}
    second = {**call, "call_id": "call_2", "arguments": '{"city":"Lyon"}'}
    body = chat_body(tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        call, second,
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "12 C"}]}])
    assert body["messages"] == [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": None, "reasoning": "hm", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12 C"}]}]


def test_an_assistant_message_and_the_calls_after_it_are_one_chat_message() -> None:
    body = chat_body(input=[{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
                            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert body["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {"x": 1}}, "input[0].arguments"),
    ({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
])
def test_malformed_tool_items_name_the_field(item: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        chat_body(input=[item])
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_malformed_tools_and_formats_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        chat_body(**fields)
    assert (e.value.status, e.value.param) == (400, param)


def test_engine_errors_name_the_responses_field_not_the_chat_one() -> None:
    assert [responses_param(x) for x in ("messages", "messages[3].content", "response_format", "max_tokens",
                                         "tool_choice", "tools[0].function", "seed", None)] == [
        "input", "input", "text.format", "max_output_tokens", "tool_choice", "tools[0].function", "seed", None]


def test_a_tool_call_turn_is_continued_from_its_transcript() -> None:
    first = parse_create(json.dumps({"input": "Weather in Paris?", "tools": [WEATHER]}).encode(), LIMITS)
    b = ResponseEvents("resp_1", "m", 0, first)
    b.start()
    b.chunk(tool_chunk(0, "chatcmpl-tool-1", "get_weather", ""))
    b.chunk(tool_chunk(0, None, None, '{"city": "Paris"}'))
    b.finish("stop", p.Usage(9, 7))
    history = decode_transcript(encode_transcript(first.transcript(b.turn())))
    second = build_request(decode_create(json.dumps({
        "previous_response_id": "resp_1", "tools": [WEATHER],
        "input": [{"type": "function_call_output", "call_id": "chatcmpl-tool-1", "output": "18 C"}]}).encode()),
        LIMITS, history)
    assert json.loads(second.chat.submit_fields["body"])["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C"}]


def test_the_response_echoes_tools_tool_choice_text_format_and_effort_as_the_sdk_types_them() -> None:
    req = parse_create(json.dumps({"input": "x", "tools": [{"type": "function", "name": "f"}],
                                   "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"effort": "high"},
                                   "text": {"format": {"type": "json_schema", "name": "v", "schema": SCHEMA}}}).encode(),
                       LIMITS)
    r = validate_response(ResponseEvents("resp_1", "m", 0, req).response())
    assert r.tools[0].name == "f" and r.tool_choice.name == "f"  # type: ignore[union-attr]
    assert r.text is not None and r.text.format.type == "json_schema"  # type: ignore[union-attr]
    assert r.reasoning is not None and r.reasoning.effort == "high"


# -- chat chunks -> events -------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def tool_chunk(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return chunk({"tool_calls": [call]})


ROLE = chunk({"role": "assistant", "content": ""})
USAGE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
                   "completion_tokens_details": {"reasoning_tokens": 2}}}


def run_chunks(chunks: list[dict[str, Any]], finish: str = "stop", request: Any = None) -> tuple[
        ResponseEvents, list[dict[str, Any]]]:
    b = ResponseEvents("resp_1", "m", 0, request)
    events = b.start()
    for c in chunks:
        events += b.chunk(c)
    return b, events + b.finish(finish, p.Usage(9, 7))


def accumulate(events: list[dict[str, Any]], tools: Any = openai.omit, text_format: Any = openai.omit) -> Any:
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=tools, text_format=text_format)
    for ev in events:
        state.handle_event(validate_event(ev))
    assert state._completed_response is not None
    return state._completed_response


def test_a_streamed_tool_call_is_a_function_call_item_with_argument_deltas() -> None:
    b, events = run_chunks([ROLE, tool_chunk(0, "chatcmpl-tool-1", "get_weather", ""),
                            tool_chunk(0, None, None, '{"city": '), tool_chunk(0, None, None, '"Paris"}'),
                            chunk({}, "tool_calls"), USAGE])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added, done = validate_event(events[2]).item, validate_event(events[6]).item
    assert (added.type, added.name, added.call_id, added.arguments, added.status) == (
        "function_call", "get_weather", "chatcmpl-tool-1", "", "in_progress")
    assert (done.id, done.arguments, done.status) == (added.id, '{"city": "Paris"}', "completed")
    assert validate_event(events[5]).arguments == '{"city": "Paris"}'
    final = accumulate(events, tools=[WEATHER])
    assert final.output[0].parsed_arguments == {"city": "Paris"} and final.output_text == ""
    assert b.turn() == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}}]}


def test_reasoning_then_text_then_two_calls_are_four_items_in_order() -> None:
    _, events = run_chunks([ROLE, chunk({"reasoning": "Think"}), chunk({"reasoning": "ing."}),
                            chunk({"content": "Checking."}), tool_chunk(0, "c0", "get_weather", '{"city": "Paris"}'),
                            tool_chunk(1, "c1", "get_weather", '{"city": '), tool_chunk(1, None, None, '"Lyon"}'),
                            chunk({}, "tool_calls"), USAGE])
    final = accumulate(events, tools=[WEATHER])
    assert final.usage.output_tokens == 7 and final.usage.output_tokens_details.reasoning_tokens == 2
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Thinking." and final.output[0].summary == []
    assert final.output_text == "Checking."
    assert [(o.call_id, o.arguments) for o in final.output[2:]] == [("c0", '{"city": "Paris"}'),
                                                                     ("c1", '{"city": "Lyon"}')]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2, 3]
    kinds = [e["type"] for e in events]
    assert kinds[2:8] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.content_part.done"]


def test_a_chunk_with_reasoning_content_and_calls_at_once_splits_in_vllms_order() -> None:
    both = chunk({"reasoning": "r", "content": "c", "tool_calls": [
        {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]})
    _, events = run_chunks([both])
    final = accumulate(events)
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [
        ("reasoning", None), ("message", None), ("function_call", "f"), ("function_call", "g")]


def test_a_call_cut_by_max_output_tokens_is_incomplete() -> None:
    _, events = run_chunks([tool_chunk(0, "c", "get_weather", '{"ci')], finish="length")
    last = validate_event(events[-1])
    assert last.type == "response.incomplete" and last.response.output[0].status == "incomplete"
    assert last.response.output[0].arguments == '{"ci'


def test_a_usage_only_chunk_and_an_empty_delta_add_no_event() -> None:
    b = ResponseEvents("resp_1", "m", 0)
    b.start()
    assert b.chunk(USAGE) == [] and b.chunk(ROLE) == [] and b.chunk(chunk({}, "stop")) == []


def test_the_folded_log_is_the_response_at_every_point_of_a_tool_call() -> None:
    b = ResponseEvents("resp_1", "m", 0)
    log = b.start()
    for c in (chunk({"reasoning": "r"}), tool_chunk(0, "c", "f", '{"a":'), tool_chunk(0, None, None, "1}")):
        log += b.chunk(c)
        assert response_from_events(log) == b.response()
        validate_response(b.response())
    log += b.finish("stop", p.Usage(1, 2))
    assert response_from_events(log) == b.response()
    resumed = ResponseEvents.from_events(log[:-3])  # mid-call: rebuilt, then closed by a failure
    tail = resumed.fail(APIError(502, "owner lost", type="server_error", code="owner_lost"))
    assert [e["sequence_number"] for e in tail] == list(range(len(log) - 3, len(log) - 3 + len(tail)))
    assert validate_event(tail[0]).arguments == '{"a":1}'
    assert validate_event(tail[-1]).response.output[1].status == "incomplete"


def test_a_lagging_reader_gets_every_argument_delta_unmerged() -> None:
    _, events = run_chunks([tool_chunk(0, "c", "f", "{"), tool_chunk(0, None, None, '"a"'),
                            tool_chunk(0, None, None, ":1}")])
    log = [encode_event(e["sequence_number"], e, e.get("delta", ""), None) for e in events]
    assert [e.payload for e in coalesce(log, RESPONSES_MERGE)] == [e.payload for e in log]


# -- the unmodified SDK ----------------------------------------------------------------------------


class _ChunkServer(_Server):
    """``_Server`` answering every create with scripted chat chunks (vLLM's layer's output)."""

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        super().__init__([])
        self.chunks = chunks

    def create(self, raw: bytes) -> httpx2.Response:
        self.requests.append(json.loads(raw))
        req = parse_create(raw, LIMITS)
        b, log = run_chunks(self.chunks, request=req)
        self.logs[b.id], self.builders[b.id] = log, b
        return self.sse(log) if req.stream else httpx2.Response(200, json=b.response())


class Verdict(BaseModel):
    answer: str


def test_sdk_parse_with_a_pydantic_model_gets_the_parsed_object() -> None:
    server = _ChunkServer([ROLE, chunk({"content": '{"answer":'}), chunk({"content": '"yes"}'}), chunk({}, "stop")])
    client = sdk_client(server)
    parsed = client.responses.parse(model="m", input="Is it sunny?", text_format=Verdict)
    assert parsed.output_parsed == Verdict(answer="yes")
    sent = server.requests[-1]["text"]["format"]
    assert sent["type"] == "json_schema" and sent["name"] == "Verdict" and sent["strict"] is True
    with client.responses.stream(model="m", input="Is it sunny?", text_format=Verdict) as stream:
        assert stream.get_final_response().output_parsed == Verdict(answer="yes")


def test_sdk_create_with_tools_gets_function_calls_streamed_and_not() -> None:
    server = _ChunkServer([ROLE, tool_chunk(0, "c1", "get_weather", '{"city": "Paris"}'), chunk({}, "tool_calls")])
    client = sdk_client(server)
    tools: Any = [WEATHER]
    resp = client.responses.create(model="m", input="Weather?", tools=tools, tool_choice="required")
    call = resp.output[0]
    assert call.type == "function_call" and (call.name, call.call_id, call.arguments) == (
        "get_weather", "c1", '{"city": "Paris"}')
    events = list(client.responses.create(model="m", input="Weather?", tools=tools, stream=True))
    assert [e.type for e in events if "function_call" in e.type] == ["response.function_call_arguments.delta",
                                                                     "response.function_call_arguments.done"]
    with client.responses.stream(model="m", input="Weather?", tools=tools) as stream:
        final = stream.get_final_response()
    assert final.output[0].parsed_arguments == {"city": "Paris"}  # type: ignore[union-attr]
