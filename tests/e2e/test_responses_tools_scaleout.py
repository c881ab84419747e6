"""A Responses tool loop across replicas (``--broker``) and workers (``--workers 2``), and the Node ``openai``
SDK's tool loop over SSE and WebSocket mode, on a scripted model whose tool calls vLLM's parser really parses.

One scripted engine (``--engine synthetic --synthetic-script``: the tiny model's tokenizer and chat template,
no weights, vLLM's ``hermes`` tool parser and ``qwen3`` reasoning parser) serves three gateways: replicas A
and B on one ``redis-server``, and one ``--workers 2`` server. The script writes a ``<think>`` section and a
Hermes ``<tool_call>`` block three characters per engine step (so the call's arguments arrive as many
deltas), and answers the tool's result only when the rendered prompt holds that call *and* the result: a
continuation whose transcript lost the call gets another answer. A continuation on the other replica or
worker therefore proves the transcript travelled with its tool call.

The two workers are addressed one by one through their private Unix sockets (the same application as the
shared port, where the kernel picks the worker): the run on worker 0 and its continuation or resume on
worker 1, every time.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from tests.e2e.helpers import drop_inside_the_call, until_terminal, wait_until
from tests.e2e.test_broker import RedisServer
from tests.procs import run_node, start_engine, start_gateway
from tests.system import require
from tokenfan_bench.servers.processes import Proc, free_port

pytestmark = pytest.mark.vllm  # the engine runs vLLM's OpenAI layer (no weights)

QUESTION = "What is the weather in Paris?"
THINK = "<think>The user wants the weather.</think>"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ARGUMENTS = '{"city": "Paris"}'
RESULT = "tool says 18 C, sunny"
ANSWER = "It is 18 C and sunny in Paris."
VERDICT = '{"answer": "yes"}'
MISSING = "The call that asked for this is missing."


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


# First match wins, on the rendered prompt. The tiny model's template renders an assistant's tool call as
# `<tool_call>{"name": …, "arguments": …}</tool_call>` and a tool message after `<|tool|>`.
SCRIPT = [
    {"match": r'<tool_call>\{"name": "get_weather", "arguments": [^<]*Paris[^<]*</tool_call>[\s\S]*<\|tool\|>\n'
              + RESULT, "reply": pieces("<think>The tool answered.</think>" + ANSWER, 4)},
    {"match": RESULT, "reply": ["<think>Hm.</think>", MISSING]},
    {"match": "Is it sunny", "reply": pieces("<think>Look outside.</think>" + VERDICT, 2)},
    {"match": QUESTION.replace("?", r"\?"), "reply": pieces(THINK + CALL, 3)},
]
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TURN: dict[str, Any] = {"model": "tiny", "tools": [WEATHER], "max_output_tokens": 200}


def tool_output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": RESULT}


# -- processes ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_engine(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    script = tmp_path_factory.mktemp("tools-scaleout") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    address = f"ipc://{ipc_dir / 'scripted-scaleout.sock'}"
    proc = start_engine(address, "--engine", "synthetic", "--synthetic-script", str(script), "--model",
                        str(tiny_model), "--served-model-name", "tiny", "--synthetic-tokens-per-s", "400",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                        name="engine-scripted-scaleout")
    try:
        yield address
    finally:
        proc.stop(timeout=30)


@pytest.fixture(scope="module")
def replicas(scripted_engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Gateways A and B on one engine and one ``redis-server``."""
    require("redis-server")
    redis_server = RedisServer(tmp_path_factory.mktemp("redis"))
    redis_server.start()
    gateways: list[Proc] = []
    try:
        urls = []
        for name in ("a", "b"):  # the first waits for the engine to load vLLM's layer
            proc, url = start_gateway(scripted_engine, "--broker", redis_server.url, name=f"gateway-tools-{name}",
                                      timeout=300)
            gateways.append(proc)
            urls.append(url)
        yield urls[0], urls[1]
    finally:
        for proc in gateways:
            proc.stop()
        assert redis_server.proc is not None
        redis_server.proc.terminate()
        redis_server.proc.wait(10)


@pytest.fixture(scope="module")
def workers(scripted_engine: str) -> Iterator[tuple[Path, Path]]:
    """A ``--workers 2`` server: the private Unix sockets of worker 0 and worker 1, both serving."""
    from gateway.scaleout.workers import worker_socket

    port = free_port()
    proc, _ = start_gateway(scripted_engine, "--workers", "2", name="gateway-tools-workers", timeout=300, port=port)
    try:
        sockets = worker_socket(port, 0), worker_socket(port, 1)
        for path in sockets:
            wait_until(partial(healthy, path), timeout=120, what=f"the worker on {path} healthy")
        yield sockets
    finally:
        proc.stop()


