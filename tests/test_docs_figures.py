"""Figures that one doc quotes from another (a run's date and length, a size, a log line) agree with their source.

Each figure has one source: the A/B report's header (its date and how long it ran) and tables (the browser's
delivery and handshake), docs/deploy.md's measured table (the image's size and build time), and the code (the
logger and text of a log line that docs/troubleshooting.md quotes). A doc that quotes a figure its source does
not say fails here, where the quote can be found by its shape."""

from __future__ import annotations

import ast
import re

from tests.procs import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPORT = (ROOT / "docs" / "ab-report.md").read_text()
DEPLOY = (ROOT / "docs" / "deploy.md").read_text()


def _report_run() -> tuple[str, int]:
    m = re.search(r"`tokenfan bench report` at (\d{4}-\d\d-\d\d)T[\d:]+Z in (\d+) s", REPORT)
    assert m, "docs/ab-report.md's header names its date and length"
    return m.group(1), int(m.group(2))


def _seconds(text: str) -> int | None:
    """``1,119 s``, ``844 s`` or ``18 min 39 s`` as seconds; None when ``text`` holds neither."""
    m = re.search(r"(\d+) min (\d+) s|(\d[\d,]*) s\b", text)
    if not m:
        return None
    return int(m.group(1)) * 60 + int(m.group(2)) if m.group(1) else int(m.group(3).replace(",", ""))


def test_quotes_of_the_ab_report_name_its_date_and_length() -> None:
    date, seconds = _report_run()
    quotes = 0
    for page in DOCS:
        if page.name == "ab-report.md":
            continue
        for m in re.finditer(r"ab-report\.md\)\**,? \(?([^)\n]{0,60})", page.read_text()):
            after = m.group(1)
            found = re.search(r"\d{4}-\d\d-\d\d", after)
            if found is None:
                continue
            quotes += 1
            assert found.group(0) == date, f"{page.name}: the A/B report is of {date}, not {found.group(0)}"
            quoted = _seconds(after)
            assert quoted in (None, seconds), f"{page.name}: the A/B report ran {seconds} s, not {quoted} s"
        for m in re.finditer(r"`?tokenfan bench report`?[^\n]*?about (\d+) min|about (\d+) minutes on 2 cores; "
                             r"tests/e2e/test_bench_report", page.read_text()):
            minutes = int(m.group(1) or m.group(2))
            assert abs(minutes - seconds / 60) <= 1, f"{page.name}: the A/B report takes {seconds} s, not {minutes} min"
    assert quotes >= 2  # README.md and docs/benchmarks.md


def _browser_delivery() -> list[tuple[str, float, float, float]]:
    """The report's browser delivery per profile: (profile, median, low, high) in ms."""
    rows = re.findall(r"^\| ([\w-]+) \|.*\| (-?\d+\.\d+) \[(-?\d+\.\d+), (-?\d+\.\d+)\] \(WebSocket lower\)", REPORT,
                      re.MULTILINE)
    assert len(rows) == 5, rows
    return [(name, float(a), float(b), float(c)) for name, a, b, c in rows]


def test_the_browser_figures_quoted_are_the_reports() -> None:
    rows = _browser_delivery()
    lan = next(r for r in rows if r[0] == "lan")
    spread = f"{min(abs(r[1]) for r in rows):.1f}–{max(abs(r[1]) for r in rows):.1f} ms"
    handshake = re.search(r"^\| D \| browser-ws \|.*\| \+(\d+\.\d)\d \[", REPORT, re.MULTILINE)
    assert handshake, "the report's browser WebSocket row"
    for page in (ROOT / "README.md", ROOT / "docs" / "browser.md"):
        text = page.read_text().replace("\n  ", " ").replace("\n", " ")
        for m in re.finditer(r"lan −(\d\.\d\d) ms \[−(\d\.\d\d), −(\d\.\d\d)\]", text):
            assert tuple(float(x) for x in m.groups()) == (-lan[1], -lan[2], -lan[3]), f"{page.name}: {m.group(0)}"
        for m in re.finditer(r"(\d\.\d–\d\.\d ms) (?:through the report's proxy|before (?:`?EventSource))", text):
            assert m.group(1) == spread, f"{page.name}: the report's browser delivery spans {spread}, not {m.group(1)}"
        for m in re.finditer(r"\+(\d+\.\d) ms (?:on lan )?up to \+\d", text):
            assert m.group(1) == handshake.group(1), f"{page.name}: the browser's WebSocket handshake costs " \
                                                     f"+{handshake.group(1)} ms on lan, not +{m.group(1)}"


