"""Every example in README.md and docs/ runs as written: each fenced shell, Python and JavaScript block is
executed against a real gateway, or says, in an HTML comment just above it, why it is not run here.

Markers (one HTML comment on the line before the block, invisible on GitHub):

- ``<!-- example: not run here: REASON -->``: not run (a GPU, Kubernetes, a measurement of minutes …);
- ``<!-- example: continues -->``: a Python block that goes on from the page's previous Python block;
- ``<!-- example: serves -->``: a shell block that starts a server and keeps running: it passes when ``/health``
  on its port answers 200 while it still runs;
- ``<!-- example: tools -->``: runs against the suite's scripted engine, whose replies to a weather question
  are tool calls parsed by vLLM's own ``hermes`` parser (tests/scripted.py, docs/models.md), instead of the
  plain synthetic one.

How each runs: ``http://127.0.0.1:8000`` (and ``ws://``) become the shared gateway's address; shell blocks run
under ``bash -euo pipefail`` with ``.venv/bin`` first on ``PATH``, ``curl`` failing on an HTTP error, in a
scratch folder, ``TOKENFAN_PORT`` set to a free port for the servers they start (killed with their process
group at the end) and ``TOKENFAN_ENGINE=synthetic`` (a server that names no engine gets the synthetic one here:
booting the default model takes minutes); Python blocks run in a fresh interpreter; JavaScript with ``import``s runs in Node with the
SDKs of ``tests/node``; the other JavaScript (browser code) runs in headless Chromium on a page of the gateway's
own origin with an ``out`` element (its WebSocket and EventSource instrumented to record what they receive); a
React component (``jsx``) is bundled with esbuild and used in Chromium as a person would.

What each passes on: exit code 0 (or a live ``/health``) is not enough. :data:`PROMISES` holds, for every block
that runs, what its text promises, checked on what it printed or showed (a tool call is a tool call; a resumed
stream starts after the event it names; a server serves a generation); a block without a promise fails
:func:`test_every_run_example_has_its_promise`. The blocks not run here are pytest skips with their reason, and
their number is pinned (:data:`NOT_RUN`). The fan-out example is also run against a gateway with ``--api-key`` (a
page whose ``fetch`` sends the key, as an app's would): its WebSocket URL must work with the token in it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser

from tests.e2e.helpers import chunk_text
from tests.procs import NODE_DIR, ROOT, npm_ci, start_gateway
from tokenfan_bench.servers.processes import free_port

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!-- example: (.*?) -->\s*\n$")
RUNNABLE = {"bash", "sh", "python", "js", "jsx"}
UI_NODE_DIR = NODE_DIR / "ui_chat"  # React, the AI SDK's React hooks and esbuild, pinned in its lockfile
PAGE_PATH = "/docs-example/"  # where the browser gets a bundled React example, on the gateway's own origin
BASE = "http://127.0.0.1:8000"
# What the suite changes in an example so that it takes seconds (never what the example shows)
SHORTER = {"--duration 30": "--duration 1", "--streams 100": "--streams 20", "--max-tokens 100": "--max-tokens 20"}
KEY = "sk-docs"  # the --api-key of the keyed gateway the fan-out example also runs against


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    lang: str
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skipped(self) -> str | None:
        m = self.marker or ""
        return m.removeprefix("not run here:").strip() if m.startswith("not run here:") else None


def examples() -> list[Example]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m.group(1) not in RUNNABLE:
                continue
            before = text[:m.start()]
            marker = MARKER.search(before[-300:])
            out.append(Example(page, before.count("\n") + 1, m.group(1), m.group(2),
                               marker.group(1).strip() if marker else None))
    return out


EXAMPLES = examples()
RUN = [e for e in EXAMPLES if e.skipped is None]
NOT_RUN = 17  # blocks that say why they are not run here (a GPU, a model download, minutes of measurement, …)


def with_url(code: str, url: str) -> str:
    ws = url.replace("http://", "ws://")
    return code.replace(BASE, url).replace(BASE.replace("http://", "ws://"), ws)


@dataclass
class Output:
    """What a block printed or showed, for its promise."""

    text: str = ""  # stdout (shell: stdout and stderr)
    cwd: Path | None = None  # the scratch folder it ran in
    served: str | None = None  # "serves": the URL of the server it started, still running
    out: str = ""  # browser: the ``out`` element's text
    ws: list[dict] = field(default_factory=list)  # browser: the messages its WebSockets received
    es: list[str] = field(default_factory=list)  # browser: the ``data`` of the messages its EventSources received


# -- the rules ------------------------------------------------------------------------------------------------


def test_every_example_is_run_or_says_why_not() -> None:
    known = ("not run here:", "continues", "serves", "tools")
    bad = [f"{e.id}: {e.marker!r}" for e in EXAMPLES if e.marker and not e.marker.startswith(known)]
    assert not bad, "unknown example markers:\n" + "\n".join(bad)
    unexplained = [e.id for e in EXAMPLES if e.marker and e.marker.startswith("not run here:") and not e.skipped]
    assert not unexplained, f"a block not run here must say why: {unexplained}"
    skipped = [f"{e.id}: {e.skipped}" for e in EXAMPLES if e.skipped]
    assert len(skipped) == NOT_RUN, "the blocks not run here changed; pin their number:\n" + "\n".join(skipped)


def test_every_run_example_has_its_promise() -> None:
    """Each block that runs has exactly one entry in :data:`PROMISES`, and each entry names one block."""
    for e in RUN:
        found = [key for key in PROMISES if promise_matches(key, e)]
        assert len(found) == 1, f"{e.id}: {len(found)} promises ({found}); add what its text promises to PROMISES"
    for key in PROMISES:
        assert sum(promise_matches(key, e) for e in RUN) == 1, f"PROMISES {key} names no single runnable block"


def test_no_example_marker_is_left_without_its_block() -> None:
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^<!-- example: .*? -->", text, re.MULTILINE):
            assert text[m.end():].lstrip(" \n").startswith("```"), f"{page.name}: {m.group(0)} precedes no code block"


# -- the runners ----------------------------------------------------------------------------------------------


def run_python(e: Example, url: str, tmp: Path) -> Output:
    code = e.code
    if e.marker == "continues":
        previous = [x for x in EXAMPLES if x.page == e.page and x.lang == "python" and x.line < e.line]
        assert previous, f"{e.id} continues no Python block"
        code = previous[-1].code + "\n" + code
    script = tmp / "example.py"
    script.write_text(with_url(code, url))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp,
                          check=False)
    assert proc.returncode == 0, f"{e.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return Output(proc.stdout, tmp)


def _bash_env(port: int) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "TOKENFAN_PORT": str(port), "TOKENFAN_ENGINE": "synthetic", "HF_HUB_OFFLINE": "1",
            "TOKENFAN_LOG_LEVEL": "warning"}


PRELUDE = 'curl() { command curl --fail-with-body -sS "$@"; }\n'


def _page_json_before(e: Example) -> str:
    """The page's last ``json`` block above ``e`` (a script the block reads as ``script.json``)."""
    text = e.page.read_text()
    blocks = [m for m in BLOCK.finditer(text) if m.group(1) == "json" and text[:m.start()].count("\n") + 1 < e.line]
    assert blocks, f"{e.id} reads script.json but no json block precedes it"
    return blocks[-1].group(2)


