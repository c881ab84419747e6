"""Migration on vLLM (the tiny random-weight Llama): a continuation decodes exactly what an uninterrupted
stream decodes, and two real engines behind one gateway lose no answer when one is killed.

- The join, at the engine protocol: a control request's deltas (text and token ids) are recorded over a raw
  ZeroMQ socket; then, from every delta boundary, a continuation (``Submit.resume``) must produce exactly the
  rest: text, finish reason and usage. Random weights write byte-fallback tokens, so characters split across
  tokens occur; a stop string makes vLLM hold text back (the continuation sends it first), and a stop string
  that completes across the join must end the answer where the control run's did.
- Two engines (the session's and a private one) behind one gateway; the private one is killed with SIGKILL
  mid-stream; every client's answer equals the control run's on the session's gateway.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from engine_worker import protocol as p
from tests.e2e.helpers import in_flight, metric, wait_until
from tests.e2e.test_migration import GATEWAY_ARGS, Answer, Run
from tests.procs import Proc, start_gateway, stop_all

pytestmark = pytest.mark.vllm


async def run_submits(address: str, submits: list[p.Submit]) -> dict[str, list[p.Delta]]:
    """Send the submits on one DEALER; every request's deltas until its last (errors fail the test)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    out: dict[str, list[p.Delta]] = {s.request_id: [] for s in submits}
    open_ = set(out)
    try:
        for s in submits:
            await sock.send_multipart(p.encode(s))
        while open_:
            msg = p.decode(await asyncio.wait_for(sock.recv_multipart(), 60))
            assert not isinstance(msg, p.Error), f"{msg.request_id}: {msg.code} {msg.message}"
            if isinstance(msg, p.DeltaBatch):
                for d in msg.deltas:
                    out[d.request_id].append(d)
                    if d.finish_reason is not None:
                        open_.discard(d.request_id)
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


def submit(rid: str, stop: list[str], messages: bool) -> p.Submit:
    sampling = p.Sampling(max_tokens=48, temperature=0.0, stop=stop)
    if messages:
        return p.Submit(request_id=rid, endpoint="chat.completions", sampling=sampling,
                        messages=[p.ChatMessage("user", "Write about rivers, é ü 字 🌊.")])
    return p.Submit(request_id=rid, endpoint="completions", sampling=sampling, prompt="Rivers 字 🌊 run to")