def test_the_image_size_and_build_time_quoted_are_the_measured_ones() -> None:
    row = re.search(r"^\| `make image` with empty storage[^|]*\| ([^|]+) \| ([\d.]+ GB) \|", DEPLOY, re.MULTILINE)
    assert row, "docs/deploy.md's table measures `make image`"
    size = row.group(2)
    for m in re.finditer(r"builds an? ([\d.]+ GB) image", DEPLOY):
        assert m.group(1) == size, f"docs/deploy.md: the image is {size}, not {m.group(1)}"
    times = {_seconds(t) for t in re.findall(r"\d+ min \d+ s", DEPLOY)}
    makefile = (ROOT / "Makefile").read_text()
    quoted = re.search(r"\((\d+ min \d+ s) to (\d+ min \d+ s) to build", makefile)
    assert quoted, "the Makefile says how long the image takes to build"
    for t in quoted.groups():
        assert _seconds(t) in times, f"Makefile: {t} to build is not a time docs/deploy.md measured"


def _log_formats(source: str) -> list[re.Pattern[str]]:
    """The format strings of a module's ``log.<level>("…", …)`` calls as patterns (``%s``, ``%d``, ``%.1f``: any
    text), those with some words of their own."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("debug", "info", "warning", "error", "exception", "critical")
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            parts = re.split(r"%[-#0-9.]*[sdfrx]", node.args[0].value)
            if sum(len(part) for part in parts) >= 12:
                out.append(re.compile("(?s)" + ".+?".join(map(re.escape, parts))))
    return out


def test_log_lines_quoted_are_logged_by_the_logger_they_name() -> None:
    """A log line in the docs (``LEVEL logger: message``) names a logger of this code, and the module that
    logger belongs to (a package: any of its modules) logs that message: one of its log formats matches it, or,
    for a message it passes through (an exception's text), the message's words are in its source."""
    lines = [(page, m) for page in DOCS for m in re.finditer(
        r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) ([a-z_][\w.]*): (.+)$", page.read_text(), re.MULTILINE)]
    assert len(lines) >= 3, "docs/troubleshooting.md quotes log lines"
    for page, m in lines:
        name, message = m.group(1), m.group(2).strip()
        path = ROOT / name.replace(".", "/")
        sources = sorted(path.glob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
        assert sources and all(s.is_file() for s in sources), f"{page.name}: no module {name} logs {message!r}"
        texts = [s.read_text() for s in sources]
        # the longest piece between quoted values (a path, a number), its start: a source line may wrap after it
        words = max(re.split(r"'[^']*'|\d+", message), key=len).strip()[:30]
        logged = any(f.fullmatch(message) for t in texts for f in _log_formats(t))
        assert logged or (len(words) >= 12 and any(words in t for t in texts)), f"{page.name}: {name} does not log {message!r}"


def _sizing_table() -> dict[str, float]:
    """docs/benchmarks.md's `tokenfan bench sizing` table: what → KB."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## Memory per stream, subscriber and event"):]
    section = section[:section.index("\n## ", 4)]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| ([^|]+?) \| ([\d.]+)(?: / [\d.]+)? \|$", section,
                                                                  re.MULTILINE)}


def test_operations_sizing_quotes_the_sizing_run() -> None:
    """docs/operations.md's memory figures are the sizing run's (docs/benchmarks.md), and what it derives from
    them follows from them and from the settings' defaults."""
    from tokenfan_settings import BY_NAME

    sizes = _sizing_table()
    ops = (ROOT / "docs" / "operations.md").read_text()
    quoted = {
        "a running listed stream (fan-out, `/api/chat`), before its events": "gateway, per running listed stream",
        "an SSE or WebSocket subscriber of a fan-out stream (its socket taken out of the server, the default)":
            "gateway, per SSE subscriber",
        "a background response": "gateway, per background response",
    }
    for row, key in quoted.items():
        m = re.search(rf"^\| {re.escape(row)} \| ([\d.]+) KB \|$", ops, re.MULTILINE)
        assert m, f"operations.md: no row {row!r}"
        assert abs(float(m.group(1)) - sizes[key]) < 0.5, f"operations.md {row!r}: {m.group(1)} KB, the run {sizes[key]}"
    redis_event = re.search(r"\*\*([\d.]+) KB per event\*\*", ops)
    assert redis_event and float(redis_event.group(1)) == sizes["Redis, per event"]
    # 10,000 subscribers (the --max-subscribers default) at the run's KB each
    subscribers = BY_NAME["max_subscribers"].default
    m = re.search(r"\(10,000 by default: (\d+) MB at ([\d.]+) KB each\)", ops)
    assert m and subscribers == 10_000 and abs(int(m.group(1)) - subscribers * float(m.group(2)) / 1000) <= 1
