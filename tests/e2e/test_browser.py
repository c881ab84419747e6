"""The browser pages (``/`` chat, ``/ab`` A/B) in headless Chromium against real gateways.

Uses Debian's ``/usr/bin/chromium`` (``make browser`` installs it); Playwright's own browser
download is never used. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from playwright.sync_api import Browser, Page, Request, Route

from tests.e2e.browser_fixtures import (
    CHROMIUM,
    ConsoleLog,
    CuttableProxy,
    aborted_total,
    full_stream_text,
    start_gateway_without_engine,
)
from tests.procs import ARTIFACTS, start_engine, start_gateway
from tests.system import require

pytestmark = pytest.mark.browser


@pytest.fixture(autouse=True, scope="module")
def _chromium_installed() -> None:
    require(CHROMIUM)


TRANSPORTS = ["sse", "fetch", "ws", "responses-sse", "responses-ws"]
API_KEY = "sk-browser-test"
ANSWER = ".msg.assistant"


@pytest.fixture
def console() -> ConsoleLog:
    return ConsoleLog()


@pytest.fixture
def page(browser: Browser, console: ConsoleLog) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1100, "height": 820}, accept_downloads=True)
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    console.attach(pg)
    yield pg
    context.close()


@pytest.fixture(scope="module")
def slow_gateway_url(ipc_dir: Path) -> Iterator[str]:
    """A gateway on its own synthetic engine at 20 tokens/s: answers last long enough to stop or cut."""
    address = f"ipc://{ipc_dir / 'browser-slow.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                          "--synthetic-tokens-per-s", "20", name="engine-browser-slow")
    try:
        gw, url = start_gateway(address, name="gateway-browser-slow")
    except BaseException:
        engine.stop()
        raise
    yield url
    gw.stop()
    engine.stop()


@pytest.fixture(scope="module")
def engineless_gateway_url(ipc_dir: Path) -> Iterator[str]:
    proc, url = start_gateway_without_engine(f"ipc://{ipc_dir / 'browser-nobody-home.sock'}")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def keyed_gateway_url(synthetic_engine: str) -> Iterator[str]:
    """A gateway on the shared synthetic engine that requires an API key."""
    proc, url = start_gateway(synthetic_engine, "--api-key", API_KEY, name="gateway-browser-keyed")
    yield url
    proc.stop()


def shot(page: Page, name: str, full_page: bool = False) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=full_page)


def ask(page: Page, text: str = "Tell me about streaming.", max_tokens: int | None = None) -> None:
    if max_tokens is not None:
        page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_answer_settled(page: Page, timeout: float = 15_000) -> str:
    page.wait_for_function(
        "s => { const m = [...document.querySelectorAll(s)].pop();"
        " return m && ['done', 'stopped', 'error'].includes(m.dataset.state); }",
        arg=ANSWER, timeout=timeout)
    return page.locator(ANSWER).last.get_attribute("data-state") or ""


def answer_text(page: Page) -> str:
    return page.locator(f"{ANSWER} .text").last.text_content() or ""


# -- loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, name", [("/", "chat"), ("/ab", "ab")])
def test_page_loads_without_console_errors_at_wide_and_narrow_widths(
    page: Page, console: ConsoleLog, gateway_url: str, path: str, name: str,
) -> None:
    page.goto(gateway_url + path)
    page.wait_for_function("document.querySelector('#model').textContent === 'synthetic'")
    if name == "ab":
        page.wait_for_function("!/measuring/.test(document.querySelector('#clock').textContent)")
        assert "±" in (page.text_content("#clock") or "")
    page.set_viewport_size({"width": 390, "height": 820})
    page.wait_for_timeout(100)
    no_overflow = page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    shot(page, f"{name}-narrow.png", full_page=True)
    assert no_overflow, f"{path} scrolls sideways at 390 px"
    assert page.is_hidden("#banner")
    assert console.errors == []


# -- chat over each transport -------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_chat_answer_streams_token_by_token_over_each_transport(
    page: Page, console: ConsoleLog, gateway_url: str, transport: str,
) -> None:
    page.goto(f"{gateway_url}/?transport={transport}")
    page.wait_for_function("document.querySelector('#model').textContent === 'synthetic'")
    # Sample the answer's length from inside the page, every few ms, to see it grow.
    page.evaluate("""() => { window.__lens = []; window.__sampler = setInterval(() => {
        const t = [...document.querySelectorAll('.msg.assistant .text')].pop();
        window.__lens.push(t ? t.textContent.length : 0); }, 4); }""")
    ask(page, max_tokens=120)
    assert wait_answer_settled(page) == "done"
    lens = page.evaluate("() => { clearInterval(window.__sampler); return window.__lens; }")
    text = answer_text(page)
    growing = sorted({n for n in lens if 0 < n < len(text)})
    assert text.strip(), "empty answer"
    assert len(growing) >= 3, f"text did not appear progressively (lengths seen: {growing})"
    answer = page.locator(ANSWER).last
    assert answer.get_attribute("data-transport") == transport
    assert float(answer.locator('[data-metric="ttft"]').text_content() or "nan") >= 0
    assert float(answer.locator('[data-metric="tps"]').text_content() or "nan") > 0
    assert int(answer.locator('[data-metric="tokens"]').text_content() or "0") == 120
    shot(page, f"chat-{transport}.png")
    assert console.errors == []


def test_chat_keeps_the_conversation_and_shift_enter_adds_a_newline(page: Page, gateway_url: str) -> None:
    page.goto(f"{gateway_url}/?transport=fetch")
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    page.fill("#max-tokens", "8")
    page.press("#prompt", "Enter")
    assert wait_answer_settled(page) == "done"
    ask(page, "and again")
    page.wait_for_function("document.querySelectorAll('.msg.assistant').length === 2")
    assert wait_answer_settled(page) == "done"
    assert page.locator(".msg.user .text").first.text_content() == "first line\nsecond line"
    assert page.evaluate("document.activeElement.id") == "prompt"


def test_chat_renders_model_output_as_text_not_html(page: Page, gateway_url: str) -> None:
    page.goto(f"{gateway_url}/?transport=fetch")
    evil = '<img src=x onerror="window.__pwned=1">'
    chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": evil}}]})
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=f"data: {chunk}\n\ndata: [DONE]\n\n"))
    ask(page)
    assert wait_answer_settled(page) == "done"
    assert answer_text(page) == evil
    assert page.locator(f"{ANSWER} img").count() == 0
    assert page.evaluate("window.__pwned === undefined")


# -- stop -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport, how", [("sse", "button"), ("fetch", "escape"), ("ws", "button")])
def test_stop_aborts_the_generation_in_the_engine(
    page: Page, console: ConsoleLog, slow_gateway_url: str, transport: str, how: str,
) -> None:
    before = aborted_total(slow_gateway_url)
    page.goto(f"{slow_gateway_url}/?transport={transport}")
    ask(page, max_tokens=400)  # 20 s at 20 tokens/s
    page.wait_for_function("s => ([...document.querySelectorAll(s)].pop()?.textContent.length ?? 0) > 10",
                           arg=f"{ANSWER} .text")
    if how == "escape":
        page.keyboard.press("Escape")
    else:
        page.click("#stop")
    assert wait_answer_settled(page, timeout=5_000) == "stopped"
    stopped_at = answer_text(page)
    if transport == "sse":
        stream_id = page.evaluate("window.__tokenfan.streamId")
        status = httpx.get(f"{slow_gateway_url}/v1/streams/{stream_id}", timeout=5).json()
        assert status["state"] == "cancelled"
    deadline = time.monotonic() + 5
    while aborted_total(slow_gateway_url) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted_total(slow_gateway_url) > before, "the engine request was not aborted"
    page.wait_for_timeout(300)
    assert answer_text(page) == stopped_at, "text kept growing after Stop"
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    shot(page, f"chat-stopped-{transport}.png")
    assert console.errors == []


# -- A/B --------------------------------------------------------------------------------------------


def ab_post_bodies(page: Page) -> list[dict[str, Any]]:
    """Collects the JSON body of every ``POST /v1/streams`` the page sends, in order."""
    bodies: list[dict[str, Any]] = []

    def on_request(req: Request) -> None:
        if req.method == "POST" and req.url.endswith("/v1/streams"):
            bodies.append(json.loads(req.post_data or "{}"))

    page.on("request", on_request)
    return bodies


def test_ab_run_reads_each_api_from_a_stream_of_its_own_and_exports_bench_json(
    page: Page, console: ConsoleLog, gateway_url: str,
) -> None:
    bodies = ab_post_bodies(page)
    page.goto(gateway_url + "/ab")
    page.fill("#runs", "3")
    page.fill("#max-tokens", "48")
    page.fill("#temperature", "0.7")
    page.fill("#seed", "7")
    page.click("#start")
    page.wait_for_function("window.__tokenfan.result !== null", timeout=20_000)

    # Two streams per run, from the same request, one read by each API; who goes first alternates.
    assert len(bodies) == 6 and all(b == bodies[0] for b in bodies), bodies
    assert bodies[0]["seed"] == 7 and bodies[0]["temperature"] == 0.7 and bodies[0]["max_tokens"] == 48
    streams = page.evaluate("window.__tokenfan.streams")
    assert [(s["run"], s["arm"], s["api"]) for s in streams] == [
        (0, "A", "es"), (0, "B", "ws"), (1, "B", "ws"), (1, "A", "es"), (2, "A", "es"), (2, "B", "ws")]
    assert len({s["id"] for s in streams}) == 6

    # Each pane shows the whole text of its own stream (the last run's), read back from the gateway.
    last = {s["arm"]: s["id"] for s in streams if s["run"] == 2}
    for arm in "AB":
        assert page.get_attribute(f"#pane-{arm}", "data-stream") == last[arm]
        assert page.text_content(f"#pane-{arm} .text") == full_stream_text(gateway_url, last[arm])
    assert page.get_attribute("#verdict", "data-identical") == "true"  # same seed: same text
    assert "✓" in (page.text_content("#verdict") or "")
    for arm in "AB":
        cells = page.locator(f'#summary tr[data-arm="{arm}"] td').all_text_contents()
        assert cells[0] == "3" and int(cells[1]) > 0 and all(c not in ("", "–") for c in cells), cells
        assert cells[-1] == "0"
    for cell in ("#diff", "#ttft-diff"):
        assert "95% CI" in (page.text_content(cell) or "") and "unpaired" in (page.text_content(cell) or "")

    with page.expect_download() as dl:
        page.click("#export")
    result = json.loads(Path(dl.value.path()).read_text())
    assert result["streams"] == 6 and result["runs"] == 3 and result["separate_streams"] is True
    assert result["arms"]["A"]["transport"] == "sse" and result["arms"]["B"]["transport"] == "ws"
    for arm in result["arms"].values():
        for metric in ("delivery_ms", "ttft_ms", "itl_ms", "e2e_ms", "engine_to_gateway_ms", "gateway_to_client_ms"):
            assert set(arm[metric]) == {"n", "mean", "p50", "p90", "p99", "p99.9"}, metric
        assert 0 < arm["live_content_events"] == arm["delivery_ms"]["n"] <= arm["content_events"]
        assert arm["ttft_ms"]["n"] == 3 and arm["errors"] == 0 and arm["subscribers"] == 3
        assert 0 <= arm["delivery_ms"]["p50"] < 1000
    for diff in (result["diff_ms"], result["ttft_diff_ms"]):
        assert diff["paired"] is False and "unpaired" in diff["method"] and diff["n"] > 0
        assert diff["ci95"][0] <= diff["median"] <= diff["ci95"][1]
    assert [run["order"] for run in result["meta"]["per_run"]] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert result["meta"]["texts_identical"] is True and result["meta"]["request"]["seed"] == 7
    assert abs(result["meta"]["clock"]["offset_ms"]) < 50  # same machine

    # Every stream's per-token records, and which API read it: each text is its stream's whole text.
    records = result["records"]
    assert result["row_fields"] == ["seq", "emit_ns", "sent_ns", "recv_ms", "deltas", "content"]
    assert sorted((r["run"], r["key"], r["api"]) for r in records) == sorted(
        (s["run"], s["arm"], s["api"]) for s in streams)
    for r in records:
        assert r["stream_id"] == next(s["id"] for s in streams if (s["run"], s["arm"]) == (r["run"], r["key"]))
        assert r["reason"] == "done" and r["error"] is None and r["rows"]
        assert r["text"] == full_stream_text(gateway_url, r["stream_id"])

    # The bench's own statistics on the exported records give the page's figures.
    from tokenfan_bench.clients.browser import samples
    from tokenfan_bench.report.run_outputs import summary_md
    from tokenfan_bench.stats.ab_difference import median_difference
    from tokenfan_bench.stats.metrics import arm_metrics

    offset = result["meta"]["clock"]["offset_ms"]
    bench = {k: samples(records, i, t, offset) for i, (k, t) in enumerate((("A", "sse"), ("B", "ws")))}
    for k, a in bench.items():
        m = arm_metrics(a, result["wall_s"])
        assert m["live_content_events"] == result["arms"][k]["live_content_events"]
        for metric in ("delivery_ms", "ttft_ms"):
            assert m[metric]["p50"] == pytest.approx(result["arms"][k][metric]["p50"], abs=1e-3), (k, metric)
    d = median_difference(bench["A"], bench["B"], paired=False, n_boot=10)
    assert d["median"] == pytest.approx(result["diff_ms"]["median"], abs=1e-3)
    md = summary_md(result)
    assert "median delivery latency B - A" in md and "separate streams per arm" in md
    shot(page, "ab.png", full_page=True)
    assert console.errors == []


def test_ab_shows_plainly_when_the_two_streams_texts_differ(page: Page, console: ConsoleLog, gateway_url: str) -> None:
    # The synthetic engine's text depends on the prompt and seed only; give B's streams a seed of their own, as
    # sampling at temperature > 0 without a seed would give them a text of their own.
    posts: list[Request] = []

    def seed_b(route: Route) -> None:
        if route.request.method != "POST":
            return route.continue_()
        posts.append(route.request)
        body = json.loads(route.request.post_data or "{}")
        route.continue_(post_data=json.dumps({**body, "seed": 99}) if len(posts) == 2 else None)  # run 1: A, B

    page.route("**/v1/streams", seed_b)
    page.goto(gateway_url + "/ab")
    page.fill("#runs", "1")
    page.fill("#max-tokens", "16")
    page.fill("#temperature", "1")
    page.click("#start")
    page.wait_for_function("window.__tokenfan.result !== null", timeout=20_000)
    text_a, text_b = page.text_content("#pane-A .text"), page.text_content("#pane-B .text")
    assert text_a and text_b and text_a != text_b
    assert page.get_attribute("#verdict", "data-identical") == "false"
    verdict = page.text_content("#verdict") or ""
    assert "differ in 1 of 1 runs" in verdict and "without a seed" in verdict, verdict
    assert page.evaluate("window.__tokenfan.result.meta.per_run[0].identical") is False
    shot(page, "ab-texts-differ.png", full_page=True)
    assert console.errors == []


@pytest.mark.parametrize("arm, how", [("A", "escape"), ("B", "button")])
def test_ab_stop_cancels_the_stream_being_read_and_creates_no_other(
    page: Page, console: ConsoleLog, slow_gateway_url: str, arm: str, how: str,
) -> None:
    before = aborted_total(slow_gateway_url)
    page.goto(slow_gateway_url + "/ab")
    page.fill("#runs", "3")
    page.fill("#max-tokens", "60")  # 3 s per stream at 20 tokens/s: A ends, B is still running when stopped
    page.fill("#seed", "1")
    page.click("#start")
    page.wait_for_function("a => document.querySelector(`#pane-${a} .text`).textContent.length > 10", arg=arm)
    if how == "escape":
        page.keyboard.press("Escape")
    else:
        page.click("#stop")
    page.wait_for_function("window.__tokenfan.state === 'idle'", timeout=5_000)
    stopped_at = page.text_content(f"#pane-{arm} .text")

    # Run 1 reads A's stream, then B's: stopping A leaves B's never created; stopping B leaves A's done.
    streams = page.evaluate("window.__tokenfan.streams")
    assert [s["arm"] for s in streams] == (["A"] if arm == "A" else ["A", "B"]), streams
    states = {s["arm"]: httpx.get(f"{slow_gateway_url}/v1/streams/{s['id']}", timeout=5).json()["state"]
              for s in streams}
    assert states[arm] == "cancelled" and states.get("A") == ("cancelled" if arm == "A" else "done"), states
    deadline = time.monotonic() + 5
    while aborted_total(slow_gateway_url) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted_total(slow_gateway_url) > before, "the engine request was not aborted"
    assert page.get_attribute(f"#pane-{arm}", "data-state") == "cancelled"
    if arm == "A":
        assert page.get_attribute("#pane-B", "data-state") == "stopped"
    assert "stopped after 1 runs" in (page.text_content("#progress") or "")
    page.wait_for_timeout(300)
    assert page.text_content(f"#pane-{arm} .text") == stopped_at, "text kept growing after Stop"
    assert page.evaluate("window.__tokenfan.streams.length") == len(streams), "a stream was created after Stop"
    result = page.evaluate("window.__tokenfan.result")
    assert {r["key"]: r["reason"] for r in result["records"]} == states
    assert page.is_enabled("#start") and page.is_disabled("#stop")
    shot(page, f"ab-stopped-{arm}.png")
    assert console.errors == []


# -- reconnect ---------------------------------------------------------------------------------------


def test_eventsource_reconnects_with_last_event_id_without_losing_or_repeating_text(
    page: Page, slow_gateway_url: str,
) -> None:
    proxy = CuttableProxy(int(slow_gateway_url.rsplit(":", 1)[1]))
    try:
        page.goto(f"{proxy.url}/?transport=sse")
        ask(page, max_tokens=50)  # 2.5 s
        page.wait_for_function("s => ([...document.querySelectorAll(s)].pop()?.textContent.length ?? 0) > 30",
                               arg=f"{ANSWER} .text")
        assert proxy.cut() >= 1
        assert wait_answer_settled(page) == "done"
        debug = page.evaluate("window.__tokenfan")
        shot(page, "chat-reconnect.png")
    finally:
        proxy.close()
    assert debug["reconnects"] >= 1, debug
    assert debug["duplicates"] == 0, debug
    assert answer_text(page) == full_stream_text(slow_gateway_url, debug["streamId"])
    sent = proxy.requests_sent()
    resumes = [h for h in sent.split("\r\n\r\n") if f"/v1/streams/{debug['streamId']}/events" in h]
    assert len(resumes) >= 2 and "last-event-id:" in resumes[-1].lower(), resumes


# -- errors --------------------------------------------------------------------------------------------


def assert_chat_shows_error(page: Page, url: str, transport: str, message: str, screenshot: str) -> None:
    """The chat page announces ``message`` on load and again on the answer it is asked for."""
    page.goto(f"{url}/?transport={transport}")
    page.wait_for_function("!document.querySelector('#banner').hidden")
    assert message in (page.text_content("#banner") or "")
    ask(page)
    assert wait_answer_settled(page, timeout=5_000) == "error"
    assert message in (page.text_content(f"{ANSWER} .error") or "")
    shot(page, screenshot)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_down_shows_503_instead_of_hanging(
    page: Page, engineless_gateway_url: str, transport: str,
) -> None:
    assert_chat_shows_error(page, engineless_gateway_url, transport, "Engine unavailable (503)",
                            f"chat-engine-down-{transport}.png")
    assert page.is_enabled("#send")


def test_ab_page_with_engine_down_shows_503(page: Page, engineless_gateway_url: str) -> None:
    page.goto(engineless_gateway_url + "/ab")
    page.click("#start")
    page.wait_for_function("window.__tokenfan.state === 'idle' && window.__tokenfan.errors.length > 0")
    assert "Engine unavailable (503)" in (page.text_content("#banner") or "")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_missing_api_key_shows_authentication_failure(
    page: Page, keyed_gateway_url: str, transport: str,
) -> None:
    assert_chat_shows_error(page, keyed_gateway_url, transport, "Authentication failed (401)",
                            f"chat-auth-failed-{transport}.png")


def test_api_key_from_the_settings_opens_every_transport(
    page: Page, console: ConsoleLog, keyed_gateway_url: str,
) -> None:
    page.goto(keyed_gateway_url + "/")
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Tab")  # "change" stores the key and reloads the model id
    page.wait_for_function("document.querySelector('#model').textContent === 'synthetic'")
    assert page.is_hidden("#banner")
    console.errors.clear()  # the 401 of the first /v1/models, before the key was entered
    for transport in TRANSPORTS:
        page.check(f'input[name="transport"][value="{transport}"]')
        ask(page, max_tokens=20)
        assert wait_answer_settled(page) == "done", page.text_content(f"{ANSWER} .error")
        assert answer_text(page).strip()
    assert console.errors == []


def test_ab_page_asks_for_the_api_key_then_reads_both_streams_with_it(
    page: Page, console: ConsoleLog, keyed_gateway_url: str,
) -> None:
    page.goto(keyed_gateway_url + "/ab")
    page.fill("#runs", "1")
    page.fill("#max-tokens", "12")
    page.click("#start")
    page.wait_for_function("window.__tokenfan.state === 'idle' && window.__tokenfan.errors.length > 0")
    assert "Authentication failed (401)" in (page.text_content("#banner") or "")
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Tab")  # "change" stores the key and reloads the model id
    page.wait_for_function("document.querySelector('#model').textContent === 'synthetic'")
    console.errors.clear()  # the 401s before the key was entered
    page.click("#start")
    page.wait_for_function("window.__tokenfan.result !== null")
    records = page.evaluate("window.__tokenfan.result.records")
    assert sorted(r["api"] for r in records) == ["es", "ws"] and all(r["reason"] == "done" for r in records), records
    assert page.is_hidden("#banner")
    assert console.errors == []


def test_forbidden_answer_is_shown(page: Page, gateway_url: str) -> None:
    body = {"error": {"message": "Not allowed.", "type": "permission_error", "param": None,
                      "code": "forbidden"}}
    page.route("**/v1/streams", lambda route: route.fulfill(status=403, json=body))
    page.goto(f"{gateway_url}/?transport=sse")
    ask(page)
    assert wait_answer_settled(page, timeout=5_000) == "error"
    assert "Authentication failed (403): Not allowed." in (page.text_content(f"{ANSWER} .error") or "")


def test_a_connection_that_never_delivers_times_out(page: Page, gateway_url: str) -> None:
    held: list[Route] = []
    page.route("**/v1/chat/completions", lambda route: held.append(route))  # never answered
    page.goto(f"{gateway_url}/?transport=fetch&timeout_ms=1000")
    ask(page)
    assert wait_answer_settled(page, timeout=5_000) == "error"
    assert "Timed out" in (page.text_content(f"{ANSWER} .error") or "")
    assert held, "the request never reached the route"


@pytest.mark.parametrize("cls", ["EventSourceSubscription", "WebSocketSubscription"])
def test_subscribing_to_an_unknown_stream_reports_it_gone(page: Page, gateway_url: str, cls: str) -> None:
    page.goto(gateway_url + "/")
    message = page.evaluate("""async (cls) => {
        const t = await import('/web/js/transports.js');
        const api = await import('/web/js/api.js');
        const sub = new t[cls]({ timeoutMs: 5000 });
        sub.subscribe({ id: 'str-nope', events_url: '/v1/streams/str-nope/events',
                        ws_url: '/v1/streams/str-nope/ws' });
        try { await sub.done; return 'no error'; } catch (err) { return api.describeError(err); }
    }""", cls)
    assert message.startswith("Stream gone (404)"), message


# -- pure modules, run in the browser ------------------------------------------------------------------


def test_sse_parser_handles_any_split_and_all_line_endings(page: Page, gateway_url: str) -> None:
    page.goto(gateway_url + "/")
    result = page.evaluate("""async () => {
        const { SSEParser } = await import('/web/js/sse.js');
        const raw = ': keep-alive\\r\\n\\r\\nretry: 1000\\nid: 7\\ndata: {"a":1}\\r\\n\\r\\n'
                  + 'event: end\\rdata: x\\rdata: y\\r\\rdata:no-space\\n\\nid: 9\\n\\n'
                  + 'data: tail-without-blank-line';
        const parse = (parts) => { const out = []; const p = new SSEParser((e) => out.push(e));
                                   parts.forEach((s) => p.feed(s)); return JSON.stringify(out); };
        const whole = parse([raw]);
        const splits = [];
        for (let i = 1; i < raw.length; i++) splits.push(parse([raw.slice(0, i), raw.slice(i)]));
        return { whole: JSON.parse(whole), allSame: splits.every((s) => s === whole),
                 byChar: parse([...raw]) === whole };
    }""")
    assert result["whole"] == [
        {"event": "message", "data": '{"a":1}', "id": "7", "retry": 1000},
        {"event": "end", "data": "x\ny", "id": None, "retry": None},
        {"event": "message", "data": "no-space", "id": None, "retry": None},
    ]
    assert result["allSame"] and result["byChar"]


def test_stats_percentiles_interpolate_as_numpy(page: Page, gateway_url: str) -> None:
    page.goto(gateway_url + "/")
    r = page.evaluate("""async () => {
        const s = await import('/web/js/stats.js');
        return { sum: s.summarize([1, 2, 3, 4, 5]), empty: s.summarize([]) };
    }""")
    assert r["sum"] == {"n": 5, "mean": 3, "p50": 3, "p90": 4.6, "p99": 4.96, "p99.9": pytest.approx(4.996)}
    assert r["empty"] == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "p99.9": None}


def test_stats_unpaired_difference_of_medians_with_per_arm_bootstrap(page: Page, gateway_url: str) -> None:
    page.goto(gateway_url + "/")
    r = page.evaluate("""async () => {
        const s = await import('/web/js/stats.js');
        const a = Array.from({ length: 400 }, (_, i) => ((i * 37) % 21 - 10) / 100);
        const b = Array.from({ length: 300 }, (_, i) => ((i * 11) % 17 - 8) / 100 + 0.5);
        const sa = a.map((_, i) => i % 25);
        const sb = b.map((_, i) => i % 30);
        return { a, b, shifted: s.unpairedMedianDiff(a, sa, b, sb), again: s.unpairedMedianDiff(a, sa, b, sb),
                 few: s.unpairedMedianDiff(a, sa.map((x) => x % 3), b, sb), perStream: s.unpairedMedianDiff(
                   [10, 12, 11], null, [15, 14, 16, 13], null),
                 none: s.unpairedMedianDiff([], [], b, sb) };
    }""")
    import numpy as np

    d = r["shifted"]
    assert d["median"] == pytest.approx(float(np.median(r["b"]) - np.median(r["a"])))
    assert d["paired"] is False and d["n"] == 300 and d["streams"] == 25
    assert d["ci95"][0] <= d["median"] <= d["ci95"][1] and d["ci95"][1] - d["ci95"][0] < 0.2
    assert "stream-cluster" in d["method"] and r["again"] == d, "the bootstrap must be reproducible (seeded)"
    assert "token bootstrap (few streams)" in r["few"]["method"] and r["few"]["streams"] == 3
    assert r["perStream"]["median"] == pytest.approx(14.5 - 11) and "over streams" in r["perStream"]["method"]
    assert r["none"]["median"] is None and r["none"]["ci95"] is None


# -- the real vLLM engine ------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_chat_streams_from_real_vllm_over_each_transport(
    page: Page, console: ConsoleLog, vllm_gateway_url: str, transport: str,
) -> None:
    model = httpx.get(vllm_gateway_url + "/v1/models").json()["data"][0]["id"]
    page.goto(f"{vllm_gateway_url}/?transport={transport}")
    page.wait_for_function("m => document.querySelector('#model').textContent === m", arg=model)
    ask(page, max_tokens=40)
    assert wait_answer_settled(page, timeout=60_000) == "done"
    assert answer_text(page)
    answer = page.locator(ANSWER).last
    assert answer.get_attribute("data-transport") == transport
    assert int(answer.locator('[data-metric="tokens"]').text_content() or "0") > 0
    shot(page, f"vllm-chat-{transport}.png")
    assert console.errors == []


@pytest.mark.vllm
def test_ab_run_on_real_vllm_gives_identical_texts(page: Page, console: ConsoleLog, vllm_gateway_url: str) -> None:
    page.goto(vllm_gateway_url + "/ab")
    page.fill("#runs", "2")
    page.fill("#max-tokens", "40")
    page.click("#start")
    page.wait_for_function("window.__tokenfan.result !== null", timeout=60_000)
    text_a = page.text_content("#pane-A .text")
    assert text_a and text_a == page.text_content("#pane-B .text")
    assert page.get_attribute("#verdict", "data-identical") == "true"
    shot(page, "vllm-ab.png", full_page=True)
    assert console.errors == []


# -- tool calls, reasoning, JSON and n > 1 choices ----------------------------------------------------


def sse_body(*events: dict[str, object]) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def open_output_options(page: Page) -> None:
    page.click(".output-options summary")


def test_chat_renders_reasoning_tool_cards_json_and_choices_as_text(page: Page, console: ConsoleLog,
                                                                    gateway_url: str) -> None:
    evil = '<img src=x onerror="window.__pwned=1">'
    args = json.dumps({"x": evil})

    def choice(index: int, finish: str | None = None, **d: object) -> dict[str, object]:
        return {"choices": [{"index": index, "delta": d, "finish_reason": finish}]}

    body = sse_body(
        choice(0, reasoning="think " + evil), choice(1, content='{"a": [1, '),
        choice(0, tool_calls=[{"index": 0, "id": "call_1", "type": "function", "function": {"name": evil}}]),
        choice(0, tool_calls=[{"index": 0, "function": {"arguments": args[:-1]}}]),
        choice(1, content='"<b>"]}'), choice(0, tool_calls=[{"index": 0, "function": {"arguments": "}"}}]),
        choice(0, tool_calls=[{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "cut", "arguments": '{"y": 1'}}]),
        choice(0, "length"), choice(1, "stop"))
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=body))
    page.goto(f"{gateway_url}/?transport=fetch")
    page.fill("#n", "2")
    page.fill("#temperature", "1")
    ask(page)
    assert wait_answer_settled(page) == "done"
    answer = page.locator(ANSWER).last
    first, second = answer.locator(".choice").all()
    assert first.locator(".choice-label").text_content() == "choice 0"
    assert first.locator(".reasoning-text").text_content() == "think " + evil
    cards = first.locator(".tool-call").all()
    assert cards[0].locator(".tool-name").text_content() == evil
    assert cards[0].locator(".tool-args").text_content() == json.dumps({"x": evil}, indent=2)
    assert cards[0].get_attribute("data-complete") == "true"
    assert cards[1].locator(".tool-args").text_content() == '{"y": 1'  # cut: shown as it came
    assert cards[1].get_attribute("data-complete") == "false"
    assert first.get_attribute("data-finish") == "length"
    assert second.locator(".text").text_content() == json.dumps({"a": [1, "<b>"]}, indent=2)
    assert second.locator(".text").get_attribute("data-json") == "valid"
    assert second.locator(".finish").text_content() == "finish: stop"
    assert answer.locator(".choices img, .choices b:not(.tool-name)").count() == 0
    assert page.evaluate("window.__pwned === undefined")
    shot(page, "chat-rendered-output.png")
    assert console.errors == []


def test_responses_function_call_and_reasoning_events_render_like_chat_chunks(page: Page, gateway_url: str) -> None:
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "get_weather", "arguments": ""}
    events: list[dict[str, Any]] = [{"type": "response.reasoning_text.delta", "delta": "hmm"},
              {"type": "response.output_item.added", "output_index": 1, "item": item},
              {"type": "response.function_call_arguments.delta", "output_index": 1, "delta": '{"city":'},
              {"type": "response.function_call_arguments.delta", "output_index": 1, "delta": '"Paris"}'},
              {"type": "response.completed", "response": {"usage": None}}]
    page.route("**/v1/responses", lambda route: route.fulfill(status=200, content_type="text/event-stream", body="".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)))
    page.goto(f"{gateway_url}/?transport=responses-sse")
    ask(page)
    assert wait_answer_settled(page) == "done"
    answer = page.locator(ANSWER).last
    assert answer.locator(".reasoning-text").text_content() == "hmm"
    assert answer.locator(".tool-name").text_content() == "get_weather"
    assert json.loads(answer.locator(".tool-args").text_content() or "") == {"city": "Paris"}


def test_settings_refuse_bad_json_and_fields_the_responses_api_lacks(page: Page, gateway_url: str) -> None:
    page.goto(f"{gateway_url}/?transport=fetch")
    open_output_options(page)
    page.select_option("#tool-choice", "auto")
    page.fill("#tools", "[{")
    ask(page)
    page.wait_for_function("!document.querySelector('#banner').hidden")
    assert (page.text_content("#banner") or "").startswith("Tools: not valid JSON")
    page.select_option("#tool-choice", "")
    page.check('input[name="transport"][value="responses-ws"]')
    page.fill("#n", "2")
    ask(page)
    page.wait_for_function("/Responses API has no n/.test(document.querySelector('#banner').textContent)")
    assert page.locator(ANSWER).count() == 0  # nothing was sent


# On the parser-configured tiny model (random weights): structured outputs force the tool call and the JSON,
# and thinking is off, or the qwen3 reasoning parser would take the whole output as reasoning.
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def sent_bodies(page: Page) -> list[dict[str, Any]]:
    """The request bodies the page sends, over any transport: the POST body (chat, /v1/streams, Responses),
    a /v1/ws request's body or a Responses WebSocket ``response.create`` (its ``type`` dropped)."""
    bodies: list[dict[str, Any]] = []

    def on_request(req: Request) -> None:
        if req.method == "POST" and req.url.endswith(("/v1/chat/completions", "/v1/streams", "/v1/responses")):
            bodies.append(json.loads(req.post_data or "null"))

    def on_frame(payload: str | bytes) -> None:
        msg = json.loads(payload)
        if msg.get("type") == "request":
            bodies.append(msg["body"])
        elif msg.get("type") == "response.create":
            bodies.append({k: v for k, v in msg.items() if k != "type"})

    page.on("request", on_request)
    page.on("websocket", lambda ws: ws.on("framesent", on_frame))
    return bodies