def run_bash(e: Example, url: str, tmp: Path, check: Callable[[Output], None] = lambda o: None,
             model_dir: Path | None = None) -> Output:
    """Runs a shell block; a ``serves`` block's promise is checked while its server runs (``check``)."""
    code = e.code
    for long, short in SHORTER.items():
        code = code.replace(long, short)
    port = free_port()
    own = f"{'https' if '--ssl-certfile' in code else 'http'}://127.0.0.1:{port}"
    starts_server = re.search(r"^\s*(\.venv/bin/)?tokenfan (serve|gateway)\b", code, re.MULTILINE) is not None
    code = with_url(code, own if starts_server else url).replace(".venv/bin/", "").replace("--port 8000", f"--port {port}")
    code = code.replace("/run/tokenfan/", f"{tmp}/").replace("/tmp/tokenfan-demo/", f"{tmp}/")
    if model_dir is not None:
        code = code.replace("/tmp/tiny", str(model_dir))
    if "script.json" in code:
        (tmp / "script.json").write_text(_page_json_before(e))
    script = tmp / "example.sh"
    script.write_text(PRELUDE + code)
    log = tmp / "example.log"
    with log.open("w") as out:  # a file, not a pipe: a server the block leaves running keeps a pipe open
        proc = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=tmp, env=_bash_env(port),
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        if e.marker == "serves":
            _wait_health(own, proc, e, log)
            check(Output(log.read_text(), tmp, served=own))
            return Output(log.read_text(), tmp, served=own)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{e.id} still runs after 120 s:\n{log.read_text()[-4000:]}") from None
        assert proc.returncode == 0, f"{e.id} failed ({proc.returncode}):\n{log.read_text()[-4000:]}"
        result = Output(log.read_text(), tmp)
        check(result)
        return result
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)  # the block's servers too
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=20)
                time.sleep(0.5)  # its children get their SIGTERM handled
            except subprocess.TimeoutExpired:
                continue


