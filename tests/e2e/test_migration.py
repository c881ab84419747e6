"""An engine that dies costs no client its answer: kill -9 an engine mid-stream and every generation it ran
continues on a healthy (or restarted) engine from the tokens already delivered (docs/failures.md).

Real processes: synthetic engines (deterministic per seed: a continuation is exact), a gateway, clients on
every path: POST SSE chat and completions, non-streamed chat and completions, ``/v1/ws``, a ``/v1/streams``
stream with an SSE and a WebSocket subscriber and one that resumes by ``Last-Event-ID`` after the kill, the
Responses API over SSE, WebSocket mode and in the background. Each answer must equal an uninterrupted
control run's (text, finish reason, usage), with no error event and nothing repeated (fan-out ``seq``
continuous). The vLLM variant (two real engines on the tiny model) is in test_vllm.py's module group, below.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.helpers import in_flight, metric, sse_events, wait_until
from tests.e2e.test_serve import engine_pid
from tests.procs import (
    NO_CLIENT_LIMITS,
    Proc,
    free_port,
    spawn,
    start_engine,
    start_gateway,
    stop_all,
    wait_healthy,
)

ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "25", "--synthetic-ttft-ms", "5")
TOKENS = 50  # 2 s per answer: the kill lands mid-stream
# The drop is seen on the socket at once; a 30 s heartbeat timeout makes sure that is what this tests.
GATEWAY_ARGS = ("--heartbeat-timeout", "30", *NO_CLIENT_LIMITS)


UI_FINISH = {"stop": "stop", "length": "length", "tool-calls": "tool_calls"}  # UI message finish -> chat's


@dataclass
class Answer:
    """What a client assembled, from any path's payloads (:class:`Run`): choice 0's text, reasoning and tool
    calls (by index: name, arguments, how many headers announced it), the other choices' text (``n`` > 1),
    every logprob, finish, usage, errors and event ids."""

    text: str = ""
    finish: str | None = None
    usage: dict[str, int] | None = None
    errors: list[Any] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    reasoning: str = ""
    tools: dict[int, dict[str, Any]] = field(default_factory=dict)
    others: dict[int, str] = field(default_factory=dict)  # the text of each choice after the first (n > 1)
    logprobs: list[tuple[int, str, float]] = field(default_factory=list)  # (choice, token, logprob) in order
    tops: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (choice, its top_logprobs), likewise

    def logprobs_of(self, index: int) -> list[tuple[str, float]]:
        return [(token, lp) for k, token, lp in self.logprobs if k == index]

    def tops_of(self, index: int) -> list[dict[str, float]]:
        return [top for k, top in self.tops if k == index]

    def fold(self, obj: dict[str, Any]) -> None:
        """A chat or completions chunk, or a whole (non-streamed) response."""
        for choice in obj.get("choices") or ():
            index = choice.get("index", 0)
            if "delta" in choice or "message" in choice:
                part = choice.get("delta") or choice.get("message") or {}
                text = part.get("content") or ""
                entries = (choice.get("logprobs") or {}).get("content") or ()
                self.logprobs += [(index, e["token"], e["logprob"]) for e in entries]
                self.tops += [(index, {t["token"]: t["logprob"] for t in e.get("top_logprobs") or ()})
                              for e in entries]
            else:  # completions
                part, text = {}, choice.get("text") or ""
            if index:
                self.others[index] = self.others.get(index, "") + text
                continue
            self.text += text
            self.reasoning += part.get("reasoning") or ""
            for k, tc in enumerate(part.get("tool_calls") or ()):
                call = self.tools.setdefault(tc.get("index", k), {"headers": 0, "name": "", "arguments": ""})
                call["headers"] += 1 if tc.get("id") else 0
                call["name"] += (tc.get("function") or {}).get("name") or ""
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            self.finish = choice.get("finish_reason") or self.finish
        if obj.get("usage"):
            self.usage = usage_of(obj["usage"])

    def fold_response(self, response: dict[str, Any], text: bool = True) -> None:
        """A whole Responses object: its items as the chat fields they come from (``text=False``: not the
        message text, which its stream's deltas gave)."""
        for k, item in enumerate(i for i in response["output"] if i["type"] == "function_call"):
            self.tools[k] = {"headers": 1, "name": item["name"], "arguments": item["arguments"]}
        for item in response["output"]:
            if item["type"] == "message" and text:
                self.text += "".join(part["text"] for part in item["content"])
            elif item["type"] == "reasoning":
                self.reasoning += "".join(part["text"] for part in item.get("content") or ())
        self.finish = response["status"]
        self.usage = usage_of(response["usage"])

    def fold_event(self, ev: dict[str, Any]) -> bool:
        """One Responses event; True at the end."""
        if ev["type"] == "response.output_text.delta":
            self.text += ev["delta"]
        elif ev["type"] in ("response.completed", "response.incomplete"):
            self.fold_response(ev["response"], text=False)
            return True
        elif ev["type"] in ("error", "response.failed"):
            self.errors.append(ev)
            return True
        return False

    def fold_part(self, part: dict[str, Any]) -> None:
        """A part of the AI SDK's UI message stream (``/api/chat``) as the chat fields it renders."""
        kind = part["type"]
        if kind == "text-delta":
            self.text += part["delta"]
        elif kind == "reasoning-delta":
            self.reasoning += part["delta"]
        elif kind == "tool-input-start":
            self.tools[len(self.tools)] = {"headers": 1, "name": part["toolName"], "arguments": "",
                                           "id": part["toolCallId"]}
        elif kind == "tool-input-delta":
            call = next(c for c in self.tools.values() if c["id"] == part["toolCallId"])
            call["arguments"] += part["inputTextDelta"]
        elif kind == "tool-input-available":
            call = next(c for c in self.tools.values() if c["id"] == part["toolCallId"])
            assert json.loads(call["arguments"]) == part["input"], (call, part)
        elif kind == "finish":
            self.finish = UI_FINISH[part["finishReason"]]
            for call in self.tools.values():
                del call["id"]
        elif kind in ("error", "abort"):
            self.errors.append(part)


def chat_body(i: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"tell me about river {i}"}], "max_tokens": TOKENS,
            "seed": i, **extra}


