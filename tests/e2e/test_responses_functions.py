"""Function calling and structured output on the Responses API, with the unmodified Python ``openai`` SDK,
against the session's parser-configured ``tokenfan serve`` (``parser_gateway``: the tiny random-weight model
with vLLM's hermes tool parser, qwen3 reasoning parser and xgrammar structured outputs).

A random-weight model calls a tool only when structured outputs force it: ``tool_choice`` ``required`` or
a named function (vLLM constrains the arguments to the tool's schema; this model writes ``null``), or
``tool_choice: auto`` with a regex that makes it write a Hermes ``<tool_call>`` block (vLLM's parser then
extracts ``{"city": "Paris"}``). Every turn is greedy, so a continuation by ``previous_response_id`` and the
same conversation sent whole must give the same prompt and the same answer.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.helpers import drop_inside_the_call, until_terminal
from tests.e2e.test_responses_sdk import client_for

pytestmark = pytest.mark.vllm

WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
QUESTION = "What is the weather in Paris?"
# tool_choice auto, the call forced by a regex: vLLM's parser extracts it (a vLLM extension field, as on chat)
FORCED_CALL: dict[str, Any] = {"tools": [WEATHER], "max_output_tokens": 80, "temperature": 0,
                               "extra_body": {**NO_THINK, "structured_outputs": {"regex": HERMES_CALL}}}


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def client(parser_gateway: str) -> openai.OpenAI:
    return client_for(parser_gateway)


def only_call(response: Any) -> Any:
    assert [o.type for o in response.output] == ["function_call"], response.output
    return response.output[0]


def test_create_with_tools_returns_a_function_call_streamed_and_not(client: openai.OpenAI) -> None:
    # one call (without parallel_tool_calls: false the constrained model writes calls until max_output_tokens)
    required = client.responses.create(model="tiny", input=QUESTION, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=0,
                                       extra_body=NO_THINK)
    call = only_call(required)
    assert call.name == "get_weather" and call.status == "completed" and call.call_id
    json.loads(call.arguments)  # what the constrained random model writes: valid JSON (vLLM allows `null`)
    assert required.status == "completed" and required.tool_choice == "required"
    assert [t.name for t in required.tools] == ["get_weather"]

    events = list(client.responses.create(model="tiny", input=QUESTION, stream=True, **FORCED_CALL))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2].item, events[-2].item  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (added.type, added.name, added.arguments) == ("function_call", "get_weather", "")
    assert deltas == events[-3].arguments == done.arguments == '{"city": "Paris"}'  # type: ignore[union-attr]
    assert done.call_id == added.call_id and events[-1].response.output[0].arguments == deltas  # type: ignore[union-attr]

    with client.responses.stream(model="tiny", input=QUESTION, **FORCED_CALL) as stream:
        final = stream.get_final_response()
    assert only_call(final).parsed_arguments is None  # non-strict tool: the SDK leaves arguments unparsed
    assert json.loads(only_call(final).arguments) == {"city": "Paris"}


def test_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input=QUESTION, tools=[WEATHER], max_output_tokens=64, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, extra_body=NO_THINK)
    assert only_call(r).name == "get_weather" and r.tool_choice.name == "get_weather"  # type: ignore[union-attr]


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="tiny", input="Is it sunny?", text_format=Verdict, max_output_tokens=30,
                                    temperature=0, extra_body=NO_THINK)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Verdict)
    assert parsed.text is not None and parsed.text.format.type == "json_schema"  # type: ignore[union-attr]
    with client.responses.stream(model="tiny", input="Is it sunny?", text_format=Verdict, max_output_tokens=30,
                                 temperature=0, extra_body=NO_THINK) as stream:
        assert stream.get_final_response().output_parsed == parsed.output_parsed
    obj = client.responses.create(model="tiny", input="Answer in JSON.", text={"format": {"type": "json_object"}},
                                  max_output_tokens=12, temperature=0, extra_body=NO_THINK)
    assert obj.output_text.startswith("{")  # constrained to JSON (it may be cut by max_output_tokens)


def test_a_tool_loop_continues_by_previous_response_id_exactly_as_with_the_whole_conversation(
        client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input=QUESTION, **FORCED_CALL)
    call = only_call(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    turn: dict[str, Any] = {"tools": [WEATHER], "max_output_tokens": 6, "temperature": 0, "extra_body": NO_THINK}
    continued = client.responses.create(model="tiny", previous_response_id=first.id, input=[result], **turn)
    whole = client.responses.create(model="tiny", input=[{"role": "user", "content": QUESTION},
                                                         call.model_dump(exclude_none=True), result], **turn)
    assert continued.output_text and continued.output_text == whole.output_text
    assert continued.usage is not None and whole.usage is not None
    assert continued.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    assert continued.previous_response_id == first.id


def test_a_tool_loop_over_websocket_mode(client: openai.OpenAI) -> None:
    with client.responses.connect() as conn:
        # vLLM's extension fields travel in the event itself (the SDK's create() has no extra_body here)
        conn.send({"type": "response.create", "model": "tiny", "input": QUESTION, "tools": [WEATHER],
                   "max_output_tokens": 80, "temperature": 0, **FORCED_CALL["extra_body"]})
        first = until_terminal(conn)
        done = [e.item for e in first if e.type == "response.output_item.done"]
        assert [(i.type, i.name, i.arguments) for i in done] == [("function_call", "get_weather", '{"city": "Paris"}')]
        conn.send({"type": "response.create", "model": "tiny", "previous_response_id": first[-1].response.id,
                   "tools": [WEATHER], "max_output_tokens": 6, "temperature": 0, **NO_THINK,
                   "input": [{"type": "function_call_output", "call_id": done[0].call_id, "output": "18 C"}]})
        second = until_terminal(conn)
    assert second[-1].type in ("response.completed", "response.incomplete")
    assert second[-1].response.output_text and second[-1].response.output[0].type == "message"


def test_a_background_tool_call_resumes_after_a_drop_with_every_event_once(client: openai.OpenAI) -> None:
    seen = drop_inside_the_call(client.responses.create(model="tiny", input=QUESTION, background=True, stream=True,
                                                        **FORCED_CALL))
    rid, last = seen[0].response.id, seen[-1].sequence_number
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=last))
    replay = list(client.responses.retrieve(rid, stream=True))
    assert rest[-1].type == "response.completed"
    got = seen + rest
    assert [e.sequence_number for e in got] == list(range(len(got)))  # none missing, none repeated
    assert [e.model_dump() for e in got] == [e.model_dump() for e in replay]
    args = "".join(e.delta for e in got if e.type == "response.function_call_arguments.delta")
    assert args == '{"city": "Paris"}' == client.responses.retrieve(rid).output[0].arguments  # type: ignore[union-attr]
