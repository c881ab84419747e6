"""Tool calls and reasoning survive an engine's death: vLLM's own parsers continue where they were.

Two scripted synthetic engines (vLLM's OpenAI layer with the ``hermes`` tool parser and the ``qwen3``
reasoning parser over the tiny model's tokenizer; the "model" writes a script, see
``engine_worker/backends/scripted.py``) behind one gateway. Clients on every transport ask for answers that
think, then call tools (Hermes ``<tool_call>`` blocks split inside tags, keys and values), or think at length
and answer (POST SSE, non-streamed, ``/v1/ws``, ``/v1/streams`` over SSE and WebSocket with a
Last-Event-ID resumer, Responses SSE/WebSocket/background, the AI SDK's ``/api/chat``); one engine is killed
with SIGKILL once every client has read a few events. Each client's answer
must equal the uninterrupted control's: the same content, reasoning, tool calls (one header each, the same
name and arguments), finish reason and usage, with no error and nothing repeated.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import in_flight, metric, wait_until
from tests.e2e.scaleout import scaleout
from tests.e2e.test_adoption import (
    Reader,
    responses_reader,
    sse_reader,
    until_killed,
)
from tests.e2e.test_broker import RedisServer, redis_server  # noqa: F401  (the fixture)
from tests.e2e.test_migration import Answer, Run
from tests.procs import NO_CLIENT_LIMITS, Proc, start_engine, start_gateway, stop_all

pytestmark = pytest.mark.vllm  # imports vLLM's layer (no weights, no engine core)

THINK = "<think>The user wants the weather, so I will call two tools and compare them.</think>"
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
LONG_THOUGHT = ("<think>" + " ".join(f"step {i} of the argument holds." for i in range(16)) + "</think>"
                "The answer is forty-two, as every step above shows.")
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
    key: {"type": "string"} for key in keys}}}} for name, keys in (("get_weather", ("city", "unit")),
                                                                  ("get_time", ("zone",)))]


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


SCRIPT = [{"match": "weather", "reply": pieces(THINK + CALLS, 3)},
          {"match": "think long", "reply": pieces(LONG_THOUGHT, 4)}]
# ~50 tokens a second: an answer takes 2-3 s, the kill lands in its middle
ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "50", "--synthetic-ttft-ms", "5",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "max_tokens": 400, **extra}


def ui_chat(name: str, question: str) -> dict[str, Any]:
    """An AI SDK ``useChat`` request (``DefaultChatTransport``'s body) for ``question``."""
    return {"id": name, "messages": [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": question}]}],
            "tools": TOOLS, "max_tokens": 400}


def responses(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": question, "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "max_output_tokens": 400, **extra}


# name -> (question, transport)
CASES = {
    "sse-tools": ("What is the weather in Paris?", "sse"), "sse-think": ("think long about it", "sse"),
    "full-tools": ("weather in Rome?", "full"), "ws-tools": ("weather at home?", "ws"),
    "ws-think": ("think long, please", "ws"), "fanout-tools": ("the weather, for all", "fanout"),
    "responses-sse": ("weather, as a response", "responses-sse"),
    "responses-ws": ("think long in a response", "responses-ws"),
    "responses-bg": ("weather in the background", "responses-bg"),
    "ui-tools": ("weather for my chat", "ui"), "ui-think": ("think long in my chat", "ui"),
}


def jobs(run: Run, c: httpx.AsyncClient) -> list[Any]:
    """Every case's client (:data:`CASES`) on its transport."""
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    out: list[Any] = []
    for name, (question, transport) in CASES.items():
        if transport == "sse":
            out.append(run.sse(c, name, "/v1/chat/completions", chat(question, **usage)))
        elif transport == "full":
            out.append(run.full(c, name, "/v1/chat/completions", chat(question)))
        elif transport == "ws":
            out.append(run.mux(name, "chat.completions", chat(question, stream_options={"include_usage": True})))
        elif transport == "fanout":
            out.append(run.fanout(c, name, chat(question, stream_options={"include_usage": True})))
        elif transport == "responses-sse":
            out.append(run.sse(c, name, "/v1/responses", responses(question, stream=True)))
        elif transport == "ui":
            out.append(run.sse(c, name, "/api/chat", ui_chat(name, question)))
        elif transport == "responses-ws":
            out.append(run.responses_ws(name, responses(question)))
        else:
            out.append(run.background(c, name, responses(question)))
    return out


async def scenario(url: str, kill: Any) -> dict[str, Answer]:
    run = Run(url)
    async with httpx.AsyncClient(timeout=60) as c:
        todo = jobs(run, c)
        # every reader: the fan-out stream's resuming reader too
        return await run.kill_when_started(todo, kill, readers=len(todo) + 1)


def control(url: str) -> dict[str, Answer]:
    """Every case read whole and uninterrupted (the non-streamed response), all at once."""
    def one(question: str, transport: str) -> Answer:
        answer = Answer()
        if transport.startswith("responses"):
            answer.fold_response(httpx.post(url + "/v1/responses", json=responses(question), timeout=60).json())
        else:
            answer.fold(httpx.post(url + "/v1/chat/completions", json=chat(question), timeout=60).json())
        return answer

    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = {name: pool.submit(one, *case) for name, case in CASES.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def engines(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, Proc]]]:
    """Two scripted engines (:data:`ENGINE_ARGS`, :data:`SCRIPT`) for the module: the engine-kill test kills
    the first; the gateway-kill tests run on the second."""
    path = tmp_path_factory.mktemp("resume-script") / "script.json"
    path.write_text(json.dumps(SCRIPT))
    addresses = [f"ipc://{ipc_dir / f'resume-{k}.sock'}" for k in "ab"]
    procs = [start_engine(a, *ENGINE_ARGS, "--synthetic-script", str(path), "--model", str(tiny_model),
                          "--served-model-name", "tiny", name=f"engine-resume-{k}") for a, k in zip(addresses, "ab")]
    try:
        yield list(zip(addresses, procs))
    finally:
        stop_all(procs)


def test_tool_calls_and_reasoning_continue_exactly_when_their_engine_is_killed(
        engines: list[tuple[str, Proc]]) -> None:
    addresses = [address for address, _ in engines]
    killed = engines[0][1]
    gateway: Proc | None = None
    t0 = time.monotonic()
    try:
        gateway, url = start_gateway(",".join(addresses), "--heartbeat-timeout", "30", *NO_CLIENT_LIMITS,
                                     name="gateway-resume", timeout=300)
        wait_until(lambda: all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]), timeout=300,
                   what="both engines")
        t1 = time.monotonic()
        answers = asyncio.run(scenario(url, lambda: os.killpg(killed.popen.pid, signal.SIGKILL)))
        t2 = time.monotonic()
        expected = control(url)
        print(f"boot {t1 - t0:.1f} s, scenario {t2 - t1:.1f} s, control {time.monotonic() - t2:.1f} s")
        for name, got in answers.items():
            want = expected[name.split("/")[0]]
            assert not got.errors, (name, got.errors)
            assert (got.text, got.reasoning, got.tools, got.finish) == \
                (want.text, want.reasoning, want.tools, want.finish), name
            if got.usage is not None:
                assert got.usage == want.usage, (name, got.usage, want.usage)
            if got.seqs:  # numbered events: each once, in order
                assert got.seqs == list(range(got.seqs[0], got.seqs[0] + len(got.seqs))), (name, got.seqs)
        # the cases' answers really are tool calls and reasoning, each call announced once
        assert all(call["headers"] == 1 for a in answers.values() for call in a.tools.values())
        assert expected["sse-tools"].tools[1]["name"] == "get_time" and expected["sse-think"].reasoning
        # about half of the generations ran on the killed engine: each was continued, none refused
        lost = in_flight(killed.log())
        continued = metric(url, "tokenfan_migrations_total", {"outcome": "continued"})
        assert len(lost) >= 2 and continued >= len(lost), (lost, continued, gateway.log()[-3000:])
        for outcome in ("refused", "timeout", "failed"):
            assert metric(url, "tokenfan_migrations_total", {"outcome": outcome}) == 0
        print(f"in flight on the killed engine: {len(lost)} of {len(CASES)}, continued {continued}")
    finally:
        if gateway is not None:
            gateway.stop()