def completions_body(i: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": f"river {i}", "max_tokens": TOKENS, "seed": i, **extra}


def responses_body(i: int, **extra: Any) -> dict[str, Any]:
    return {"input": f"tell me about river {i}", "max_output_tokens": TOKENS,
            "metadata": {"case": str(i)}, **extra}


def usage_of(u: dict[str, Any] | None) -> dict[str, int] | None:
    if u is None:
        return None
    if "input_tokens" in u:  # a Responses usage
        return {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"]}
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"]}


def trace(name: str) -> dict[str, str]:
    """The ``X-Request-ID`` of client ``name``'s request: the engine logs it (``accepted <id> trace=<name>``),
    so a test reads which clients were in flight on an engine (:func:`tests.e2e.helpers.in_flight_traces`)."""
    return {"X-Request-ID": name}


class Run:
    """The clients of one scenario, on every path; each releases ``started`` once it has read a few
    events (its request is then in flight), and folds what it reads into its :class:`Answer`. Each request
    that starts a generation carries the client's name as its ``X-Request-ID`` (:func:`trace`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws = url.replace("http", "ws")
        self.started = asyncio.Semaphore(0)
        self.killed = asyncio.Event()
        self.answers: dict[str, Answer] = {}

    def _answer(self, name: str) -> Answer:
        return self.answers.setdefault(name, Answer())

    async def sse(self, c: httpx.AsyncClient, name: str, path: str, body: dict[str, Any] | None,
                  headers: dict[str, str] | None = None) -> Answer:
        """POST ``body`` (GET when None) and read the SSE answer: chunks, Responses events or, on
        ``/api/chat``, the AI SDK's UI message parts. A GET resuming (``Last-Event-ID``) at the end of a
        finished stream gets 204, and nothing more to read."""
        answer = self._answer(name)
        seen = 0
        if body is not None:
            headers = {**trace(name), **(headers or {})}
        async with c.stream("GET" if body is None else "POST", self.url + path, json=body, headers=headers) as r:
            if r.status_code == 204 and body is None and "Last-Event-ID" in (headers or {}):
                return answer
            assert r.status_code == 200, await r.aread()
            buf = ""
            async for text in r.aiter_text():
                buf += text
                *whole, buf = buf.split("\n\n")
                for ev in sse_events("\n\n".join(whole) + "\n\n") if whole else []:
                    if ev.get("event") == "error":
                        answer.errors.append(ev["data"])
                        continue
                    if ev.get("data") in (None, "[DONE]"):
                        continue
                    if "id" in ev:
                        answer.seqs.append(int(ev["id"]))
                    data = json.loads(ev["data"])
                    if path == "/api/chat":
                        answer.fold_part(data)
                    elif path.startswith("/v1/responses"):
                        answer.fold_event(data)
                    else:
                        answer.fold(data)
                    seen += 1
                    if seen == 3:
                        self.started.release()
        return answer

    async def full(self, c: httpx.AsyncClient, name: str, path: str, body: dict[str, Any]) -> Answer:
        self.started.release()  # nothing to read until the end: it is in flight once sent
        r = await c.post(self.url + path, json=body, headers=trace(name))
        assert r.status_code == 200, r.text
        answer = self._answer(name)
        answer.fold(r.json())
        return answer

    async def mux(self, name: str, endpoint: str, body: dict[str, Any]) -> Answer:
        answer = self._answer(name)
        async with websockets.connect(self.ws + "/v1/ws", additional_headers=trace(name)) as sock:
            await sock.send(json.dumps({"type": "request", "id": name, "endpoint": endpoint, "body": body}))
            seen = 0
            while True:
                msg = json.loads(await sock.recv())
                if msg["type"] == "chunk":
                    answer.fold(msg["data"])
                    seen += 1
                    if seen == 3:
                        self.started.release()
                elif msg["type"] == "done":
                    return answer
                else:
                    answer.errors.append(msg)
                    return answer

    async def fanout(self, c: httpx.AsyncClient, name: str, body: dict[str, Any]) -> None:
        """A ``/v1/streams`` stream read over SSE (``<name>/sse``) and WebSocket (``<name>/ws``), and by
        a reader that leaves after 4 events and comes back after the kill with Last-Event-ID
        (``<name>/resumed``)."""
        r = await c.post(self.url + "/v1/streams", json=body, headers=trace(name))
        assert r.status_code == 201, r.text
        created = r.json()
        ws_answer = self._answer(name + "/ws")

        async def ws_reader() -> None:
            async with websockets.connect(created["ws_url"]) as sock:
                while True:
                    msg = json.loads(await sock.recv())
                    if msg["type"] == "chunk":
                        ws_answer.seqs.append(msg["seq"])
                        ws_answer.fold(msg["data"])
                    elif msg["type"] == "done":
                        return
                    else:
                        ws_answer.errors.append(msg)
                        return

        async def resumer() -> None:
            first = self._answer(name + "/resumed")
            async with c.stream("GET", created["events_url"]) as r:
                async for line in r.aiter_lines():
                    if line.startswith("id: "):
                        first.seqs.append(int(line[4:]))
                    elif line.startswith("data: {"):
                        first.fold(json.loads(line[6:]))
                        if len(first.seqs) == 4:
                            break
            self.started.release()
            await self.killed.wait()
            await self.sse(c, name + "/resumed", f"/v1/streams/{created['id']}/events", None,
                           headers={"Last-Event-ID": str(first.seqs[-1])})

        await asyncio.gather(self.sse(c, name + "/sse", f"/v1/streams/{created['id']}/events", None),
                             ws_reader(), resumer())

    async def responses_ws(self, name: str, body: dict[str, Any]) -> Answer:
        """The Responses API's WebSocket mode; ``started`` after 3 delta events (text, reasoning or a
        tool call's arguments)."""
        answer = self._answer(name)
        async with websockets.connect(self.ws + "/v1/responses", additional_headers=trace(name)) as sock:
            await sock.send(json.dumps({"type": "response.create", **body}))
            seen = 0
            while True:
                ev = json.loads(await sock.recv())
                if ev["type"].endswith(".delta"):
                    seen += 1
                    if seen == 3:
                        self.started.release()
                if answer.fold_event(ev):
                    return answer

    async def background(self, c: httpx.AsyncClient, name: str, body: dict[str, Any]) -> Answer:
        r = await c.post(self.url + "/v1/responses", json={**body, "background": True, "store": True},
                         headers=trace(name))
        assert r.status_code == 200, r.text
        return await self.sse(c, name, f"/v1/responses/{r.json()['id']}?stream=true", None)

    async def kill_when_started(self, jobs: list[Any], kill: Callable[[], Any], readers: int | None = None,
                                timeout: float = 90, start_timeout: float = 60,
                                missing: Callable[[], str | None] | None = None) -> dict[str, Answer]:
        """Run ``jobs``; ``kill()`` once ``readers`` of them (default: one per job) have started and
        ``missing()`` names nothing (e.g. the engine to kill runs some of them); wait for every job's end."""
        running = asyncio.gather(*jobs)
        for _ in range(len(jobs) if readers is None else readers):
            await asyncio.wait_for(self.started.acquire(), start_timeout)
        deadline = time.monotonic() + start_timeout
        while missing is not None and (lack := missing()) is not None:
            assert time.monotonic() < deadline, f"not ready to kill: {lack}"
            await asyncio.sleep(0.05)
        kill()
        self.killed.set()
        await asyncio.wait_for(running, timeout)
        return self.answers


async def every_path(url: str, kill: Any) -> dict[str, Answer]:
    """Every path's clients, the kill once each has tokens, their answers."""
    run = Run(url)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        jobs = [
            run.sse(c, "chat-sse", "/v1/chat/completions",
                    chat_body(1, stream=True, stream_options={"include_usage": True})),
            run.sse(c, "completions-sse", "/v1/completions",
                    completions_body(2, stream=True, stream_options={"include_usage": True})),
            run.sse(c, "chat-sse-2", "/v1/chat/completions", chat_body(3, stream=True)),
            run.full(c, "chat-full", "/v1/chat/completions", chat_body(4)),
            run.full(c, "completions-full", "/v1/completions", completions_body(5)),
            run.mux("ws-chat", "chat.completions", chat_body(6, stream_options={"include_usage": True})),
            run.mux("ws-completions", "completions", completions_body(7)),
            run.fanout(c, "fanout", chat_body(8)),
            run.sse(c, "responses-sse", "/v1/responses", responses_body(9, stream=True)),
            run.responses_ws("responses-ws", responses_body(10)),
            run.background(c, "responses-bg", responses_body(11)),
        ]
        # every reader: the fan-out stream's resuming reader too
        return await run.kill_when_started(jobs, kill, readers=len(jobs) + 1)


def control(url: str) -> dict[str, Answer]:
    """The same requests, uninterrupted, read whole."""
    def post(path: str, body: dict[str, Any]) -> Answer:
        obj = httpx.post(url + path, json=body, timeout=60).json()
        if path == "/v1/responses":
            text = "".join(part["text"] for item in obj["output"] for part in item.get("content", []))
            return Answer(text, obj["status"], usage_of(obj["usage"]))
        choice = obj["choices"][0]
        return Answer(choice["message"]["content"] if "message" in choice else choice["text"],
                      choice["finish_reason"], usage_of(obj["usage"]))

    requests = {
        **{name: ("/v1/chat/completions", chat_body(i)) for name, i in (
            ("chat-sse", 1), ("chat-sse-2", 3), ("chat-full", 4), ("ws-chat", 6), ("fanout", 8))},
        **{name: ("/v1/completions", completions_body(i)) for name, i in (
            ("completions-sse", 2), ("completions-full", 5), ("ws-completions", 7))},
        **{name: ("/v1/responses", responses_body(i)) for name, i in (
            ("responses-sse", 9), ("responses-ws", 10), ("responses-bg", 11))}}
    with ThreadPoolExecutor(len(requests)) as pool:  # all at once: each takes a stream's time
        answers = {name: pool.submit(post, *req) for name, req in requests.items()}
        return {name: a.result() for name, a in answers.items()}


def check(answers: dict[str, Answer], expected: dict[str, Answer]) -> None:
    for name, got in answers.items():
        base = name.split("/")[0]
        want = expected[base]
        assert not got.errors, (name, got.errors)
        assert got.text == want.text, (name, got.text, want.text)
        assert got.finish == want.finish, (name, got.finish, want.finish)
        if got.usage is not None:  # every reader that asked for usage got the whole answer's
            assert got.usage == want.usage, (name, got.usage, want.usage)
        if got.seqs:  # numbered events: each once, in order
            assert got.seqs == list(range(got.seqs[0], got.seqs[0] + len(got.seqs))), (name, got.seqs)
    resumed = answers["fanout/resumed"]
    assert resumed.seqs[0] == 0 and len(resumed.seqs) > 4  # its first visit and its resume, joined
    for name in ("chat-sse", "completions-sse", "ws-chat", "responses-sse", "responses-ws", "responses-bg"):
        assert answers[name].usage is not None, name


def test_two_engines_one_killed_mid_stream_every_client_gets_the_uninterrupted_answer(ipc_dir: Path) -> None:
    addresses = [f"ipc://{ipc_dir / f'migrate-{k}.sock'}" for k in "ab"]
    engines = [start_engine(a, *ENGINE_ARGS, name=f"engine-migrate-{k}") for a, k in zip(addresses, "ab")]
    gateway: Proc | None = None
    try:
        gateway, url = start_gateway(",".join(addresses), *GATEWAY_ARGS, name="gateway-migrate")
        wait_until(lambda: all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]), timeout=20,
                   what="both engines")
        answers = asyncio.run(every_path(url, lambda: os.kill(engines[0].popen.pid, signal.SIGKILL)))
        check(answers, control(url))
        # about half the generations ran on the killed engine: every one of them was continued
        lost = in_flight(engines[0].log())
        continued = metric(url, "tokenfan_migrations_total", {"outcome": "continued"})
        assert len(lost) >= 3 and continued >= len(lost), (lost, continued, gateway.log()[-3000:])
        for outcome in ("refused", "timeout", "failed"):
            assert metric(url, "tokenfan_migrations_total", {"outcome": outcome}) == 0
        assert metric(url, "tokenfan_migration_gap_seconds_count") == continued
        assert "continued on engine" in gateway.log()
    finally:
        stop_all([p for p in (gateway, *engines) if p is not None])