def as_sent(transport: str, chat: dict[str, Any]) -> dict[str, Any]:
    """What the page sends for the chat request ``chat`` over ``transport`` (stream fields aside): the chat
    body itself, or the Responses API's shapes of the same fields."""
    if not transport.startswith("responses"):
        return chat
    out = {"model": chat["model"], "input": chat["messages"], "max_output_tokens": chat["max_tokens"],
           "temperature": chat["temperature"], "chat_template_kwargs": chat["chat_template_kwargs"]}
    if "tools" in chat:
        out |= {"tools": [{"type": "function", **t["function"]} for t in chat["tools"]],
                "tool_choice": chat["tool_choice"], "parallel_tool_calls": chat["parallel_tool_calls"]}
    if "response_format" in chat:
        out["text"] = {"format": {"type": "json_schema", **chat["response_format"]["json_schema"]}}
    return out


def ask_structured(page: Page, transport: str, chat: dict[str, Any]) -> None:
    """Ask the question with greedy sampling and thinking off; checks that the page sent exactly ``chat``
    (in the transport's API)."""
    bodies = sent_bodies(page)
    page.fill("#temperature", "0")
    page.select_option("#thinking", "off")
    ask(page, QUESTION[0]["content"], max_tokens=chat["max_tokens"])
    assert wait_answer_settled(page, timeout=120_000) == "done", page.text_content(f"{ANSWER} .error")
    drop = ("stream", "stream_options", "endpoint")
    assert [{k: v for k, v in b.items() if k not in drop} for b in bodies] == [as_sent(transport, chat)]