@dataclass
class PartsReader(Reader):
    """An EventSource reader (tests.e2e.test_adoption.sse_reader) assembling tool calls and reasoning too."""

    answer: Answer = field(default_factory=Answer)


def fold_parts(reader: Reader, seq: int, chunk: dict[str, Any]) -> None:
    assert isinstance(reader, PartsReader)
    reader.seqs.append(seq)
    reader.answer.fold(chunk)


@pytest.mark.parametrize("kind", ["workers", "replicas"])
def test_tool_call_and_reasoning_streams_of_a_killed_gateway_are_adopted_exactly(
        engines: list[tuple[str, Proc]], redis_server: RedisServer, kind: str) -> None:  # noqa: F811
    """Fan-out streams that think and call tools, and a background response with tool calls, are created on
    one gateway (worker 0 of ``tokenfan gateway --workers 2``, or replica A of two on redis) and read on the
    public port (or on A, then B); that gateway is killed with SIGKILL mid-stream. The survivor adopts each
    stream from its log (the engine steps behind its chunks) and the engine replays them through the
    parsers: every reader gets each event once and the control's answer."""
    questions = ["What is the weather in Paris?", "think long about it", "weather, again"]
    with scaleout(kind, engines[1][0], redis_server.url, "resume") as where:
        background = responses("weather in the background", background=True, store=True)
        events: list[dict[str, Any]] = []

        async def scenario() -> dict[str, PartsReader]:
            readers: dict[str, PartsReader] = {}
            async with httpx.AsyncClient(timeout=60) as c, \
                    httpx.AsyncClient(transport=where.transport, timeout=60) as owner:
                jobs, started = [], []
                for i, question in enumerate(questions):
                    r = await owner.post(where.owner + "/v1/streams", json=chat(question))
                    assert r.status_code == 201, r.text
                    for k in range(2):
                        reader = readers[f"{i}/sse-{k}"] = PartsReader()
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(sse_reader(c, where.urls, r.json()["id"], reader, ev, fold_parts))
                r = await owner.post(where.owner + "/v1/responses", json=background)
                assert r.status_code == 200, r.text
                started.append(asyncio.Event())
                jobs.append(responses_reader(c, where.urls, r.json()["id"], events, started[-1]))
                await until_killed(jobs, started, where.kill)
            return readers

        t0 = time.monotonic()
        readers = asyncio.run(scenario())
        t1 = time.monotonic()
        url = where.survivor

        def control(question: str) -> Answer:
            answer = Answer()
            answer.fold(httpx.post(url + "/v1/chat/completions", json=chat(question), timeout=60).json())
            return answer

        with ThreadPoolExecutor(len(questions)) as pool:
            expected = list(pool.map(control, questions))
        print(f"scenario {t1 - t0:.1f} s, control {time.monotonic() - t1:.1f} s")
        for name, reader in readers.items():
            want = expected[int(name.split("/")[0])]
            got = reader.answer
            assert not reader.errors and reader.ended, (name, reader.errors)
            assert reader.seqs == list(range(len(reader.seqs))), (name, reader.seqs)  # each event once
            assert (got.text, got.reasoning, got.tools, got.finish) == \
                (want.text, want.reasoning, want.tools, want.finish), name
        assert readers["0/sse-0"].answer.tools[1]["headers"] == 1 and readers["1/sse-0"].answer.reasoning
        # the background response: each event once, and the control's function calls and reasoning
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        got_response, want_response = Answer(), Answer()
        got_response.fold_response(events[-1]["response"])
        want_response.fold_response(httpx.post(url + "/v1/responses", timeout=60, json=responses(
            "weather in the background")).json())
        assert (got_response.tools, got_response.reasoning, got_response.finish) == \
            (want_response.tools, want_response.reasoning, "completed"), events[-1]
        assert len(got_response.tools) == 2
        # every stream was in flight on the killed gateway at the kill, and was adopted
        if where.settle is not None:
            where.settle()
        adopted = metric(url, "tokenfan_adoptions_total", {"outcome": "adopted"})
        assert adopted == len(questions) + 1, adopted