def test_serve_engine_killed_mid_stream_every_client_continues_after_the_restart(ipc_dir: Path) -> None:
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", *ENGINE_ARGS, *GATEWAY_ARGS, "--port", str(port),
                  "--log-level", "warning", "--engine-address", f"ipc://{ipc_dir / 'migrate-serve.sock'}"],
                 "serve-migrate")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 30)

        answers = asyncio.run(every_path(url, lambda: os.kill(engine_pid(proc), signal.SIGKILL)))
        check(answers, control(url))
        total = sum(metric(url, "tokenfan_migrations_total", {"outcome": o})
                    for o in ("continued", "refused", "timeout", "failed"))
        assert metric(url, "tokenfan_migrations_total", {"outcome": "continued"}) == total >= 11
    finally:
        proc.stop()


@pytest.mark.parametrize("limit", ["0"])
def test_with_migration_off_the_clients_are_told(ipc_dir: Path, limit: str) -> None:
    """``--migration-limit 0``: today's explicit ``engine_unavailable``, on a POST SSE stream."""
    address = f"ipc://{ipc_dir / 'migrate-off.sock'}"
    engine = start_engine(address, *ENGINE_ARGS, name="engine-migrate-off")
    gateway: Proc | None = None
    try:
        gateway, url = start_gateway(address, *GATEWAY_ARGS, "--migration-limit", limit, name="gateway-migrate-off")

        async def one() -> list[str]:
            run = Run(url)
            async with httpx.AsyncClient(timeout=30) as c:
                job = asyncio.ensure_future(run.sse(c, "x", "/v1/completions", completions_body(1, stream=True)))
                await asyncio.wait_for(run.started.acquire(), 30)
                os.kill(engine.popen.pid, signal.SIGKILL)
                answer = await asyncio.wait_for(job, 30)
            return [json.loads(e)["error"]["code"] for e in answer.errors]

        assert asyncio.run(one()) == ["engine_unavailable"]
        assert metric(url, "tokenfan_migrations_total", {"outcome": "refused"}) == 1
        assert metric(url, "tokenfan_migration_refusals_total", {"reason": "limit"}) == 1
    finally:
        stop_all([p for p in (gateway, engine) if p is not None])
