"""The Vercel AI SDK's ``useChat`` against tokenfan's ``/api/chat`` (the UI message stream protocol).

The page (``tests/node/ui_chat/page.jsx``: ``@ai-sdk/react``'s ``useChat`` with ``DefaultChatTransport``,
``onToolCall`` + ``addToolResult``, ``sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithToolCalls``,
``resume``) is bundled from npm with esbuild when the module starts and served under the gateway's own origin
(Playwright answers its two files), so the transport's default paths reach tokenfan unchanged. It runs in
headless Chromium against:

- the scripted model under vLLM's layer (``--synthetic-script``, vLLM's ``qwen3`` reasoning and ``hermes``
  tool parsers): text, reasoning, the client-side tool loop, a reload mid-answer, stop;
- synthetic engines: an engine killed mid-answer, and two gateway replicas sharing a real ``redis-server``;
- vLLM's tiny model (the session's ``parser_gateway``): text, and the tool loop with the call forced by a
  ``structured_outputs`` regex (random weights).

``tests/node/ui_chat/read_stream.mjs`` reads the endpoint with the SDK's ``readUIMessageStream``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, Route
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from tests.e2e.helpers import engine_core, metric, step_stopped, wait_until
from tests.procs import (
    NODE_DIR,
    Proc,
    free_port,
    npm_ci,
    run_node,
    spawn,
    start_engine,
    start_gateway,
    stop_all,
    wait_healthy,
)
from tests.system import require

if TYPE_CHECKING:
    from tests.conftest import VllmBoot

UI_NODE_DIR = NODE_DIR / "ui_chat"
PAGE_PATH = "/ui-chat-test/"  # where Playwright serves the bundle, under the gateway's origin
ABORTED = "tokenfan_requests_aborted_total"

HELLO = ["Hello", " from", " the", " scripted", " model", ",", " one", " piece", " per", " engine", " step", "."]
LONG = [f" word{i}" for i in range(100)]  # ~300 tokens: 5 s at 60 tokens/s
THOUGHT, ANSWER = "Let me think about it.", "The answer is 42."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
AFTER_TOOL = "It is 18 C in Paris."
SCRIPT = [  # first match wins: the tool's result is in the second turn's prompt with the question
    {"match": r'"celsius":\s*18', "reply": [AFTER_TOOL[i:i + 3] for i in range(0, len(AFTER_TOOL), 3)]},
    {"match": "weather in Paris", "reply": [CALL[i:i + 5] for i in range(0, len(CALL), 5)]},
    {"match": "think it over", "reply": ["<thi", "nk>", *(THOUGHT[i:i + 4] for i in range(0, len(THOUGHT), 4)),
                                         "</think>", ANSWER]},
    {"match": "tell a long story", "reply": LONG},
    {"match": "say hello", "reply": HELLO},
]
# vLLM's qwen3 reasoning parser reads an answer without </think> as reasoning unless thinking is off
NO_THINK = {"max_tokens": 1000, "chat_template_kwargs": {"enable_thinking": False}}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}


# -- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ui_node_dir() -> Path:
    try:
        return npm_ci(UI_NODE_DIR)
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def bundle(ui_node_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page, bundled from npm by esbuild (``build.mjs``; about 1 s)."""
    out = tmp_path_factory.mktemp("ui-chat-bundle")
    proc = subprocess.run(["node", str(ui_node_dir / "build.mjs"), str(out)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def scripted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``tokenfan serve`` on the scripted model with vLLM's parsers, 60 tokens/s (the long answer: ~5 s)."""
    script = tmp_path_factory.mktemp("ui-chat-script") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", "--engine", "synthetic", "--synthetic-script", str(script),
                  "--model", str(tiny_model), "--served-model-name", "tiny", "--port", str(port),
                  "--synthetic-tokens-per-s", "60", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--reasoning-parser", "qwen3"], "ui-chat-scripted")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout=300)
        yield url
    finally:
        proc.stop(timeout=30)


# -- the page -------------------------------------------------------------------------------------------


def open_chat(browser: Browser, base: str, bundle: Path, chat: str, *, resume: bool = False,
              settings: dict[str, Any] | None = None) -> Page:
    """A new browser context on the page at ``base`` (the gateway's origin), chat id ``chat``."""
    context = browser.new_context()

    def serve(route: Route) -> None:
        name = urllib.parse.urlsplit(route.request.url).path.removeprefix(PAGE_PATH) or "index.html"
        kind = "text/html" if name.endswith(".html") else "text/javascript"
        route.fulfill(status=200, body=(bundle / name).read_bytes(), content_type=kind)

    context.route(f"{base}{PAGE_PATH}**", serve)
    page = context.new_page()
    page.set_default_timeout(60_000)
    query = urllib.parse.urlencode({"chat": chat, "resume": "1" if resume else "0",
                                    "settings": json.dumps(NO_THINK if settings is None else settings)})
    page.goto(f"{base}{PAGE_PATH}index.html?{query}")
    page.wait_for_function("window.chatState !== undefined && window.chatState.status === 'ready'")
    return page


def chat_state(page: Page) -> dict[str, Any]:
    return page.evaluate("window.chatState")  # type: ignore[no-any-return]


def send(page: Page, text: str) -> None:
    page.evaluate("(t) => { window.send(t); }", text)


def wait_settled(page: Page, assistant_messages: int = 1) -> dict[str, Any]:
    """The state once the chat is ready or failed with ``assistant_messages`` answers (the SDK's own status)."""
    page.wait_for_function(
        "(n) => { const s = window.chatState; return (s.status === 'ready' || s.status === 'error') && "
        "s.messages.filter((m) => m.role === 'assistant').length >= n; }", arg=assistant_messages)
    return chat_state(page)


def answer(state: dict[str, Any], kind: str = "text") -> str:
    """The text (or reasoning) of the last assistant message."""
    last = [m for m in state["messages"] if m["role"] == "assistant"][-1]
    return "".join(p["text"] for p in last["parts"] if p["type"] == kind)


def wait_partial(page: Page, chars: int) -> str:
    """Wait until the streaming answer shows at least ``chars`` characters; returns what it shows (on a
    timeout, the assertion carries the page's state: what it had instead)."""
    try:
        page.wait_for_function(
            "(n) => { const s = window.chatState; const m = s && s.messages[s.messages.length - 1];"
            " return !!m && s.status === 'streaming' && m.role === 'assistant' &&"
            " m.parts.filter((p) => p.type === 'text').map((p) => p.text).join('').length >= n; }", arg=chars)
    except PlaywrightTimeoutError:
        raise AssertionError(f"no streaming answer of {chars}+ characters; the page shows "
                             f"{page.evaluate('window.chatState')!r}") from None
    return answer(chat_state(page))


def control_text(browser: Browser, base: str, bundle: Path, question: str, settings: dict[str, Any] | None = None,
                 ) -> str:
    """An uninterrupted run of ``question`` on a fresh chat."""
    page = open_chat(browser, base, bundle, f"control-{free_port()}", settings=settings)
    try:
        send(page, question)
        state = wait_settled(page)
        assert state["status"] == "ready", state["error"]
        return answer(state)
    finally:
        page.context.close()


# -- the scripted model under vLLM's layer -----------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.browser
def test_usechat_streams_text_into_the_message_list(browser: Browser, scripted: str, bundle: Path) -> None:
    page = open_chat(browser, scripted, bundle, "hello-chat")
    send(page, "Please say hello.")
    state = wait_settled(page)
    assert state["status"] == "ready" and state["error"] is None
    assert answer(state) == "".join(HELLO)
    assert page.inner_text("#messages li.assistant .text") == "".join(HELLO)
    partial = [t for t in page.evaluate("[...window.renderedTexts]") if t and t != "".join(HELLO)]
    assert len(partial) >= 3, partial  # rendered piece by piece while it streamed
    assert all("".join(HELLO).startswith(t) for t in partial)
    [user, assistant] = state["messages"]
    assert user["role"] == "user" and assistant["id"].startswith("msg-")
    assert [p["type"] for p in assistant["parts"]] == ["step-start", "text"]
    page.context.close()


@pytest.mark.vllm
@pytest.mark.browser
def test_reasoning_parts_appear_before_the_answer(browser: Browser, scripted: str, bundle: Path) -> None:
    page = open_chat(browser, scripted, bundle, "think-chat", settings={"max_tokens": 400})
    send(page, "Please think it over.")
    state = wait_settled(page)
    assert state["status"] == "ready", state["error"]
    assert answer(state, "reasoning") == THOUGHT
    assert answer(state) == ANSWER
    parts = [p["type"] for p in state["messages"][-1]["parts"]]
    assert parts == ["step-start", "reasoning", "text"]
    page.context.close()


@pytest.mark.vllm
@pytest.mark.browser
def test_client_side_tool_loop_completes_with_the_final_answer(browser: Browser, scripted: str,
                                                               bundle: Path) -> None:
    page = open_chat(browser, scripted, bundle, "tool-chat", settings={**NO_THINK, "tools": [WEATHER_TOOL]})
    send(page, "What is the weather in Paris?")
    page.wait_for_function("window.chatState.status === 'ready' && window.toolCalls.length === 1 && "
                           "window.chatState.messages[window.chatState.messages.length - 1].parts"
                           ".some((p) => p.type === 'text')")
    state = chat_state(page)
    assert state["error"] is None
    assert page.evaluate("window.toolCalls") == [{"name": "get_weather", "input": {"city": "Paris"}}]
    [_user, assistant] = state["messages"]  # the second turn continued the same assistant message
    types = [p["type"] for p in assistant["parts"]]
    assert types == ["step-start", "tool-get_weather", "step-start", "text"], types
    tool = assistant["parts"][1]
    assert tool["state"] == "output-available" and tool["input"] == {"city": "Paris"}
    assert tool["output"] == {"city": "Paris", "celsius": 18}
    assert answer(state) == AFTER_TOOL
    page.context.close()


@pytest.mark.vllm
@pytest.mark.browser
def test_a_reload_mid_answer_resumes_it_and_the_text_equals_an_uninterrupted_run(
        browser: Browser, scripted: str, bundle: Path) -> None:
    question = "Please tell a long story."
    control = control_text(browser, scripted, bundle, question)
    assert control == "".join(LONG)
    resumed = metric(scripted, "tokenfan_requests_total", {"endpoint": "/api/chat/{id}/stream", "status": "200"})
    page = open_chat(browser, scripted, bundle, "reload-chat", resume=True)
    send(page, question)
    before = wait_partial(page, 60)
    assert len(before) < len(control)
    page.reload()  # the page holds nothing of the answer now; useChat({resume: true}) asks for the rest
    state = wait_settled(page)
    assert state["status"] == "ready", state["error"]
    assert answer(state) == control  # nothing lost, nothing doubled
    assert [m["role"] for m in state["messages"]] == ["assistant"]
    assert metric(scripted, "tokenfan_requests_total", {"endpoint": "/api/chat/{id}/stream", "status": "200"}) \
        == resumed + 1
    page.context.close()


@pytest.mark.vllm
@pytest.mark.browser
def test_stop_and_the_cancel_endpoint_abort_the_generation_in_the_engine(
        browser: Browser, scripted: str, bundle: Path) -> None:
    page = open_chat(browser, scripted, bundle, "stop-chat", resume=True)
    aborted = metric(scripted, ABORTED)
    send(page, "Please tell a long story.")
    wait_partial(page, 20)
    reply = page.evaluate("window.stop()")
    assert reply["cancelled"] is True, reply
    wait_until(lambda: metric(scripted, ABORTED) == aborted + 1, timeout=10, what="the abort counted")
    wait_until(lambda: httpx.get(scripted + "/health").json()["engine"]["running"] == 0, timeout=10,
               what="the engine runs nothing")
    state = wait_settled(page)
    assert state["status"] == "ready" and state["error"] is None
    assert "".join(LONG).startswith(answer(state)) and answer(state) != "".join(LONG)
    assert httpx.get(scripted + "/api/chat/stop-chat/stream").status_code == 204  # nothing runs any more
    page.context.close()


# -- synthetic engines: a failing engine, two replicas sharing Redis ------------------------------------


@pytest.mark.browser
def test_an_engine_failure_mid_answer_is_the_sdks_error_state(
        browser: Browser, bundle: Path, ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir / 'ui-chat-failing.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "40", name="ui-chat-engine")
    gateway, url = start_gateway(address, "--migration-limit", "0", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1",
                                 name="ui-chat-gateway")
    try:
        page = open_chat(browser, url, bundle, "failing-chat", settings={"max_tokens": 400})
        send(page, "Tell me everything.")
        wait_partial(page, 20)
        engine.signal_group(signal.SIGKILL)
        state = wait_settled(page)
        assert state["status"] == "error"
        assert "unavailable" in (state["error"] or "").lower(), state["error"]
        assert page.inner_text("#error")
        page.context.close()
    finally:
        gateway.stop()
        engine.stop()


@pytest.mark.browser
@pytest.mark.parametrize("killed", [False, True], ids=["alive", "killed"])
def test_a_reload_resumes_on_another_replica_through_redis(
        browser: Browser, bundle: Path, ipc_dir: Path, tmp_path: Path, killed: bool) -> None:
    """The page on replica A is closed mid-answer and opened on B, which resumes the answer; ``killed``: A is
    killed with SIGKILL first, B adopts the answer and continues it (docs/failures.md)."""
    require("redis-server")
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    address = f"ipc://{ipc_dir / 'ui-chat-replicas.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "40", name="ui-chat-engine")
    procs: list[Proc] = [engine]
    try:
        broker = ("--broker", f"redis://127.0.0.1:{redis_port}/0", "--broker-lease-interval", "0.2",
                  "--broker-lease-ttl", "0.8")
        a, url_a = start_gateway(address, *broker, name="ui-chat-replica-a")
        b, url_b = start_gateway(address, *broker, name="ui-chat-replica-b")
        procs += [a, b]
        settings = {"max_tokens": 160}
        question = "Tell me about rivers."
        control = control_text(browser, url_a, bundle, question, settings)
        page = open_chat(browser, url_a, bundle, "replica-chat", resume=True, settings=settings)
        send(page, question)
        wait_partial(page, 40)
        page.context.close()  # the page is gone; the answer runs on in replica A
        if killed:
            a.signal_group(signal.SIGKILL)  # and A is gone too: B adopts the answer
        page = open_chat(browser, url_b, bundle, "replica-chat", resume=True, settings=settings)  # and B resumes it
        state = wait_settled(page)
        assert state["status"] == "ready", state["error"]
        assert answer(state) == control
        assert metric(url_b, "tokenfan_requests_total", {"endpoint": "/api/chat/{id}/stream", "status": "200"}) == 1
        assert metric(url_b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == killed
        wait_until(lambda: httpx.get(url_b + "/api/chat/replica-chat/stream").status_code == 204, timeout=10,
                   what="replica B learns the answer ended")
        page.context.close()
    finally:
        stop_all(procs)
        redis.kill()
        redis.wait()


# -- the SDK's readUIMessageStream in Node ----------------------------------------------------------------


def test_read_ui_message_stream_in_node_assembles_the_answer(gateway_url: str, ui_node_dir: Path) -> None:
    out = run_node(ui_node_dir / "read_stream.mjs", gateway_url, "node-chat", json.dumps({"max_tokens": 12}),
                   "Hello from Node")
    control = httpx.post(gateway_url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "Hello from Node"}], "max_tokens": 12}).json()
    message = out["message"]
    assert out["errors"] == []
    assert message["role"] == "assistant" and message["id"].startswith("msg-")
    assert message["parts"] == [{"type": "step-start"},
                                {"type": "text", "text": control["choices"][0]["message"]["content"],
                                 "state": "done"}]
    chunks = out["chunks"]
    assert chunks[:3] == ["start", "start-step", "text-start"] and chunks[-3:] == ["text-end", "finish-step", "finish"]
    assert out["snapshots"] > 3
    assert run_node(ui_node_dir / "read_stream.mjs", gateway_url, "node-chat", "{}", "-") == {"resumed": False}


# -- vLLM's tiny model (random weights; the session's parser gateway) -------------------------------------

TINY = {"max_tokens": 24, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
FORCED_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}</tool_call>'


@pytest.mark.vllm
@pytest.mark.browser
def test_tiny_model_text_streams_and_equals_chat_completions(browser: Browser, parser_gateway: str,
                                                             bundle: Path) -> None:
    question = "Write a line about rivers."
    control = httpx.post(parser_gateway + "/v1/chat/completions", timeout=120, json={
        **TINY, "messages": [{"role": "user", "content": question}]}).json()["choices"][0]["message"]["content"]
    page = open_chat(browser, parser_gateway, bundle, "tiny-chat", settings=TINY)
    send(page, question)
    state = wait_settled(page)
    assert state["status"] == "ready", state["error"]
    assert control and answer(state) == control  # greedy: the same text as chat completions
    page.context.close()


@pytest.mark.vllm
@pytest.mark.browser
def test_tiny_model_tool_loop_runs_the_tool_and_sends_the_next_turn(browser: Browser, parser_gateway: str,
                                                                     bundle: Path) -> None:
    """The call is forced by a ``structured_outputs`` regex (random weights); the next turn is free text."""
    settings = {**TINY, "max_tokens": 120, "tools": [WEATHER_TOOL], "tool_choice": "auto",
                "structured_outputs": {"regex": FORCED_CALL}, "after_tool": {**TINY, "tools": [WEATHER_TOOL]}}
    page = open_chat(browser, parser_gateway, bundle, "tiny-tool-chat", settings=settings)
    send(page, "What is the weather in Paris?")
    page.wait_for_function("window.toolCalls.length === 1 && window.chatState.status !== 'submitted' && "
                           "window.chatState.messages[window.chatState.messages.length - 1].parts"
                           ".filter((p) => p.type === 'step-start').length === 2 && "
                           "(window.chatState.status === 'ready' || window.chatState.status === 'error')")
    state = chat_state(page)
    assert state["status"] == "ready", state["error"]
    [call] = page.evaluate("window.toolCalls")
    assert call["name"] == "get_weather" and call["input"]["city"] in ("Paris", "Rome", "Oslo")
    assistant = state["messages"][-1]
    tool = next(p for p in assistant["parts"] if p["type"] == "tool-get_weather")
    assert tool["state"] == "output-available" and tool["output"] == {"city": call["input"]["city"], "celsius": 18}
    second = assistant["parts"][[p["type"] for p in assistant["parts"]].index("step-start", 1) + 1:]
    assert second and all(p["type"] == "text" for p in second), second  # the model's answer after the tool
    page.context.close()


@contextlib.contextmanager
def engine_stepped(page: Page, pid: int, chars: int) -> Iterator[str]:
    """vLLM's EngineCore stopped (SIGSTOP) and let run 10 ms at a time until the page shows ``chars`` characters
    of the answer; yields them with the engine stopped, so the answer is certainly still running inside the
    block, however fast the tiny model writes (400 tokens can end within a page's reload). The engine is let
    run again only once the page has shown what the last 10 ms wrote (its text unchanged for 2 s): a busy
    page that renders late must not let the engine run on to the answer's end (it did, beside a CPU hog,
    when every 50 ms of lag bought the engine another step). The engine worker and its heartbeats go on
    meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 120
        shown, changed = -1, time.monotonic()
        step_stopped(pid)
        while True:
            state = chat_state(page)
            last = state["messages"][-1] if state["messages"] else {"role": "user"}
            text = answer(state) if last["role"] == "assistant" else ""
            if state["status"] == "streaming" and len(text) >= chars:
                break
            assert time.monotonic() < deadline, state
            if len(text) != shown:
                shown, changed = len(text), time.monotonic()
            elif time.monotonic() - changed > 2.0:  # the page shows all the last step wrote
                step_stopped(pid)
                changed = time.monotonic()
            time.sleep(0.05)
        yield text
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.vllm
@pytest.mark.browser
def test_tiny_model_a_reload_resumes_the_answer_and_stop_aborts_it(browser: Browser, parser_gateway: str,
                                                                    vllm_boot: VllmBoot, bundle: Path) -> None:
    """On vLLM: a reload mid-answer resumes it (the text equals an uninterrupted greedy run), and Stop aborts
    the generation in the engine (the page keeps a proper prefix of that text). The engine is stepped to the
    middle of the answer and held there across the reload and the Stop (:func:`engine_stepped`)."""
    core = engine_core(vllm_boot.get("parser_gateway")[0])
    long = {**TINY, "max_tokens": 400, "ignore_eos": True}
    question = "Tell a long story about rivers."
    control = httpx.post(parser_gateway + "/v1/chat/completions", timeout=300, json={
        **long, "messages": [{"role": "user", "content": question}]}).json()["choices"][0]["message"]["content"]
    assert len(control) > 200, control
    page = open_chat(browser, parser_gateway, bundle, "tiny-reload-chat", resume=True, settings=long)
    send(page, question)
    with engine_stepped(page, core, 10) as before:
        page.reload()
        resumed = wait_partial(page, len(before))  # the log replayed: what the page had before, and streaming
    assert len(resumed) < len(control)
    state = wait_settled(page)
    assert state["status"] == "ready", state["error"]
    assert answer(state) == control
    page.context.close()

    page = open_chat(browser, parser_gateway, bundle, "tiny-stop-chat", resume=True, settings=long)
    send(page, question)
    with engine_stepped(page, core, 10):
        stopped = page.evaluate("window.stop()")
        assert stopped["cancelled"] is True, (stopped, chat_state(page), httpx.get(parser_gateway + "/health").json())
    wait_until(lambda: httpx.get(parser_gateway + "/health").json()["engine"]["running"] == 0, timeout=30,
               what="the engine runs nothing")
    state = wait_settled(page)
    assert state["status"] == "ready" and state["error"] is None
    assert control.startswith(answer(state)) and answer(state) != control
    page.context.close()