def test_a_continuation_from_any_delta_decodes_exactly_the_rest(vllm_engine: tuple[str, Proc],
                                                                vllm_gateway_url: str) -> None:
    address, _ = vllm_engine  # up once its gateway is (vllm_gateway_url waits for the engine's start)
    cases: list[tuple[bool, list[str]]] = [(False, []), (True, [])]
    base = asyncio.run(run_submits(address, [submit(f"base{k}", stop, m) for k, (m, stop) in enumerate(cases)]))
    # A stop string from the middle of each answer: the control stops there, text is held back before it.
    for k, (messages, _) in enumerate(list(cases)):
        text = "".join(d.text for d in base[f"base{k}"])
        if len(text) > 12:
            cases.append((messages, [text[len(text) // 2:len(text) // 2 + 3]]))
    controls = asyncio.run(run_submits(address, [submit(f"c{k}", stop, m) for k, (m, stop) in enumerate(cases)]))
    continuations: list[p.Submit] = []
    expected: dict[str, tuple[str, str | None, p.Usage | None]] = {}
    split_chars = 0
    for k, (messages, stop) in enumerate(cases):
        deltas = controls[f"c{k}"]
        whole = "".join(d.text for d in deltas)
        ids: list[int] = []
        text = ""
        for d in deltas[:-1]:  # from after each delta but the last
            ids += d.token_ids
            text += d.text
            split_chars += d.token_count > 0 and not d.text  # a token whose character is not complete yet
            rid = f"k{k}-{len(ids)}-{uuid.uuid4().hex[:6]}"
            continuations.append(msgspec.structs.replace(submit(rid, stop, messages), resume=list(ids),
                                                         resume_chars=len(text)))
            expected[rid] = (whole[len(text):], deltas[-1].finish_reason, deltas[-1].usage)
    got = asyncio.run(run_submits(address, continuations))
    for rid, (rest, finish, usage) in expected.items():
        deltas = got[rid]
        assert "".join(d.text for d in deltas) == rest, rid
        assert (deltas[-1].finish_reason, deltas[-1].usage) == (finish, usage), rid
    assert len(expected) > 40
    # what the join must get right was really exercised: characters split across tokens, held-back stop text
    assert split_chars > 0 and len(cases) == 4, (split_chars, cases)
    print(f"{len(expected)} continuations; {split_chars} control deltas ended inside a character")


def test_two_vllm_engines_one_killed_mid_stream_every_client_gets_the_uninterrupted_answer(
        vllm_engine: tuple[str, Proc], vllm_spare_engine: tuple[str, Proc], vllm_gateway_url: str) -> None:
    shared, _ = vllm_engine
    private, engine = vllm_spare_engine  # killed here: no other test uses it
    gateway: Proc | None = None
    try:
        gateway, url = start_gateway(f"{private},{shared}", *GATEWAY_ARGS, name="gateway-vllm-migrate", timeout=300)
        wait_until(lambda: all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]), timeout=300,
                   what="both engines")

        def chat(i: int, **extra: Any) -> dict[str, Any]:
            return {"messages": [{"role": "user", "content": f"river {i}"}], "max_tokens": 300, "temperature": 0,
                    **extra}

        def completions(i: int, **extra: Any) -> dict[str, Any]:
            return {"prompt": f"river {i}", "max_tokens": 300, "temperature": 0, **extra}

        controls: dict[str, tuple[str, dict[str, Any]]] = {}  # client -> the uninterrupted request

        def job(run: Run, c: httpx.AsyncClient, name: str, transport: str, path: str, body: dict[str, Any]) -> Any:
            """The client ``name`` on ``transport``; its control is ``body`` on ``path``, not streamed."""
            controls[name] = (path, body)
            if transport == "sse":
                return run.sse(c, name, path, {**body, "stream": True, "stream_options": USAGE})
            if transport == "ws":
                return run.mux(name, "chat.completions" if path == CHAT else "completions",
                               {**body, "stream_options": USAGE})
            if transport == "fanout":  # /v1/streams read over SSE, WebSocket and by a Last-Event-ID resumer
                return run.fanout(c, name, {**body, "stream_options": USAGE})
            if transport == "responses-sse":
                return run.sse(c, name, path, {**body, "stream": True})
            if transport == "responses-ws":
                return run.responses_ws(name, body)
            if transport == "responses-bg":
                return run.background(c, name, body)
            # the AI SDK's useChat body; its control is the chat request it converts to
            return run.sse(c, name, "/api/chat", {"id": name, **{k: v for k, v in body.items() if k != "messages"},
                                                  "messages": [{"id": "u1", "role": "user", "parts": [
                                                      {"type": "text", "text": body["messages"][0]["content"]}]}]})

        async def clients() -> dict[str, Answer]:
            run = Run(url)
            async with httpx.AsyncClient(timeout=120) as c:
                jobs = [job(run, c, f"chat-{i}", "sse", CHAT, chat(i)) for i in range(3)]
                jobs += [job(run, c, f"completions-{i}", "sse", COMPLETIONS, completions(i)) for i in range(3)]
                jobs += [job(run, c, f"completions-ws-{i}", "ws", COMPLETIONS, completions(10 + i)) for i in range(2)]
                # served by vLLM's OpenAI layer: a grammar, logprobs, penalties and n = 2 continue where they
                # were, on every transport (tool calls and reasoning: tests/e2e/test_resume_parsers.py, whose
                # engines have vLLM's parsers; vLLM takes a named tool choice only with auto tool choice on, and
                # this engine pair has it off, which tests/e2e/test_vllm.py checks)
                jobs += [job(run, c, f"{kind}-{i}", "sse", CHAT, openai_body(kind, i))
                         for kind in OPENAI_KINDS for i in range(2)]
                jobs += [job(run, c, f"{kind}-ws", "ws", CHAT, openai_body(kind, 5)) for kind in OPENAI_KINDS]
                jobs += [job(run, c, f"{kind}-fanout", "fanout", CHAT, openai_body(kind, 6)) for kind in ("json", "penalties")]
                jobs += [job(run, c, f"json-{transport}", transport, "/v1/responses", responses_json(7 + k))
                         for k, transport in enumerate(("responses-sse", "responses-ws", "responses-bg"))]
                jobs.append(job(run, c, "json-ui", "ui", CHAT, openai_body("json", 10)))
                # the kill once half the clients read tokens: waiting for all of them let the engine under the
                # other half finish its answers first on a busy machine (nothing was then in flight there).
                # The engine worker's whole process group, as a container runtime kills a container: a SIGKILL
                # of the worker alone leaves vLLM's EngineCore processes behind (docs/failures.md)
                # and once the engine to kill streams 4 or more answers: its vLLM processes run at nice 19 (they
                # boot in the CPU the other tests leave), and in a full suite its readers could still be
                # waiting for their first token when the others had theirs (nothing was then in flight there)
                return await run.kill_when_started(jobs, lambda: os.killpg(engine.popen.pid, signal.SIGKILL),
                                                   readers=len(jobs) // 2, timeout=180, start_timeout=120,
                                                   ready=lambda: len(in_flight(engine.log())) >= 4)

        answers = asyncio.run(clients())
        expected = {name: control_answer(httpx.post(vllm_gateway_url + path, json=body, timeout=120).json())
                    for name, (path, body) in controls.items()}
        check_vllm(answers, expected)
        # what was compared really was there: logprobs (on a fan-out stream too), both choices of n = 2, the
        # grammar's JSON in chat, Responses and the UI message stream
        assert expected["penalties-0"].logprobs and answers["penalties-fanout/ws"].logprobs
        assert expected["n2-0"].others[1] and expected["n2-0"].logprobs_of(1)
        for name in ("json-0", "json-responses-bg", "json-ui"):
            assert answers[name].text.startswith('{"name":"'), (name, answers[name].text)
        # about half of the generations ran on the killed engine; each was continued, none refused
        lost = in_flight(engine.log())
        continued = metric(url, "tokenfan_migrations_total", {"outcome": "continued"})
        assert len(lost) >= 4 and continued >= len(lost), (lost, continued, gateway.log()[-3000:])
        assert metric(url, "tokenfan_migrations_total", {"outcome": "refused"}) == 0
        print(f"in flight on the killed engine: {len(lost)} of {len(answers)}, continued {continued}")
    finally:
        stop_all([x for x in (gateway, engine) if x is not None])


OPENAI_KINDS = ("json", "penalties", "n2")
USAGE = {"include_usage": True}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def openai_body(kind: str, i: int, **extra: Any) -> dict[str, Any]:
    """A chat request vLLM's OpenAI layer serves: a JSON schema, logprobs with penalties, two choices with
    logprobs (sampled with ``top_k=1``: vLLM refuses ``n`` > 1 with greedy sampling, and one candidate per
    step makes the samples exact)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": f"lake {i}"}], "max_tokens": 300,
                            "temperature": 0, **extra}
    if kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    elif kind == "penalties":
        body.update(logprobs=True, top_logprobs=2, presence_penalty=0.6, frequency_penalty=0.4,
                    repetition_penalty=1.1, min_tokens=60)
    else:
        body.update(n=2, temperature=1.0, top_k=1, seed=i, logprobs=True)
    return body


def responses_json(i: int) -> dict[str, Any]:
    """A Responses request for a JSON schema's answer."""
    return {"input": f"lake {i}", "max_output_tokens": 300, "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}}


def check_vllm(answers: dict[str, Answer], expected: dict[str, Answer]) -> None:
    """Each answer is its control's: text of every choice, finish, usage, and each choice's logprobs (the
    same tokens, none repeated or missing; values within 1e-3, since the answer's start was computed on the
    killed engine, in other batches)."""
    for name, got in answers.items():
        want = expected[name.split("/")[0]]
        assert not got.errors, (name, got.errors)
        assert (got.text, got.others, got.reasoning, got.tools, got.finish) == \
            (want.text, want.others, want.reasoning, want.tools, want.finish), name
        if got.usage is not None:
            assert got.usage == want.usage, name
        for k in (0, *want.others):
            mine, theirs = got.logprobs_of(k), want.logprobs_of(k)
            assert [t for t, _ in mine] == [t for t, _ in theirs], (name, k)
            assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(mine, theirs)), (name, k, mine, theirs)


def control_answer(obj: dict[str, Any]) -> Answer:
    """A non-streamed chat, completions or Responses answer as the :class:`Answer` a stream of it folds to."""
    answer = Answer()
    if obj.get("object") == "response":
        answer.fold_response(obj)
    else:
        answer.fold(obj)
    return answer


