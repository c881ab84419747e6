"""Unmodified agent SDKs against ``tokenfan serve`` with vLLM's Hermes tool parser and xgrammar structured
outputs (the session's ``parser_gateway``, shared with the differential suite): the Python ``openai`` package
here, and through ``tests/node/agent_sdks.mjs`` the Node ``openai`` package and the Vercel AI SDK (``ai`` with
``@ai-sdk/openai-compatible``, zod schemas).

The model has random weights, so what it writes is forced by vLLM's structured outputs: a ``json_schema``
response format (built by the SDK from a Pydantic model or a zod schema) for structured answers, and for tool
calls a regex in vLLM's ``structured_outputs`` extra field that makes it write a Hermes ``<tool_call>`` block,
the city and unit inside left to the (greedy) model. vLLM's parser turns that block into ``tool_calls`` only
because the request carries ``tools``: the control test sends the same request without them and gets text.

Not covered, because vLLM 0.32 cannot make a random-weight model produce them (``vllm serve`` answers the
same): *strict* function tools (``openai.pydantic_function_tool``, the Node SDK's ``zodFunction``, hence
``parse(tools=...)``). A strict tool makes vLLM constrain the output with the Hermes parser's own grammar,
which replaces the request's ``structured_outputs`` and lets this model write whitespace until ``max_tokens``.

Run the Node scenarios by hand with ``node tests/node/agent_sdks.mjs http://127.0.0.1:8000 [scenario ...]``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
)
from pydantic import BaseModel, Field

from tests.procs import run_node

pytestmark = pytest.mark.vllm

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome|Oslo)", "unit": "(c|f)"\}\}</tool_call>')
FORCED_CALL = {**NO_THINK, "structured_outputs": {"regex": HERMES_CALL}}
TOOL_TOKENS = 120  # the forced block is ~75 tokens of the tiny model's tokenizer


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["c", "f"]


WEATHER_TOOL: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": Weather.model_json_schema()}}


@pytest.fixture(scope="module")
def client(parser_gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=parser_gateway + "/v1", api_key="unused", max_retries=0, timeout=120)


def call_weather(client: openai.OpenAI) -> ChatCompletion:
    return client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL],
                                          tool_choice="auto", max_tokens=TOOL_TOKENS, temperature=0,
                                          extra_body=FORCED_CALL)


def the_call(message: ChatCompletionMessage) -> ChatCompletionMessageFunctionToolCall:
    """The message's one tool call, a function call."""
    [call] = message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall), call
    return call


# -- Python openai ----------------------------------------------------------------------------------------


def test_parse_returns_an_instance_of_the_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model="tiny", messages=QUESTION, response_format=Verdict,
                                               max_tokens=64, temperature=0, extra_body=NO_THINK)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict)
    assert choice.message.content is not None
    assert choice.message.parsed == Verdict.model_validate_json(choice.message.content)
    assert choice.message.refusal is None and not choice.message.tool_calls


def test_create_with_tools_returns_the_call_in_message_tool_calls(client: openai.OpenAI) -> None:
    choice = call_weather(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = the_call(choice.message)
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)


def test_the_same_text_without_tools_is_not_a_tool_call(client: openai.OpenAI) -> None:
    """The control: the call above comes from vLLM's parser acting on the request's ``tools``."""
    choice = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=TOOL_TOKENS,
                                            temperature=0, extra_body=FORCED_CALL).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(HERMES_CALL, choice.message.content or "")


def test_stream_tool_call_events_carry_the_name_and_end_with_the_arguments_of_create(
        client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL],
                                        tool_choice="auto", max_tokens=TOOL_TOKENS, temperature=0,
                                        extra_body=FORCED_CALL,
                                        stream_options={"include_usage": True}) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(deltas) > 3 and all(e.name == "get_weather" and e.index == 0 for e in deltas)
    assert done.name == "get_weather" and "".join(e.arguments_delta for e in deltas) == done.arguments
    assert "".join(e.delta for e in events if e.type == "content.delta") == ""

    created = call_weather(client)
    assert done.arguments == the_call(created.choices[0].message).function.arguments
    call = the_call(final.choices[0].message)
    assert call.id and (call.function.name, call.function.arguments) == ("get_weather", done.arguments)
    Weather.model_validate_json(done.arguments)
    assert final.choices[0].finish_reason == created.choices[0].finish_reason == "tool_calls"
    assert final.usage is not None and created.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
        created.usage.prompt_tokens, created.usage.completion_tokens)


