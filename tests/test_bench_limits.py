"""What a bench run holds at the gateway, against the limits ``/health`` gives (tokenfan_bench/limits.py), and
where ``tokenfan bench report`` may write."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import ROOT
from tokenfan_bench import limits
from tokenfan_bench.report import matrix

DEFAULTS = {"max_generations_per_client": 64, "max_connections_per_client": 256,
            "max_subscriptions_per_client": 128, "max_concurrent": 4096, "fair_share_at": 0.75,
            "max_streams": 10_000, "max_subscribers": 10_000, "max_tokens_cap": 4096}


def test_a_shared_stream_run_holds_one_generation_and_a_subscription_per_arm_per_slot() -> None:
    n = limits.need(("sse", "ws"), 100, False, 100)
    assert (n.generations, n.subscriptions, n.connections, n.subscribers_per_stream) == (100, 200, 200, 2)
    n = limits.need(("sse", "ws"), 100, True, 100)
    assert (n.generations, n.subscriptions, n.subscribers_per_stream) == (200, 200, 1)
    n = limits.need(("sse", "resp-sse", "resp-ws"), 10, False, 100)  # responses: one generation each
    assert (n.generations, n.subscriptions, n.connections) == (30, 10, 30)


def test_the_documented_run_passes_two_default_limits_and_lifting_them_names_the_flags() -> None:
    problems = limits.over(limits.need(("sse", "ws"), 100, False, 100), DEFAULTS)
    assert [p[0] for p in problems] == ["max_generations_per_client", "max_subscriptions_per_client"]
    assert limits.lift(problems) == ["--max-generations-per-client 0", "--max-subscriptions-per-client 0"]
    assert limits.largest_fit(("sse", "ws"), 100, False, 100, DEFAULTS) == 64
    lifted = {**DEFAULTS, "max_generations_per_client": 0, "max_subscriptions_per_client": 0}
    assert limits.over(limits.need(("sse", "ws"), 100, False, 100), lifted) == []


def test_a_crowd_past_the_fair_share_and_a_long_stream_are_named() -> None:
    no_client = {**DEFAULTS, "max_generations_per_client": 0, "max_subscriptions_per_client": 0,
                 "max_connections_per_client": 0}
    assert limits.over(limits.need(("sse", "ws"), 3072, False, 10), no_client) == []
    problems = limits.over(limits.need(("sse", "ws"), 3073, False, 10_000), no_client)
    assert [p[0] for p in problems] == ["max_tokens_cap", "fair_share_at"]
    assert limits.lift(problems) == ["--max-tokens-cap 10000", "--fair-share-at 0"]


def test_the_report_refuses_a_tracked_path_and_takes_a_new_one(tmp_path: Path) -> None:
    assert matrix.tracked([ROOT / "docs" / "ab-report.md", ROOT / "docs" / "ab-report"]) == \
        [ROOT / "docs" / "ab-report.md", ROOT / "docs" / "ab-report"]
    assert matrix.tracked([tmp_path / "ab-report.md", ROOT / "bench-results" / "x" / "ab-report.md"]) == []
    with pytest.raises(SystemExit):
        matrix.main(["--out", str(ROOT / "docs" / "ab-report.md")])