def _wait_health(url: str, proc: subprocess.Popen[str], e: Example, log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{e.id} exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(url + "/health", timeout=2, verify=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{e.id}: {url}/health never answered 200")


def run_node(e: Example, url: str, tmp: Path) -> Output:
    npm_ci()
    script = NODE_DIR / f".docs-example-{os.getpid()}.mjs"  # beside node_modules, so its imports resolve
    script.write_text(with_url(e.code, url))
    try:
        proc = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "NODE_NO_WARNINGS": "1"})
    finally:
        script.unlink()
    assert proc.returncode == 0, f"{e.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return Output(proc.stdout, tmp)


def run_react(e: Example, url: str, browser: Browser, tmp: Path) -> Output:
    """A React component (``export default``): bundled with esbuild, mounted in a page served on the gateway's
    origin, then used as a person would: a weather question typed and sent; the page's text once the answer
    that follows the tool's result is on it, with no error logged."""
    npm_ci(UI_NODE_DIR)
    stem = f".docs-example-{os.getpid()}"
    component, entry = UI_NODE_DIR / f"{stem}.jsx", UI_NODE_DIR / f"{stem}-entry.jsx"
    component.write_text(with_url(e.code, url))
    entry.write_text(f'import Chat from "./{stem}.jsx";\nimport {{ createRoot }} from "react-dom/client";\n'
                     'createRoot(document.getElementById("root")).render(<Chat />);\n')
    build = ('import { build } from "esbuild"; await build({ entryPoints: [process.argv[1]], bundle: true, '
             'format: "esm", jsx: "automatic", outfile: process.argv[2], logLevel: "error", '
             'define: { "process.env.NODE_ENV": \'"production"\' } });')
    try:
        proc = subprocess.run(["node", "--input-type=module", "-e", build, str(entry), str(tmp / "page.js")],
                              cwd=UI_NODE_DIR, capture_output=True, text=True, timeout=120, check=False)
    finally:
        component.unlink()
        entry.unlink()
    assert proc.returncode == 0, f"{e.id}: esbuild failed:\n{proc.stderr[-4000:]}"
    files = {"index.html": ((b'<!doctype html><meta charset="utf-8"><div id="root"></div>'
                            b'<script type="module" src="page.js"></script>'), "text/html"),
             "page.js": ((tmp / "page.js").read_bytes(), "text/javascript")}
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text)
            if m.type == "error" and not m.location.get("url", "").endswith("/favicon.ico") else None)
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.route(f"{url}{PAGE_PATH}**", lambda route: route.fulfill(
        status=200, body=files[route.request.url.rsplit("/", 1)[1].split("?")[0] or "index.html"][0],
        content_type=files[route.request.url.rsplit("/", 1)[1].split("?")[0] or "index.html"][1]))
    try:
        page.goto(f"{url}{PAGE_PATH}index.html")
        page.fill("input", "What is the weather in Paris?")
        page.press("input", "Enter")
        page.wait_for_function("() => document.body.innerText.includes('18 C')", timeout=30_000)
        assert not problems, f"{e.id}: {problems}"
        return Output(out=page.inner_text("body"))
    finally:
        page.close()


# The page's WebSocket and EventSource, recording what they receive (the example's own objects are local to it)
RECORDERS = """() => {
  window.__ws = []; window.__es = [];
  const WS = window.WebSocket, ES = window.EventSource;
  window.WebSocket = class extends WS { constructor(...a) { super(...a);
    this.addEventListener("message", (e) => window.__ws.push(JSON.parse(e.data))); } };
  window.EventSource = class extends ES { constructor(...a) { super(...a);
    this.addEventListener("message", (e) => window.__es.push(e.data)); } };
}"""
# A page whose own fetch sends the API key, as an app's would (the keyed gateway's variant)
KEYED_FETCH = """(key) => { const f = window.fetch.bind(window);
  window.fetch = (u, o = {}) => f(u, {...o, headers: {...(o.headers || {}), Authorization: `Bearer ${key}`}}); }"""
