"""``tokenfan bench page-levels`` against real processes (synthetic engines, TLS gateways, Chromium): every
token of every stream is stamped by all three readers at every level, and the calibration's delay on the
WebSocket path comes back within a generous bound. Structure, not timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import one_of_runs
from tests.system import require
from tokenfan_bench.cli import main as bench_main
from tokenfan_bench.stats.page_levels import LEVELS


@pytest.mark.alone  # reads time: no other test runs beside it (tests/conftest.py)
@pytest.mark.browser
@pytest.mark.timeout(180)
def test_page_levels_stamps_every_token_at_every_level_and_recovers_the_injected_delay(tmp_path: Path) -> None:
    require("/usr/bin/chromium")
    streams, rounds, tokens = 2, 2, 8

    def run(attempt: int) -> str | None:  # the delay's bound needs a quiet moment: at most three runs (see the end)
        out = tmp_path / str(attempt)
        assert bench_main(["page-levels", "--streams", str(streams), "--rounds", str(rounds), "--max-tokens",
                           str(tokens), "--rate", "50", "--ttft-ms", "300", "--calibrate", "--bootstrap", "100",
                           "--out", str(out)]) == 0
        return check_run(out, streams, rounds, tokens)

    one_of_runs(run, "no run recovered the injected delay within 1.5 ms")


def check_run(out: Path, streams: int, rounds: int, tokens: int) -> str | None:
    """The run's structure (asserted); how far its calibration missed the injected delay, if by 1.5 ms or more."""
    res = json.loads((out / "results.json").read_text())
    assert set(res["runs"]) == {"measured", "placebo", "delayed"}
    for name, run in res["runs"].items():
        assert run["errors"] == [], name
        assert run["streams"] == streams * rounds, name
        assert run["dropped"] == 0, name  # every reader was open before the first token and got every one
        assert run["tokens"] >= streams * rounds * tokens, name  # role and final chunks are stamped too
        assert list(run["levels"]) == [level for level, *_ in LEVELS], name
        for level, d in run["levels"].items():
            assert d["n"] > 0 and d["ci95"][0] <= d["median"] <= d["ci95"][1], (name, level)
    cal = res["calibration"]
    assert cal["applied"]["n"] > 0 and cal["applied_placebo"]["n"] > 0
    # the gateways timed their sleeps: 2 ms apart by design; under load either arm's sleep overruns (1.64 ms
    # seen beside another test, 2.6 beside a CPU hog), so only a shift of the right sign and size is checked
    assert 0.5 < cal["expected_ms"] < 10.0
    assert "| ws − fetch |" in (out / "summary.md").read_text()
    # generous (few tokens); a busy machine (two test workers) once missed by 1.53 ms, so three runs may try
    moved, expected = cal["moved"]["ws − fetch"]["median"], cal["expected_ms"]
    return None if abs(moved - expected) < 1.5 else f"moved {moved:.2f} ms for {expected:.2f}"
