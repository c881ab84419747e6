"""Migration on vLLM (the tiny random-weight Llama): a continuation decodes exactly what an uninterrupted
stream decodes, and two real engines behind one gateway lose no answer when one is killed.

- The join, at the engine protocol: a control request's deltas (text and token ids) are recorded over a raw
  ZeroMQ socket; then, from every delta boundary, a continuation (``Submit.resume``) must produce exactly the
  rest: text, finish reason and usage. Random weights write byte-fallback tokens, so characters split across
  tokens occur; a stop string makes vLLM hold text back (the continuation sends it first), and a stop string
  that completes across the join must end the answer where the control run's did.
- Two engines behind one gateway, both with vLLM's hermes tool parser and qwen3 reasoning parser (the engine
  of the session's ``tokenfan serve`` and a spare one); the spare one is killed with SIGKILL mid-stream under
  plain, reasoning, tool-call (named, required, auto), JSON-schema, logprobs-with-penalties and ``n`` = 2
  answers on every transport; every client's answer equals the control run's on the session's gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from engine_worker import protocol as p
from tests.e2e.helpers import in_flight, in_flight_traces, metric, until, wait_until
from tests.e2e.test_migration import GATEWAY_ARGS, Answer, Run
from tests.procs import Proc, start_gateway, stop_all
from tokenfan_bench.servers.processes import engine_child

if TYPE_CHECKING:
    from tests.conftest import VllmBoot

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


def inside_a_character(d: p.Delta) -> bool:
    """Whether ``d`` ends inside a character: tokens and no text (the character is not complete yet)."""
    return d.token_count > 0 and not d.text


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
    # A character split across tokens shows as a delta of a token and no text, unless a busy engine grouped
    # that token with the next one in one delta (a starved one groups many: fewer deltas to continue from):
    # the controls run again (at most three times) until one shows and there are more than 40 cut points.
    for attempt in range(3):
        controls = asyncio.run(run_submits(address, [submit(f"c{k}-{attempt}", stop, m)
                                                     for k, (m, stop) in enumerate(cases)]))
        controls = {name.rsplit("-", 1)[0]: deltas for name, deltas in controls.items()}
        if any(inside_a_character(d) for deltas in controls.values() for d in deltas[:-1]) and \
                sum(len(deltas) - 1 for deltas in controls.values()) > 40:
            break
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
            split_chars += inside_a_character(d)
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
        parser_gateway: str, vllm_spare_engine: tuple[str, Proc], ipc_dir: Path, vllm_boot: VllmBoot) -> None:
    """The engine of the session's ``tokenfan serve`` with vLLM's parsers (``parser_gateway``) and a spare
    engine with the same flags behind one gateway; the spare is killed; controls on ``parser_gateway``."""
    shared = f"ipc://{ipc_dir / 'parser.sock'}"
    private, engine = vllm_spare_engine  # killed here: no other test uses it
    serve, _ = vllm_boot.get("parser_gateway")
    # the engine worker `tokenfan serve` supervises: its own session, so its own process group
    shared_group = os.getpgid(engine_child(serve.popen.pid))
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
                # served by vLLM's OpenAI layer and its hermes and qwen3 parsers: a grammar, tool calls (named,
                # required, auto), reasoning (a plain chat: the tiny model never closes its <think>), logprobs,
                # penalties and n = 2 continue where they were, on every transport. Two POST SSE clients of
                # each kind go first, one by one (0.1 s apart): least-loaded routing gives one of each pair
                # to each engine, so the engine to kill runs every kind
                paired = [job(run, c, f"chat-{i}", "sse", CHAT, chat(i)) for i in range(2)]
                paired += [job(run, c, f"{kind}-{i}", "sse", CHAT, openai_body(kind, i))
                           for kind in OPENAI_KINDS for i in range(2)]
                jobs = [later(0.1 * k, j) for k, j in enumerate(paired)]
                rest = [job(run, c, "chat-2", "sse", CHAT, chat(2))]
                rest += [job(run, c, f"completions-{i}", "sse", COMPLETIONS, completions(i)) for i in range(3)]
                rest += [job(run, c, f"completions-ws-{i}", "ws", COMPLETIONS, completions(10 + i)) for i in range(2)]
                rest += [job(run, c, f"{kind}-ws", "ws", CHAT, openai_body(kind, 5)) for kind in OPENAI_KINDS]
                rest += [job(run, c, f"{kind}-fanout", "fanout", CHAT, openai_body(kind, 6))
                         for kind in ("json", "penalties", "named-tool", "auto-tool")]
                rest += [job(run, c, f"json-{transport}", transport, "/v1/responses", responses_json(7 + k))
                         for k, transport in enumerate(("responses-sse", "responses-ws", "responses-bg"))]
                rest += [job(run, c, f"tool-{transport}", transport, "/v1/responses", responses_tool(11 + k))
                         for k, transport in enumerate(("responses-sse", "responses-bg"))]
                rest.append(job(run, c, "json-ui", "ui", CHAT, openai_body("json", 10)))
                rest.append(job(run, c, "required-tool-ui", "ui", CHAT, openai_body("required-tool", 10)))
                jobs += [later(0.1 * len(paired), j) for j in rest]
                # Where each request runs is not left to timing: the tiny model writes 300 tokens in about a
                # second, so a client that reached the engine to kill a little early (a busy machine) could
                # end there before the others arrived, and no moment had every kind in flight. Both engines
                # are stopped (SIGSTOP) while the gateway submits, so least-loaded routing (its count of the
                # requests submitted since each engine's last heartbeat) gives one client of each pair to
                # each engine in turn; both go on once every request is submitted and run in lockstep.
                readers = len(jobs) // 2
                jobs.append(continue_when_submitted(url, len(jobs), (engine.popen.pid, shared_group)))
                # the kill once half the clients read tokens: waiting for all of them let the engine under the
                # other half finish its answers first on a busy machine (nothing was then in flight there).
                # The engine worker's whole process group, as a container runtime kills a container: a SIGKILL
                # of the worker alone leaves vLLM's EngineCore processes behind (docs/failures.md)
                # and once every kind but the named tool call (KILLED_KINDS) is in flight on the engine to kill
                # (it is from the thaw on; if not, the failure names what is missing and what runs there)
                return await run.kill_when_started(jobs, lambda: os.killpg(engine.popen.pid, signal.SIGKILL),
                                                   readers=readers, timeout=180, start_timeout=120,
                                                   missing=lambda: not_in_flight(engine.log()))

        freeze((engine.popen.pid, shared_group))
        try:
            answers = asyncio.run(clients())
        finally:
            thaw((engine.popen.pid, shared_group))  # the shared engine serves the controls and later tests
        expected = asyncio.run(streamed_controls(parser_gateway, controls))
        check_vllm(answers, expected)
        # what was compared really was there: logprobs (on a fan-out stream too), both choices of n = 2, the
        # grammar's JSON in chat, Responses and the UI message stream
        assert expected["penalties-0"].logprobs and answers["penalties-fanout/ws"].logprobs
        assert expected["n2-0"].others[1] and expected["n2-0"].logprobs_of(1)
        for name in ("json-0", "json-responses-bg", "json-ui"):
            assert answers[name].text.startswith('{"name":"'), (name, answers[name].text)
        for name in ("named-tool-0", "required-tool-ws", "named-tool-fanout/sse", "tool-responses-bg",
                     "required-tool-ui"):  # calls, each announced once, with arguments (vLLM 0.32's hermes
            # structural tag lets a non-strict call's arguments be `null`, which the tiny model writes)
            assert answers[name].tools and all(t["headers"] == 1 and t["name"] == "get_weather" and t["arguments"]
                                               for t in answers[name].tools.values()), (name, answers[name].tools)
        for name in ("chat-0", "auto-tool-0", "auto-tool-fanout/ws"):  # still thinking at the end
            assert answers[name].reasoning and not answers[name].text, (name, answers[name])
        assert answers["auto-tool-0"].logprobs
        # about half of the generations ran on the killed engine, every kind among them; each was
        # continued, none refused
        lost = in_flight(engine.log())
        assert kinds_in_flight(engine.log()) >= KILLED_KINDS
        continued = metric(url, "tokenfan_migrations_total", {"outcome": "continued"})
        assert len(lost) >= 4 and continued >= len(lost), (lost, continued, gateway.log()[-3000:])
        assert metric(url, "tokenfan_migrations_total", {"outcome": "refused"}) == 0
        print(f"in flight on the killed engine: {len(lost)} of {len(answers)} ({sorted(in_flight_traces(engine.log()))}), "
              f"continued {continued}")
    finally:
        stop_all([x for x in (gateway, engine) if x is not None])


OPENAI_KINDS = ("json", "penalties", "n2", "named-tool", "required-tool", "auto-tool")
# what the killed engine must be running at the kill: every kind but the named tool call, whose answer the
# tiny model ends within ~50 tokens (the call's fixed text and `null` arguments: see the check above), so no
# kill can wait for one; its continuation from every cut point: tests/e2e/test_vllm_resume.py. A `required`
# tool choice writes calls until `max_tokens`: the kill lands between and inside them.
KILLED_KINDS = {"reasoning", *OPENAI_KINDS} - {"named-tool"}


def not_in_flight(engine_log: str) -> str | None:
    """What the engine to kill lacks before the kill (:data:`KILLED_KINDS`), and what it runs; None: nothing."""
    lacking = KILLED_KINDS - kinds_in_flight(engine_log)
    if not lacking:
        return None
    return f"no {sorted(lacking)} in flight among {sorted(in_flight_traces(engine_log))}"


def kinds_in_flight(engine_log: str) -> set[str]:
    """The kinds of the clients in flight on an engine (from their trace ids, the clients' names)."""
    kinds: set[str] = set()
    for name in in_flight_traces(engine_log):
        if name.startswith("chat-"):
            kinds.add("reasoning")  # a plain chat: the tiny model thinks and never stops
        elif name.startswith("tool-responses"):
            kinds.add("named-tool")
        else:
            kinds.update(k for k in OPENAI_KINDS if name.startswith(k + "-"))
    return kinds


USAGE = {"include_usage": True}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
NO_THINKING: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def openai_body(kind: str, i: int, **extra: Any) -> dict[str, Any]:
    """A chat request vLLM's OpenAI layer serves: a JSON schema, logprobs with penalties, two choices with
    logprobs (sampled with ``top_k=1``: vLLM refuses ``n`` > 1 with greedy sampling, and one candidate per
    step makes the samples exact), a named or required tool call (thinking off, as the grammar starts after
    the reasoning, which the tiny model never ends), and auto tool choice with logprobs (it thinks)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": f"lake {i}"}], "max_tokens": 300,
                            "temperature": 0, **extra}
    if kind != "auto-tool":
        body.update(NO_THINKING)
    if kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    elif kind == "penalties":
        body.update(logprobs=True, top_logprobs=2, presence_penalty=0.6, frequency_penalty=0.4,
                    repetition_penalty=1.1, min_tokens=60)
    elif kind == "n2":
        body.update(n=2, temperature=1.0, top_k=1, seed=i, logprobs=True)
    elif kind == "named-tool":
        body.update(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    elif kind == "required-tool":
        body.update(tools=TOOLS, tool_choice="required")
    else:
        body.update(tools=TOOLS, logprobs=True)
    return body


def responses_json(i: int) -> dict[str, Any]:
    """A Responses request for a JSON schema's answer."""
    return {"input": f"lake {i}", "max_output_tokens": 300, "temperature": 0, **NO_THINKING,
            "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}}


def responses_tool(i: int) -> dict[str, Any]:
    """A Responses request whose answer is a named function call."""
    return {"input": f"weather {i}", "max_output_tokens": 300, "temperature": 0, **NO_THINKING,
            "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "tool_choice": {"type": "function", "name": "get_weather"}}


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


def freeze(groups: tuple[int, ...]) -> None:
    """Stop the process groups (SIGSTOP), then wait out a heartbeat already on its way to the gateway."""
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    time.sleep(0.5)


def thaw(groups: tuple[int, ...]) -> None:
    """Let the stopped process groups go on (SIGCONT); a group already gone (killed) is skipped."""
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGCONT)


async def continue_when_submitted(url: str, requests: int, groups: tuple[int, ...], timeout: float = 20) -> None:
    """Thaw the stopped engines once the gateway holds ``requests`` in flight (all submitted), or after
    ``timeout`` s (then the kill's gate names what is missing); well within the test gateway's 30 s
    heartbeat timeout."""
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            async def submitted() -> bool:
                engines = (await c.get(url + "/health")).json()["engines"]
                return sum(e["in_flight"] for e in engines) >= requests

            with contextlib.suppress(AssertionError):
                await until(submitted, timeout, "every request submitted")
    finally:
        thaw(groups)


async def later(delay: float, job: Any) -> Any:
    """``job`` (a coroutine) after ``delay`` seconds."""
    await asyncio.sleep(delay)
    return await job


async def streamed_controls(url: str, controls: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Answer]:
    """Each client's uninterrupted control, streamed (chat and completions over POST SSE; Responses whole):
    vLLM answers a ``required`` tool choice cut by ``max_tokens`` differently when not streamed (the call
    array's text as content), so a stream is compared with a stream."""
    run = Run(url)
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(name: str, path: str, body: dict[str, Any]) -> tuple[str, Answer]:
            if path == "/v1/responses":
                return name, control_answer((await c.post(url + path, json=body)).json())
            return name, await run.sse(c, name, path, {**body, "stream": True, "stream_options": USAGE})

        return dict(await asyncio.gather(*(one(name, *control) for name, control in controls.items())))


def control_answer(obj: dict[str, Any]) -> Answer:
    """A non-streamed chat, completions or Responses answer as the :class:`Answer` a stream of it folds to."""
    answer = Answer()
    if obj.get("object") == "response":
        answer.fold_response(obj)
    else:
        answer.fold(obj)
    return answer


