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
own origin with an ``out`` element, and passes when the tokens arrive in ``out`` with no error logged; a React
component (``jsx``) is bundled with esbuild and used in Chromium as a person would.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser

from tests.procs import NODE_DIR, ROOT, npm_ci
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


def with_url(code: str, url: str) -> str:
    ws = url.replace("http://", "ws://")
    return code.replace(BASE, url).replace(BASE.replace("http://", "ws://"), ws)


# -- the rules ------------------------------------------------------------------------------------------------


def test_every_example_is_run_or_says_why_not() -> None:
    known = ("not run here:", "continues", "serves", "tools")
    bad = [f"{e.id}: {e.marker!r}" for e in EXAMPLES if e.marker and not e.marker.startswith(known)]
    assert not bad, "unknown example markers:\n" + "\n".join(bad)
    unexplained = [e.id for e in EXAMPLES if e.marker and e.marker.startswith("not run here:") and not e.skipped]
    assert not unexplained, f"a block not run here must say why: {unexplained}"
    assert len(RUN) >= 15, [e.id for e in RUN]


def test_no_example_marker_is_left_without_its_block() -> None:
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^<!-- example: .*? -->", text, re.MULTILINE):
            assert text[m.end():].lstrip(" \n").startswith("```"), f"{page.name}: {m.group(0)} precedes no code block"


# -- the runners ----------------------------------------------------------------------------------------------


def run_python(e: Example, url: str, tmp: Path) -> None:
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


def _bash_env(port: int) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "TOKENFAN_PORT": str(port), "TOKENFAN_ENGINE": "synthetic", "HF_HUB_OFFLINE": "1",
            "TOKENFAN_LOG_LEVEL": "warning"}


PRELUDE = 'curl() { command curl --fail-with-body -sS "$@"; }\n'


def run_bash(e: Example, url: str, tmp: Path) -> None:
    code = e.code
    for long, short in SHORTER.items():
        code = code.replace(long, short)
    port = free_port()
    own = f"{'https' if '--ssl-certfile' in code else 'http'}://127.0.0.1:{port}"
    starts_server = re.search(r"^\s*(\.venv/bin/)?tokenfan (serve|gateway)\b", code, re.MULTILINE) is not None
    code = with_url(code, own if starts_server else url).replace(".venv/bin/", "").replace("--port 8000", f"--port {port}")
    code = code.replace("/run/tokenfan/", f"{tmp}/")
    script = tmp / "example.sh"
    script.write_text(PRELUDE + code)
    log = tmp / "example.log"
    with log.open("w") as out:  # a file, not a pipe: a server the block leaves running keeps a pipe open
        proc = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=tmp, env=_bash_env(port),
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        if e.marker == "serves":
            _wait_health(own, proc, e, log)
        else:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{e.id} still runs after 120 s:\n{log.read_text()[-4000:]}") from None
            assert proc.returncode == 0, f"{e.id} failed ({proc.returncode}):\n{log.read_text()[-4000:]}"
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


def run_node(e: Example, url: str, tmp: Path) -> None:
    npm_ci()
    script = NODE_DIR / f".docs-example-{os.getpid()}.mjs"  # beside node_modules, so its imports resolve
    script.write_text(with_url(e.code, url))
    try:
        proc = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "NODE_NO_WARNINGS": "1"})
    finally:
        script.unlink()
    assert proc.returncode == 0, f"{e.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def run_react(e: Example, url: str, browser: Browser, tmp: Path) -> None:
    """A React component (``export default``): bundled with esbuild, mounted in a page served on the gateway's
    origin, then used as a person would: a weather question typed and sent; passes when the answer that
    follows the tool's result is on the page, with no error logged."""
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
        assert "tool-get_weather output-available" in page.inner_text("body"), page.inner_text("body")
        assert not problems, f"{e.id}: {problems}"
    finally:
        page.close()


def run_browser(e: Example, url: str, browser: Browser) -> None:
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text)
            if m.type == "error" and not m.location.get("url", "").endswith("/favicon.ico") else None)
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    try:
        page.goto(url + "/v1/time")  # any page of the gateway's origin: relative URLs reach it
        page.evaluate("() => { document.body.innerHTML = '<pre id=out></pre>'; }")
        page.evaluate(f"async () => {{ const out = document.getElementById('out');\n{with_url(e.code, url)}\n}}")
        page.wait_for_function("() => document.getElementById('out').textContent.length > 20", timeout=20_000)
        page.wait_for_timeout(200)
        assert not problems, f"{e.id}: {problems}"
    finally:
        page.close()


@pytest.mark.parametrize("example", RUN, ids=[e.id for e in RUN])
def test_the_example_runs(example: Example, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    e = example
    url: str = request.getfixturevalue("scripted_gateway" if e.marker == "tools" else "gateway_url")
    if e.lang == "python":
        run_python(e, url, tmp_path)
    elif e.lang in ("bash", "sh"):
        run_bash(e, url, tmp_path)
    elif e.lang == "jsx":
        run_react(e, url, request.getfixturevalue("browser"), tmp_path)
    elif re.search(r"^import ", e.code, re.MULTILINE):
        run_node(e, url, tmp_path)
    else:
        run_browser(e, url, request.getfixturevalue("browser"))


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
