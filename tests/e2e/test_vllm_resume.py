"""A continuation of a request of vLLM's OpenAI layer writes exactly the rest of the uninterrupted answer.

At the engine protocol, on the session's vLLM engine (the tiny random-weight Llama, float32, greedy, xgrammar
with compact JSON): each control request's chunks and their engine steps (``Delta.steps``) are recorded over
a raw ZeroMQ socket; then, from several step boundaries, a continuation (``Submit.resume_steps`` = the steps
delivered so far) must write exactly the chunks the control wrote after them: content, tool calls (their
header never sent again), logprobs, finish reason and usage. The kinds: structured outputs (a strict JSON
schema, a free JSON schema, a regex, a choice, a named tool call: the grammar must go on where it was, not
restart at its root), logprobs with presence, frequency and repetition penalties and ``min_tokens`` (they must
count the delivered output as output), a stop string from the middle of the answer, completions with
logprobs, and ``n`` = 2 (sampled: every choice goes on from its own tokens, its index kept).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest

from engine_worker import protocol as p
from tests.e2e.test_vllm_migration import run_submits

pytestmark = pytest.mark.vllm

STRICT = {"name": "a", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "n": {"type": "integer"}},
    "required": ["answer", "n"], "additionalProperties": False}}
PERSON = {"name": "p", "schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                   "age": {"type": "integer"}},
                                  "required": ["name", "age"]}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USAGE = {"stream": True, "stream_options": {"include_usage": True}}


def chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens,
            **USAGE, **extra}


BODIES: dict[str, dict[str, Any]] = {
    "json-strict": chat("Yes or no?", 100, response_format={"type": "json_schema", "json_schema": STRICT}),
    "json-free": chat("Give me a person.", 48, response_format={"type": "json_schema", "json_schema": PERSON}),
    "regex": chat("A date", 30, structured_outputs={"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2} and [a-z]{3,8}"}),
    "choice": chat("Pick", 30, structured_outputs={"choice": ["a long answer one", "another long answer two"]}),
    "logprobs-penalties": chat("Tell me about rivers.", 40, logprobs=True, top_logprobs=2, presence_penalty=0.8,
                               frequency_penalty=0.5, repetition_penalty=1.2, min_tokens=20),
    "completions-logprobs": {"prompt": "Rivers run to", "temperature": 0, "max_tokens": 30, "logprobs": 2, **USAGE},
    "completions-echo": {"prompt": "Lakes are", "temperature": 0, "max_tokens": 30, "logprobs": 1, "echo": True,
                         **USAGE},
    "n2": chat("Tell me about lakes.", 24, temperature=1.0, seed=7, n=2, logprobs=True),
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# for the engine with PARSER_FLAGS (hermes tool parser, qwen3 reasoning parser)
PARSER_BODIES: dict[str, dict[str, Any]] = {
    "named-tool": chat("Weather?", 48, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, **NO_THINKING),
    "required-tool": chat("Weather now?", 60, tools=TOOLS, tool_choice="required", **NO_THINKING),
    "auto-tool": chat("Weather here?", 40, tools=TOOLS, logprobs=True),
    # the tiny model never closes its <think>: the grammar waits for the reasoning to end, and still waits
    "json-reasoning": chat("Yes or no, think first", 40, response_format={"type": "json_schema",
                                                                           "json_schema": STRICT}),
}


def submit(rid: str, body: dict[str, Any], steps: p.EngineSteps | None = None) -> p.Submit:
    sampling = p.Sampling(max_tokens=body["max_tokens"], temperature=body["temperature"])
    if "prompt" in body:
        return p.Submit(request_id=rid, endpoint="completions", sampling=sampling, prompt=body["prompt"],
                        body=orjson.dumps(body), resume_steps=steps or [])
    return p.Submit(request_id=rid, endpoint="chat.completions", sampling=sampling,
                    messages=[p.ChatMessage(m["role"], m["content"]) for m in body["messages"]],
                    body=orjson.dumps(body), resume_steps=steps or [])


def assembled(deltas: list[p.Delta]) -> dict[Any, Any]:
    """What a client assembles from chunks: per choice its content, tool calls (headers, name, arguments),
    logprobs (token, logprob) and finish reason; the usage."""
    out: dict[Any, Any] = {}
    for d in deltas:
        if not d.chunk:
            continue
        obj = orjson.loads(d.chunk)
        for c in obj.get("choices", ()):
            choice = out.setdefault(c["index"], {"content": "", "reasoning": "", "tools": {}, "logprobs": [],
                                                 "finish": None})
            delta = c.get("delta") or {"content": c.get("text")}
            choice["content"] += delta.get("content") or ""
            choice["reasoning"] += delta.get("reasoning") or ""
            for tc in delta.get("tool_calls") or []:
                call = choice["tools"].setdefault(tc["index"], {"headers": 0, "name": "", "arguments": ""})
                call["headers"] += bool(tc.get("id"))
                call["name"] += (tc.get("function") or {}).get("name") or ""
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            lp = c.get("logprobs") or {}
            if "content" in lp:
                choice["logprobs"] += [(x["token"], x["logprob"], len(x["top_logprobs"])) for x in lp["content"]]
            elif lp:
                choice["logprobs"] += list(zip(lp["tokens"], lp["token_logprobs"]))
            choice["finish"] = c.get("finish_reason") or choice["finish"]
        if obj.get("usage"):
            out["usage"] = (obj["usage"]["prompt_tokens"], obj["usage"]["completion_tokens"])
    return out


def delivered(deltas: list[p.Delta], steps: int) -> list[p.Delta]:
    """The control's deltas a client had when its engine was lost after ``steps`` engine steps (all the
    deltas of a step travel together: a step is delivered whole or not at all)."""
    out, n = [], 0
    for d in deltas:
        if n + len(d.steps) > steps:
            break
        out.append(d)
        n += len(d.steps)
    return out


def steps_of(deltas: list[p.Delta]) -> p.EngineSteps:
    """The engine steps behind ``deltas``, each a list of its outputs (``[choice, finished, *token_ids]``)."""
    return [s for d in deltas for s in d.steps]


def tokens_of(out: list[int]) -> int:
    """How many tokens one output of a step carries (``[choice, finished, *token_ids]``)."""
    return len(out) - 2


def merged(deltas: list[p.Delta]) -> bool:
    """Whether a step behind ``deltas`` carries more than one token of a choice (several engine steps that
    reached a slow reader as one)."""
    return any(tokens_of(out) > 1 for s in steps_of(deltas) for out in s)


def grouping(deltas: list[p.Delta]) -> list[int]:
    """How many engine steps each delta carries."""
    return [len(d.steps) for d in deltas]


def trail(deltas: list[p.Delta], n: int = 4) -> list[tuple[int, str]]:
    """The last ``n`` deltas as (engine steps behind it, its chunk's end)."""
    return [(len(d.steps), d.chunk.decode()[-200:]) for d in deltas[-n:]]


def continuations(address: str, bodies: dict[str, dict[str, Any]]) -> dict[str, dict[Any, Any]]:
    """Each body's control run, then its continuations from several step boundaries, checked against it;
    the controls' assembled answers."""
    # A busy engine hands a slow reader several steps as one (fewer cut points to continue from): a control
    # with such a step runs again, at most twice more, and the run with the most steps is kept.
    controls: dict[str, list[p.Delta]] = {}
    for attempt in range(3):
        todo = [k for k in bodies if k not in controls or merged(controls[k])]
        if not todo:
            break
        runs = asyncio.run(run_submits(address, [submit(f"gen-c-{k}-{attempt}", bodies[k]) for k in todo]))
        for k in todo:
            run = runs[f"gen-c-{k}-{attempt}"]
            if k not in controls or len(steps_of(run)) > len(steps_of(controls[k])):
                controls[k] = run
    subs: dict[str, p.Submit] = {}
    expected: dict[str, tuple[str, list[p.Delta], dict[Any, Any], list[p.Delta]]] = {}
    for kind, body in bodies.items():
        deltas = controls[kind]
        steps = steps_of(deltas)
        assert sum(tokens_of(out) for s in steps for out in s) == assembled(deltas)["usage"][1], kind
        for cut in sorted({1, 2, len(steps) // 3, len(steps) // 2, len(steps) - 2} - {0}):
            rid = f"gen-r-{kind}-{cut}.m1"  # a continuation's id: its chunks keep the generation's id
            subs[rid] = submit(rid, body, steps[:cut])
            had = delivered(deltas, cut)
            expected[rid] = (kind, had, assembled(deltas), deltas[len(had):])
    got = asyncio.run(run_submits(address, list(subs.values())))
    # vLLM's OpenAI layer writes some answers by how the engine's steps were grouped into outputs (a busy
    # engine hands a slow reader two steps at once): hermes appends a `required` call's unstreamed arguments
    # only when the last output carries a tool-call delta (its `null` arguments then read `null{}`). A
    # continuation that differs from its control and whose steps were grouped otherwise runs again, at most
    # twice more; one grouped as the control was must write exactly its rest.
    reruns = 0
    for attempt in (1, 2):
        regrouped = [rid for rid, (kind, had, whole, rest) in expected.items() if kind != "n2"
                     and assembled(had + got[rid]) != whole and grouping(got[rid]) != grouping(rest)]
        if not regrouped:
            break
        again = {rid: msgspec.structs.replace(subs[rid], request_id=f"{rid.removesuffix('.m1')}-{attempt}.m1")
                 for rid in regrouped}
        rerun = asyncio.run(run_submits(address, list(again.values())))
        reruns += len(again)
        for rid, sub in again.items():
            subs[rid], got[rid] = sub, rerun[sub.request_id]
    for rid, (kind, had, whole, rest) in expected.items():
        joined = assembled(had + got[rid])
        if kind == "n2":  # sampled: each choice goes on from its own tokens, the rest is a new sample
            assert sorted(k for k in joined if k != "usage") == [0, 1], rid
            for i in (0, 1):
                assert joined[i]["finish"] == "length" and len(joined[i]["logprobs"]) == 24, (rid, joined[i])
            assert joined["usage"] == whole["usage"], rid
            continue
        # (on a mismatch: how the control's and the continuation's last steps were grouped into chunks)
        assert joined == whole, (rid, joined, whole, grouping(rest), grouping(got[rid]), trail(rest),
                                 trail(got[rid]))
        ids = {orjson.loads(d.chunk)["id"] for d in got[rid] if d.chunk}
        prefix = "cmpl" if kind.startswith("completions") else "chatcmpl"
        assert ids <= {f"{prefix}-{subs[rid].request_id.split('-', 1)[1].removesuffix('.m1')}"}, ids
    assert len(expected) >= 4 * len(bodies)
    print(f"{len(expected)} continuations of {len(bodies)} kinds ({reruns} run again for their grouping)")
    return {kind: assembled(controls[kind]) for kind in bodies}


def test_a_continuation_from_any_step_writes_exactly_the_rest(vllm_engine: tuple[str, Any],
                                                             vllm_gateway_url: str) -> None:
    address, _ = vllm_engine  # up once its gateway is (vllm_gateway_url waits for the engine's start)
    base = asyncio.run(run_submits(address, [submit("gen-base", BODIES["logprobs-penalties"])]))
    # A stop string from the middle of an answer: the control stops there, text is held back before it.
    text = assembled(base["gen-base"])[0]["content"]
    bodies = {**BODIES, "stop": chat("Tell me about rivers.", 40, logprobs=True, presence_penalty=0.8,
                                     frequency_penalty=0.5, repetition_penalty=1.2, min_tokens=20,
                                     stop=[text[len(text) // 2:len(text) // 2 + 4]])}
    wholes = continuations(address, bodies)
    # the kinds really exercised what they name
    assert orjson.loads(wholes["json-strict"][0]["content"])["answer"] in ("yes", "no")
    assert wholes["json-strict"][0]["finish"] == "stop"
    assert wholes["json-free"][0]["content"].startswith('{"')
    assert wholes["choice"][0]["content"] in ("a long answer one", "another long answer two")
    assert wholes["logprobs-penalties"][0]["logprobs"][0][2] == 2
    assert wholes["stop"][0]["finish"] == "stop" and len(wholes["stop"][0]["content"]) < len(text)


def test_tool_choice_and_reasoning_continue_exactly(parser_gateway: str, ipc_dir: Path) -> None:
    """On the engine of ``tokenfan serve`` with the hermes and qwen3 parsers (a second DEALER on its socket)."""
    wholes = continuations(f"ipc://{ipc_dir / 'parser.sock'}", PARSER_BODIES)
    for kind in ("named-tool", "required-tool"):
        assert wholes[kind][0]["tools"][0]["headers"] == 1, wholes[kind]
    assert wholes["json-reasoning"][0]["content"] == ""  # still thinking: the grammar never started
    assert wholes["json-reasoning"][0]["reasoning"] and wholes["auto-tool"][0]["reasoning"]