def test_an_agent_loop_sends_the_call_and_the_tool_result_back(client: openai.OpenAI) -> None:
    """As an agent does: the SDK's own message object appended, the tool's answer in a ``tool`` message; the
    next turn's prompt (vLLM's ``return_prompt_text``) holds both, rendered by the model's chat template."""
    first = call_weather(client)
    message = first.choices[0].message
    call = the_call(message)
    messages: list[Any] = [*QUESTION, message,
                           {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                            max_tokens=6, temperature=0,
                                            extra_body={**NO_THINK, "return_prompt_text": True})
    choice = second.choices[0]
    assert choice.finish_reason == "length" and choice.message.content and not choice.message.tool_calls
    prompt = (second.model_extra or {})["prompt_text"]
    assert '<|tool|>\n{"celsius": 18}' in prompt
    sent = re.search(r'<tool_call>\{"name": "get_weather", "arguments": (.*?)\}</tool_call>', prompt)
    assert sent and json.loads(sent.group(1)) == json.loads(call.function.arguments)


# -- Node openai and the Vercel AI SDK (tests/node/agent_sdks.mjs) -----------------------------------------


def _weather_call(call: dict[str, Any]) -> dict[str, Any]:
    """A Vercel tool call as the harness reports it: the zod schema accepted its input."""
    assert call["toolName"] == "get_weather" and call["hasId"] and call["valid"]
    Weather.model_validate(call["input"])
    return call["input"]  # type: ignore[no-any-return]


def check_openai_parse(r: dict[str, Any]) -> None:
    assert r["finish_reason"] == "stop" and r["valid"]
    assert Verdict.model_validate(r["parsed"]) == Verdict.model_validate_json(r["content"])


def check_openai_tools(r: dict[str, Any]) -> None:
    stream, create = r["stream"], r["create"]
    deltas = stream["deltas"]
    assert len(deltas) > 3 and {(d["name"], d["index"]) for d in deltas} == {("get_weather", 0)}
    [done] = stream["done"]
    assert done["name"] == "get_weather" and "".join(d["delta"] for d in deltas) == done["arguments"]
    Weather.model_validate_json(done["arguments"])
    for result in (stream, create):
        assert result["finish_reason"] == "tool_calls"
        [call] = result["tool_calls"]
        assert call["id"] and call["type"] == "function"
        assert (call["name"], call["arguments"]) == ("get_weather", done["arguments"])
    assert create["content"] is None
    assert stream["usage"]["completion_tokens"] == create["usage"]["completion_tokens"] > 0


def check_vercel_stream_text(r: dict[str, Any]) -> None:
    assert not r["errors"] and not r["warnings"]
    assert {"tool-input-start", "tool-input-delta", "tool-call", "finish"} <= set(r["types"])
    assert r["started"] == ["get_weather"] and r["finish_reason"] == "tool-calls" and r["text"] == ""
    [call] = r["tool_calls"]
    assert json.loads(r["input_text"]) == _weather_call(call)
    assert r["usage"]["outputTokens"] > 0


def check_vercel_generate_text(r: dict[str, Any]) -> None:
    assert not r["warnings"] and r["finish_reason"] == "tool-calls" and r["text"] == ""
    [call] = r["tool_calls"]
    _weather_call(call)
    assert r["usage"]["outputTokens"] > 0


def check_vercel_generate_object(r: dict[str, Any]) -> None:
    for result in (r["generate_object"], r["output_object"]):
        assert not result["warnings"] and result["finish_reason"] == "stop" and result["valid"]
        Verdict.model_validate(result["object"])
    assert r["generate_object"]["object"] == r["output_object"]["object"]  # the same request, greedy


def check_vercel_agent_loop(r: dict[str, Any]) -> None:
    first, second = r["steps"]
    [call] = first["tool_calls"]
    assert first["finish_reason"] == "tool-calls" and r["executed"] == [_weather_call(call)]
    assert first["tool_results"] == [{"celsius": 18}] and first["sent_roles"] == ["user"]
    assert second["sent_roles"] == ["user", "assistant", "tool"]
    assert second["sent_tool_calls"] == [{"name": "get_weather", "arguments": call["input"]}]
    assert second["finish_reason"] == "length" and second["text"] and not second["tool_calls"]


CHECKS = {"openai_parse": check_openai_parse, "openai_tools": check_openai_tools,
          "vercel_stream_text": check_vercel_stream_text, "vercel_generate_text": check_vercel_generate_text,
          "vercel_generate_object": check_vercel_generate_object,
          "vercel_agent_loop": check_vercel_agent_loop}


@pytest.fixture(scope="module")
def node_results(parser_gateway: str, node_dir: Path) -> dict[str, Any]:
    """Every Node scenario, in one ``node`` process (each check below reads its own)."""
    return run_node(node_dir / "agent_sdks.mjs", parser_gateway, *CHECKS)


@pytest.mark.parametrize("name", list(CHECKS))
def test_node_sdk(node_results: dict[str, Any], name: str) -> None:
    assert "error" not in node_results[name], node_results[name]["error"]
    CHECKS[name](node_results[name])


def test_vercel_stream_text_and_generate_text_make_the_same_call(node_results: dict[str, Any]) -> None:
    streamed = node_results["vercel_stream_text"]["tool_calls"][0]["input"]
    assert streamed == node_results["vercel_generate_text"]["tool_calls"][0]["input"]