# Done: some text arrived, every WebSocket that got messages got its `done`, every EventSource its [DONE]
SETTLED = """() => document.getElementById('out').textContent.length > 20
  && (window.__ws.length === 0 || window.__ws.some((m) => m.type === "done" || m.type === "error"))
  && (window.__es.length === 0 || window.__es.includes("[DONE]"))"""


def run_browser(e: Example, url: str, browser: Browser, key: str | None = None) -> Output:
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text)
            if m.type == "error" and not m.location.get("url", "").endswith("/favicon.ico") else None)
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    try:
        page.goto(url + "/v1/time")  # any page of the gateway's origin: relative URLs reach it
        page.evaluate("() => { document.body.innerHTML = '<pre id=out></pre>'; }")
        page.evaluate(RECORDERS)
        if key is not None:
            page.evaluate(KEYED_FETCH, key)
        page.evaluate(f"async () => {{ const out = document.getElementById('out');\n{with_url(e.code, url)}\n}}")
        page.wait_for_function(SETTLED, timeout=20_000)
        page.wait_for_timeout(200)
        assert not problems, f"{e.id}: {problems}"
        return Output(out=page.inner_text("#out"), ws=page.evaluate("() => window.__ws"),
                      es=page.evaluate("() => window.__es"))
    finally:
        page.close()


# -- what each block promises ---------------------------------------------------------------------------------


def _sse_chunks(text: str) -> list[dict]:
    """The JSON chunks of an SSE body a block printed; its last ``data:`` is ``[DONE]``."""
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", f"no [DONE] at the end: {text[-500:]}"
    return [json.loads(d) for d in data[:-1]]


def streamed_chat_with_usage(o: Output) -> None:
    chunks = _sse_chunks(o.text)
    assert "".join(chunk_text(c) for c in chunks).strip(), "no content streamed"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0, chunks[-1]


def printed_words(o: Output) -> None:
    assert len(o.text.split()) >= 3, f"expected the generated text, got {o.text!r}"


def chunks_then_usage_then_text(o: Output) -> None:
    lines = o.text.splitlines()
    usage = [i for i, line in enumerate(lines) if line.startswith("CompletionUsage(completion_tokens=")]
    assert len(usage) == 1 and usage[0] > 0, f"streamed deltas, then the usage: {o.text[-800:]}"
    assert "".join(lines[usage[0] + 1:]).strip(), "then the completion's text"


def ws_mux_answer(o: Output) -> None:
    chunks = [m for m in o.ws if m.get("type") == "chunk" and m.get("id") == "q1"]
    assert chunks and {"type": "done", "id": "q1"}.items() <= next(
        (m for m in o.ws if m.get("type") == "done"), {}).items(), o.ws[-3:]
    assert o.out == "".join(chunk_text(m["data"]) for m in chunks) and o.out.strip(), o.out


def fan_out_on_both_transports(o: Output) -> None:
    """EventSource reads the stream to [DONE]; the WebSocket (``after=-1``) reads the same tokens, every ``seq``
    from the first."""
    assert o.es and o.es[-1] == "[DONE]", o.es[-3:]
    es_text = "".join(chunk_text(json.loads(d)) for d in o.es[:-1])
    assert o.out == es_text and es_text.strip(), (o.out, es_text)
    chunks = [m for m in o.ws if m["type"] == "chunk"]
    assert o.ws and o.ws[-1]["type"] == "done", o.ws[-3:]
    assert [m["seq"] for m in chunks] == list(range(len(chunks))), [m["seq"] for m in chunks]
    assert "".join(chunk_text(m["data"]) for m in chunks) == es_text