def healthy(path: Path) -> bool:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as c:
            return c.get("http://worker/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def client_at(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def client_on_worker(path: Path) -> openai.OpenAI:
    """The unmodified SDK, its HTTP client on one worker's Unix socket."""
    return openai.OpenAI(base_url="http://worker/v1", api_key="unused", max_retries=0, timeout=60,
                         http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=str(path))))


def unix_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    return s


@pytest.fixture(params=["replicas", "workers"])
def pair(request: pytest.FixtureRequest) -> tuple[openai.OpenAI, openai.OpenAI, Callable[[], dict[str, Any]]]:
    """(a client on the first gateway, one on the other, the other's ``responses.connect()`` options)."""
    if request.param == "replicas":
        url_a, url_b = request.getfixturevalue("replicas")
        return client_at(url_a), client_at(url_b), dict
    w0, w1 = request.getfixturevalue("workers")
    return client_on_worker(w0), client_on_worker(w1), lambda: {"sock": unix_socket(w1)}


# -- checks ------------------------------------------------------------------------------------------------


def the_call(response: Any) -> Any:
    """The response's output: reasoning, then one ``get_weather`` call with the script's arguments."""
    assert [o.type for o in response.output] == ["reasoning", "function_call"], response.output
    call = response.output[1]
    assert (call.name, call.arguments, call.status) == ("get_weather", ARGUMENTS, "completed") and call.call_id
    assert response.output[0].content[0].text == "The user wants the weather."
    return call


