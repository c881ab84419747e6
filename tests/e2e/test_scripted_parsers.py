"""vLLM's real tool and reasoning parsers on a scripted model: ``--engine synthetic --synthetic-script``.

The synthetic engine plays the model under vLLM's OpenAI layer with the tiny model's tokenizer and chat
template (no weights): its script writes Hermes ``<tool_call>`` blocks and ``<think>`` sections split at
awkward places (inside the tags, inside JSON keys and values, one character per step), and vLLM's
``hermes`` and ``qwen3`` parsers must recover the same calls and reasoning from every split, streamed and
not, on every transport.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.helpers import sse_events
from tests.scripted import PARSER_SCRIPT, SPLITS, pieces
from tokenfan_bench.servers.processes import Proc

pytestmark = pytest.mark.vllm  # imports vLLM's layer (no engine process, no weights)

EXPECTED_CALLS = {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                  1: {"name": "get_time", "arguments": '{"zone": "CET"}'}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
    key: {"type": "string"}}}}} for name, key in (("get_weather", "city"), ("get_time", "zone"))]
SCRIPT = PARSER_SCRIPT


@pytest.fixture(scope="module")
def scripted(scripted_gateway: str) -> str:
    """The session's scripted engine (tests/scripted.py), shared with the docs' tool examples."""
    return scripted_gateway


def _body(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "max_tokens": 400, **extra}


def _assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Content, reasoning, tool calls (by index: name, joined arguments) and finish reason of choice 0."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "tools": {}, "finish": None}
    for c in chunks:
        for ch in c.get("choices") or []:
            delta = ch["delta"]
            out["content"] += delta.get("content") or ""
            out["reasoning"] += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                call = out["tools"].setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] += (tc.get("function") or {}).get("name") or ""
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            out["finish"] = ch.get("finish_reason") or out["finish"]
    return out


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1]["data"] == "[DONE]"
    return [json.loads(e["data"]) for e in events[:-1]]


@pytest.mark.parametrize("split", SPLITS)
def test_tool_calls_and_reasoning_survive_every_split(scripted: str, split: int) -> None:
    body = _body(f"What is the weather in Paris? split {split}")
    whole = httpx.post(scripted + "/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "The user wants the weather."
    assert not choice["message"]["content"]
    calls = {i: c["function"] for i, c in enumerate(choice["message"]["tool_calls"])}
    assert calls == EXPECTED_CALLS
    streamed = _assembled(_stream(scripted, body))
    assert streamed == {"content": "", "reasoning": "The user wants the weather.", "tools": EXPECTED_CALLS,
                        "finish": "tool_calls"}


def test_a_tool_result_turn_and_plain_reasoning(scripted: str) -> None:
    follow_up = _body("What is the weather?", messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "the tool says 18 C"}])
    assert _assembled(_stream(scripted, follow_up)) == {
        "content": "It is 18 C in Paris.", "reasoning": "The user wants the weather.", "tools": {}, "finish": "stop"}
    message = httpx.post(scripted + "/v1/chat/completions", json=_body("just think"), timeout=60).json()
    assert message["choices"][0]["message"]["content"] == "Bonjour"
    assert message["choices"][0]["message"]["reasoning"] == "hmm"


def test_max_tokens_cuts_the_script_with_finish_length(scripted: str) -> None:
    r = httpx.post(scripted + "/v1/chat/completions", json=_body("just think", max_tokens=3), timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3


def test_what_only_a_model_has_is_refused_by_name(scripted: str) -> None:
    for extra, param in (({"logprobs": True}, "logprobs"), ({"n": 2, "temperature": 1.0}, "n")):
        r = httpx.post(scripted + "/v1/chat/completions", json=_body("just think", **extra), timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_every_transport_carries_the_same_tool_call_deltas(scripted: str) -> None:
    body = _body("What is the weather in Paris? split 3")
    reference = _assembled(_stream(scripted, body))

    async def over_ws() -> list[dict[str, Any]]:
        chunks = []
        async with websockets.connect(scripted.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "request", "id": "r", "endpoint": "chat.completions", "body": body}))
            while (msg := json.loads(await ws.recv()))["type"] != "done":
                assert msg["type"] == "chunk", msg
                chunks.append(msg["data"])
        return chunks

    assert _assembled(asyncio.run(over_ws())) == reference
    made = httpx.post(scripted + "/v1/streams", json={"endpoint": "chat.completions", **body}, timeout=60).json()
    events = [e for e in sse_events(httpx.get(made["events_url"], timeout=60).text)
              if e.get("data") not in (None, "[DONE]") and e.get("event", "message") == "message"]
    fanned = [json.loads(e["data"]) for e in events]
    assert _assembled(fanned) == reference
    middle = len(events) // 2
    resumed = [json.loads(e["data"]) for e in sse_events(httpx.get(
        made["events_url"], headers={"Last-Event-ID": events[middle]["id"]}, timeout=60).text)
        if e.get("data") not in (None, "[DONE]") and e.get("event", "message") == "message"]
    assert resumed == fanned[middle + 1:]


def test_with_migration_off_a_tool_call_or_reasoning_stream_whose_engine_dies_fails_explicitly(
        tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--migration-limit 0``: killed in the middle of a tool call's arguments or of the reasoning, each client
    gets an explicit ``engine_unavailable`` error event after what it had, never a silent end or a hang, and
    the gateway counts the migration ``refused`` (reason ``limit``). With migration on they are continued:
    tests/e2e/test_resume_parsers.py."""
    from tests.e2e.helpers import metric
    from tests.procs import start_engine, start_gateway, stop_all

    script = tmp_path_factory.mktemp("script-kill") / "script.json"
    long_think = {"match": "long think", "reply": pieces("<think>" + "step by step, " * 40 + "</think>Done.", 3)}
    script.write_text(json.dumps([*SCRIPT, long_think]))
    address = f"ipc://{tmp_path_factory.mktemp('sock') / 'e.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-script", str(script), "--model",
                          str(tiny_model), "--served-model-name", "tiny", "--synthetic-tokens-per-s", "20",
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                          name="engine-scripted-kill")
    gateway: Proc | None = None
    try:
        gateway, url = start_gateway(address, "--heartbeat-timeout", "30", "--migration-limit", "0",
                                     name="gateway-scripted-kill", timeout=300)

        async def run() -> dict[str, list[dict[str, str]]]:
            seen: dict[str, list[dict[str, str]]] = {"tool": [], "think": []}
            started = {k: asyncio.Event() for k in seen}

            async def read(c: httpx.AsyncClient, kind: str, question: str) -> None:
                async with c.stream("POST", url + "/v1/chat/completions",
                                    json=_body(question, stream=True)) as r:
                    buf = ""
                    async for text in r.aiter_text():
                        buf += text
                        *whole, buf = buf.split("\n\n")
                        for block in whole:
                            seen[kind] += sse_events(block + "\n\n")
                        args = "".join(tc["function"].get("arguments") or "" for e in seen[kind]
                                       if e.get("data", "").startswith("{")
                                       for ch in json.loads(e["data"]).get("choices") or []
                                       for tc in ch["delta"].get("tool_calls") or [])
                        reasoning = "".join(ch["delta"].get("reasoning") or "" for e in seen[kind]
                                            if e.get("data", "").startswith("{")
                                            for ch in json.loads(e["data"]).get("choices") or [])
                        if (kind == "tool" and len(args) > 3) or (kind == "think" and len(reasoning) > 3):
                            started[kind].set()

            async with httpx.AsyncClient(timeout=60) as c:
                # "split 2": the tool call's arguments stream from ~2.4 s to ~4.2 s; "long think": 8.5 s of reasoning
                jobs = asyncio.gather(read(c, "tool", "split 2"), read(c, "think", "long think"))
                for ev in started.values():
                    await asyncio.wait_for(ev.wait(), 60)
                engine.popen.kill()
                await asyncio.wait_for(jobs, 30)
            return seen

        seen = asyncio.run(run())
        for kind, events in seen.items():
            errors = [json.loads(e["data"])["error"]["code"] for e in events if e.get("event") == "error"]
            assert errors == ["engine_unavailable"], (kind, events[-3:])
            assert all(e.get("data") != "[DONE]" for e in events), kind
        assert metric(url, "tokenfan_migrations_total", {"outcome": "refused"}) == 2
        assert metric(url, "tokenfan_migration_refusals_total", {"reason": "limit"}) == 2
    finally:
        stop_all([p for p in (gateway, engine) if p is not None])