def direct(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


@pytest.mark.vllm
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_forced_tool_call_renders_as_a_card_equal_to_the_direct_response(
    page: Page, console: ConsoleLog, parser_gateway: str, transport: str,
) -> None:
    page.goto(f"{parser_gateway}/?transport={transport}")
    open_output_options(page)
    page.select_option("#tool-choice", "required")
    page.uncheck("#parallel-calls")  # else the tiny model calls again and again until max tokens
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 60, "temperature": 0, **NO_THINKING,
            "tools": json.loads(page.input_value("#tools")), "tool_choice": "required", "parallel_tool_calls": False}
    ask_structured(page, transport, body)
    expected = direct(parser_gateway, body)
    [call] = expected["message"]["tool_calls"]
    card = page.locator(f"{ANSWER} .tool-call")
    assert card.count() == 1
    assert card.locator(".tool-name").text_content() == call["function"]["name"] == "get_weather"
    assert json.loads(card.locator(".tool-args").text_content() or "") == json.loads(call["function"]["arguments"])
    assert card.get_attribute("data-complete") == "true"
    [got] = page.evaluate("window.__tokenfan.choices")
    assert got["tool_calls"][0]["function"] == call["function"]  # the raw arguments string, not just its value
    if not transport.startswith("responses"):  # the Responses API has no finish reason
        assert got["finish_reason"] == expected["finish_reason"] == "tool_calls"
        assert page.locator(f"{ANSWER} .finish").text_content() == "finish: tool_calls"
    shot(page, f"vllm-tool-call-{transport}.png")
    assert console.errors == []


@pytest.mark.vllm
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_json_schema_answer_is_pretty_printed_and_matches_the_schema(
    page: Page, console: ConsoleLog, parser_gateway: str, transport: str,
) -> None:
    page.goto(f"{parser_gateway}/?transport={transport}")
    open_output_options(page)
    page.select_option("#response-format", "json_schema")
    schema = json.loads(page.input_value("#json-schema"))
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 40, "temperature": 0, **NO_THINKING,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                                                       "schema": schema}}}
    ask_structured(page, transport, body)
    text = page.locator(f"{ANSWER} .text")
    assert text.get_attribute("data-json") == "valid"
    shown = text.text_content() or ""
    value = json.loads(shown)
    jsonschema.validate(value, schema)
    assert shown == json.dumps(value, indent=2, ensure_ascii=False)
    assert value == json.loads(direct(parser_gateway, body)["message"]["content"])
    shot(page, f"vllm-json-schema-{transport}.png")
    assert console.errors == []