def check_call_events(events: list[Any]) -> None:
    """Every event once, in order, the call's arguments split over many deltas that add up."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and "".join(deltas) == ARGUMENTS
    [added] = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (added.name, added.arguments, done.arguments) == ("get_weather", "", ARGUMENTS)
    the_call(events[-1].response)


def check_answer(response: Any, previous_id: str | None) -> None:
    assert response.status == "completed" and response.output_text == ANSWER, response.output
    assert response.previous_response_id == previous_id
    assert [o.type for o in response.output] == ["reasoning", "message"]


# -- the tool loop on the other replica / worker -------------------------------------------------------------


def test_a_function_call_made_on_one_gateway_is_answered_on_the_other(pair: Any) -> None:
    """Each turn follows the one before at once, as an agent sends it (no wait for the transcript to reach
    Redis or the peer worker)."""
    a, b, ws_b = pair
    first = a.responses.create(input=QUESTION, **TURN)
    call = the_call(first)
    answered = b.responses.create(previous_response_id=first.id, input=[tool_output(call.call_id)], **TURN)
    check_answer(answered, first.id)
    whole = b.responses.create(input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                                      tool_output(call.call_id)], **TURN)
    check_answer(whole, None)
    assert answered.usage is not None and whole.usage is not None
    assert answered.usage.input_tokens == whole.usage.input_tokens
    control = b.responses.create(input=[{"role": "user", "content": QUESTION}, tool_output(call.call_id)], **TURN)
    assert control.output_text == MISSING  # the answer above needs the call A made, carried to B

    # streamed both ways: the call streamed on B, answered streamed on A
    events = list(b.responses.create(input=QUESTION, stream=True, **TURN))
    check_call_events(events)
    streamed_call = the_call(events[-1].response)
    back = list(a.responses.create(previous_response_id=events[-1].response.id, stream=True,
                                   input=[tool_output(streamed_call.call_id)], **TURN))
    assert [e.sequence_number for e in back] == list(range(len(back)))
    check_answer(back[-1].response, events[-1].response.id)
    assert "".join(e.delta for e in back if e.type == "response.output_text.delta") == ANSWER

    # WebSocket mode on B continues A's response (the SDK's responses.connect())
    with b.responses.connect(websocket_connection_options=ws_b()) as conn:
        conn.send({"type": "response.create", "previous_response_id": first.id,
                   "input": [tool_output(call.call_id)], **TURN})
        over_ws = until_terminal(conn)
        assert [e.sequence_number for e in over_ws] == list(range(len(over_ws)))
        check_answer(over_ws[-1].response, first.id)
        # a warmup with the tools (no output), generated from by the next turn: the call, over the socket
        conn.send({"type": "response.create", "input": QUESTION, "generate": False, **TURN})
        warmup = until_terminal(conn)[-1].response
        assert warmup.output == [] and warmup.status == "completed"
        conn.send({"type": "response.create", "previous_response_id": warmup.id, "input": [], **TURN})
        ws_call = until_terminal(conn)
        # two lanes at once: a new call on one, the answer to A's call on the other
        conn.send({"type": "response.create", "stream_id": "ask", "input": QUESTION, **TURN})
        conn.send({"type": "response.create", "stream_id": "answer", "previous_response_id": first.id,
                   "input": [tool_output(call.call_id)], **TURN})
        both = until_terminal(conn) + until_terminal(conn)
    check_call_events(ws_call)
    lanes = {lane: [e for e in both if getattr(e, "stream_id", None) == lane] for lane in ("ask", "answer")}
    assert len(lanes["ask"]) + len(lanes["answer"]) == len(both)
    check_call_events(lanes["ask"])
    check_answer(lanes["answer"][-1].response, first.id)
    again = a.responses.create(previous_response_id=ws_call[-1].response.id, **TURN,
                               input=[tool_output(the_call(ws_call[-1].response).call_id)])
    check_answer(again, ws_call[-1].response.id)


def test_a_background_tool_call_resumes_on_the_other_gateway_with_every_event_once(pair: Any) -> None:
    a, b, _ = pair
    seen = drop_inside_the_call(a.responses.create(input=QUESTION, background=True, stream=True, **TURN))
    rid, last = seen[0].response.id, seen[-1].sequence_number
    rest = list(b.responses.retrieve(rid, stream=True, starting_after=last))
    got = seen + rest
    check_call_events(got)
    for client in (a, b):  # the whole log, from the owner and from the other gateway's mirror
        replay = list(client.responses.retrieve(rid, stream=True))
        assert [e.model_dump() for e in replay] == [e.model_dump() for e in got]
    stored = b.responses.retrieve(rid)
    assert stored.status == "completed" and stored.background is True
    answered = b.responses.create(previous_response_id=rid, input=[tool_output(the_call(stored).call_id)], **TURN)
    check_answer(answered, rid)


# -- the Node SDK (tests/node/responses_tools.mjs) ------------------------------------------------------------


@pytest.fixture(scope="module")
def node_results(replicas: tuple[str, str], node_dir: Path) -> dict[str, Any]:
    """Every scenario of the harness, in one ``node`` process: A runs, B continues where a scenario says."""
    return run_node(node_dir / "responses_tools.mjs", *replicas)


def scenario(results: dict[str, Any], name: str) -> dict[str, Any]:
    r = results[name]
    assert "error" not in r, r["error"]
    return r  # type: ignore[no-any-return]


def check_node_call(call: dict[str, Any]) -> None:
    assert (call["type"], call["name"], call["arguments"], call["status"]) == (
        "function_call", "get_weather", ARGUMENTS, "completed")
    assert call["call_id"]


def check_node_events(r: dict[str, Any]) -> None:
    assert r["seqs"] == list(range(len(r["seqs"]))) and r["types"][-1] == "response.completed"
    assert r["types"][:2] == ["response.created", "response.in_progress"]
    assert len(r["argument_deltas"]) > 3 and "".join(r["argument_deltas"]) == ARGUMENTS == r["arguments_done"]
    assert r["added"] == {"type": "function_call", "name": "get_weather", "arguments": ""}
    check_node_call(r["call"])


def check_node_answer(r: dict[str, Any], previous_id: str) -> None:
    assert r["status"] == "completed" and r["output_text"] == ANSWER
    assert r["output_types"] == ["reasoning", "message"] and r["previous_response_id"] == previous_id


def test_node_sdk_create_with_tools_and_the_tool_result_turn(node_results: dict[str, Any]) -> None:
    r = scenario(node_results, "create")
    assert r["output_types"] == ["reasoning", "function_call"] and r["output_text"] == ""
    check_node_call(r["call"])
    check_node_answer(r["answered"], r["id"])


def test_node_sdk_streamed_create_with_tools_answered_streamed_on_the_other_replica(
        node_results: dict[str, Any]) -> None:
    r = scenario(node_results, "stream")
    check_node_events(r["first"])
    # the SDK's stream helper assembles the same item (in another response: another call_id)
    assert {**r["final_call"], "call_id": None} == {**r["first"]["call"], "call_id": None}
    second = r["answered"]
    assert second["seqs"] == list(range(len(second["seqs"])))
    assert second["text"] == ANSWER
    check_node_answer(second["response"], r["first"]["id"])


def test_node_sdk_websocket_mode_tool_loop(node_results: dict[str, Any]) -> None:
    r = scenario(node_results, "ws")
    check_node_events(r["first"])
    check_node_answer(r["answered"]["response"], r["first"]["id"])
    assert r["answered"]["seqs"] == list(range(len(r["answered"]["seqs"])))
    check_node_answer(r["other_replica"]["response"], r["first"]["id"])


def test_node_sdk_parse_with_a_zod_text_format(node_results: dict[str, Any]) -> None:
    r = scenario(node_results, "parse")
    assert r["status"] == "completed" and r["output_types"] == ["reasoning", "message"]
    assert r["parsed"] == json.loads(VERDICT) == r["streamed_parsed"]
    assert r["format_type"] == "json_schema" and r["format_name"] == "verdict"