def _resumed_seqs(text: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^(\d+) response\.[a-z_.]+$", text, re.MULTILINE)]


def responses_resume_after_3(o: Output) -> None:
    """The haiku streams, then the background response's events from ``sequence_number`` 4 on, in order."""
    seqs = _resumed_seqs(o.text)
    assert seqs and seqs[0] == 4 and seqs == list(range(4, 4 + len(seqs))), seqs
    assert o.text[:o.text.index("\n4 response.")].strip(), "the haiku's text comes first"


def tool_call_then_answer(o: Output) -> None:
    lines = o.text.splitlines()
    assert 'get_weather {"city": "Paris"}' in lines, f"no get_weather call printed: {o.text!r}"
    assert lines[-1] == "It is 18 C in Paris.", f"the answer after the tool's result: {o.text!r}"


def ai_sdk_tool_then_object(o: Output) -> None:
    assert o.text.startswith("It is 18 C in Paris."), f"the answer after the tool ran: {o.text!r}"
    assert o.text.rstrip().endswith("{ answer: 'yes' }"), f"the structured object: {o.text!r}"


def responses_tools(o: Output) -> None:
    responses_resume_after_3(o)
    assert o.text.rstrip().endswith("It is 18 C in Paris."), f"the answer after the function's output: {o.text!r}"


def responses_ws_tool_loop(o: Output) -> None:
    assert '{"city": "Paris"}It is 18 C in Paris.' in o.text, f"the call's arguments, then the answer: {o.text!r}"


def bench_summary(o: Output) -> None:
    assert "This run had errors" not in o.text, o.text[-2000:]
    assert o.cwd is not None and (o.cwd / "DIR" / "results.json").is_file(), sorted((o.cwd or Path()).iterdir())
    results = json.loads((o.cwd / "DIR" / "results.json").read_text())
    assert {"sse", "ws"} <= set(json.dumps(results).replace('"', " ").split()), "both arms measured"


def tiny_model_made(o: Output) -> None:
    made = {p.name for p in (o.cwd or Path()).joinpath("tiny-llama").iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= made, made


def serves_a_generation(o: Output) -> None:
    """The server the block started answers a chat completion (the synthetic engine under this suite)."""
    assert o.served is not None
    r = httpx.post(o.served + "/v1/chat/completions", verify=False, timeout=30,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] in ("length", "stop"), choice


def serves_synthetic(o: Output) -> None:
    serves_a_generation(o)
    assert httpx.get(f"{o.served}/v1/models", timeout=10).json()["data"][0]["id"] == "synthetic"


def serves_the_script(o: Output) -> None:
    """The script's weather reply becomes a tool call through vLLM's hermes parser, its reasoning a reasoning field."""
    assert o.served is not None
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = httpx.post(o.served + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": tools})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})], message
    assert message.get("reasoning") == "Use the tool." or message.get("reasoning_content") == "Use the tool.", message
    r = httpx.post(o.served + "/v1/chat/completions", timeout=30, json={"tools": tools, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"}, message,
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18 C"}]})
    assert r.json()["choices"][0]["message"]["content"] == "It is 18 C in Paris.", r.text


def react_tool_round(o: Output) -> None:
    assert "tool-get_weather output-available" in o.out and "18 C" in o.out, o.out


# (page, a line of the block) -> what it promises
PROMISES: dict[tuple[str, str], Callable[[Output], None]] = {
    ("README.md", "tokenfan serve --engine synthetic   "): serves_synthetic,
    ("README.md", "tokenfan engine --engine-address ipc:///tmp/tokenfan-demo/engine.sock &"): serves_a_generation,
    ("README.md", "curl -N http://127.0.0.1:8000/v1/chat/completions"): streamed_chat_with_usage,
    ("README.md", 'prompt="Once upon a time", max_tokens=32).choices[0].text)'): printed_words,
    ("README.md", 'new WebSocket("ws://127.0.0.1:8000/v1/ws")'): ws_mux_answer,
    ("README.md", 'fetch("/v1/streams"'): fan_out_on_both_transports,
    ("README.md", "starting_after=3"): responses_resume_after_3,
    ("ai-sdk.md", "useChat"): react_tool_round,
    ("api.md", "curl -N http://127.0.0.1:8000/v1/chat/completions"): streamed_chat_with_usage,
    ("api.md", 'stream_options={"include_usage": True}'): chunks_then_usage_then_text,
    ("api.md", "tool_calls.function.arguments.done"): tool_call_then_answer,
    ("api.md", "createOpenAICompatible"): ai_sdk_tool_then_object,
    ("api.md", 'new WebSocket("ws://127.0.0.1:8000/v1/ws")'): ws_mux_answer,
    ("api.md", 'fetch("/v1/streams"'): fan_out_on_both_transports,
    ("api.md", "client.responses.cancel(bg.id)"): responses_tools,
    ("api.md", "ResponsesWS"): responses_ws_tool_loop,
    ("benchmarks.md", "--arms sse,ws"): bench_summary,
    ("limits.md", "tokenfan serve --max-generations-per-client 0"): serves_a_generation,
    ("models.md", "prepare-model tiny"): tiny_model_made,
    ("models.md", "--synthetic-script script.json"): serves_the_script,
    ("tls.md", "tokenfan certs ./tls"): serves_a_generation,
    ("observability.md", "--otlp-traces-endpoint"): serves_a_generation,  # (no receiver here: serving goes on)
}


def promise_matches(key: tuple[str, str], e: Example) -> bool:
    return e.page.name == key[0] and key[1] in e.code


def promise_of(e: Example) -> Callable[[Output], None]:
    return next(check for key, check in PROMISES.items() if promise_matches(key, e))


def _params() -> list[Any]:
    out = []
    for e in EXAMPLES:
        marks = [pytest.mark.skip(reason=f"not run here: {e.skipped}")] if e.skipped else []
        out.append(pytest.param(e, None, id=e.id, marks=marks))
        if "ws_url" in e.code and not e.skipped:
            out.append(pytest.param(e, KEY, id=f"{e.id}[--api-key]"))
    return out


@pytest.fixture(scope="module")
def keyed_gateway(synthetic_engine: str) -> Iterator[str]:
    proc, url = start_gateway(synthetic_engine, "--api-key", KEY, name="gateway-docs-keyed")
    yield url
    proc.stop()


@pytest.mark.parametrize("example, key", _params())
def test_the_example_keeps_its_promise(example: Example, key: str | None, request: pytest.FixtureRequest,
                                       tmp_path: Path) -> None:
    e, check = example, promise_of(example)
    if key is not None:
        url = request.getfixturevalue("keyed_gateway")
    else:
        url = request.getfixturevalue("scripted_gateway" if e.marker == "tools" else "gateway_url")
    if e.lang == "python":
        check(run_python(e, url, tmp_path))
    elif e.lang in ("bash", "sh"):
        model = request.getfixturevalue("tiny_model") if "/tmp/tiny" in e.code else None
        run_bash(e, url, tmp_path, check, model)
    elif e.lang == "jsx":
        check(run_react(e, url, request.getfixturevalue("browser"), tmp_path))
    elif re.search(r"^import ", e.code, re.MULTILINE):
        check(run_node(e, url, tmp_path))
    else:
        check(run_browser(e, url, request.getfixturevalue("browser"), key))


@pytest.mark.parametrize("lang, code", [
    ("python", 'from openai import OpenAI\nOpenAI(base_url="http://127.0.0.1:8000/v2", api_key="x").models.list()\n'),
    ("bash", "curl -N http://127.0.0.1:8000/v1/chat/completion -H 'Content-Type: application/json' -d '{}'\n"),
    ("js", ('import OpenAI from "openai";\nawait new OpenAI({ baseURL: "http://127.0.0.1:8000/v1", apiKey: "x" })'
           '.models.retrieve("no-such-model");\n')),
])
def test_a_broken_example_fails(lang: str, code: str, gateway_url: str, tmp_path: Path) -> None:
    """What the runners do with an example that no longer works: a wrong path, a wrong route, a wrong model."""
    e = Example(ROOT / "README.md", 1, lang, code, None)
    run = {"python": run_python, "bash": run_bash, "js": run_node}[lang]
    with pytest.raises(AssertionError, match="failed"):
        run(e, gateway_url, tmp_path)


def test_a_block_that_exits_0_without_its_promise_fails(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The tool-call example without its tools exits 0 (the call stays text) and fails its promise; so does the
    fan-out example as it was before its URL was built with ``searchParams`` (``ws_url + "?after=-1"``), with
    ``--api-key``: its WebSocket gets ``…?token=X?after=-1``."""
    tool = next(e for e in RUN if promise_matches(("api.md", "tool_calls.function.arguments.done"), e))
    broken = Example(tool.page, tool.line, tool.lang, tool.code.replace(", tools=tools)", ")"), tool.marker)
    out = run_python(broken, request.getfixturevalue("scripted_gateway"), tmp_path)
    with pytest.raises(AssertionError, match="no get_weather call"):
        tool_call_then_answer(out)
    fan = next(e for e in RUN if promise_matches(("api.md", 'fetch("/v1/streams"'), e))
    old = re.sub(r"const url = new URL\(ws_url\);.*?const ws = new WebSocket\(url\);",
                 'const ws = new WebSocket(ws_url + "?after=-1");', fan.code, flags=re.DOTALL)
    assert old != fan.code
    with pytest.raises(AssertionError):
        fan_out_on_both_transports(run_browser(Example(fan.page, fan.line, fan.lang, old, None),
                                               request.getfixturevalue("keyed_gateway"),
                                               request.getfixturevalue("browser"), KEY))
