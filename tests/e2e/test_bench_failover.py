"""``tokenfan bench failover`` end to end: every scenario kills what it names with SIGKILL of its process
group, and the report holds one gap per cut stream of each kind. The engine scenario runs the kinds on
scripted engines (vLLM's OpenAI layer and its ``hermes`` and ``qwen3`` parsers over the tiny model's
tokenizer); the gateway and workers scenarios, whose bench code is the same for every kind, run plain
text on synthetic engines (they boot in about a second). The gaps' size is the bench's to measure, never
asserted here; that each is a real gap (a stream cut and continued, counted by the gateway) is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import engine_worker.models
from tests.e2e.helpers import one_of_runs
from tests.system import require
from tokenfan_bench.cli import main as bench_main

STREAMS = 6


def counted(lines: list[str], name: str, label: str) -> dict[str, float]:
    """The non-zero samples of counter ``name`` among the report's metric lines, by the value of ``label``."""
    return {s.labels[label]: s.value for f in text_string_to_metric_families("\n".join(lines) + "\n")
            for s in f.samples if s.name == name and s.value}


@pytest.mark.parametrize(("scenario", "kinds"), [("engine", ("plain", "tools", "reasoning")),
                                                 ("gateway", ("plain",)), ("workers", ("plain",))])
def test_failover_reports_a_gap_per_cut_stream_of_each_kind(
        scenario: str, kinds: tuple[str, ...], tiny_model: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if scenario == "gateway":
        require("redis-server")
    # the session's tiny model (the same build, deterministic per seed) instead of a second one in the bench's tmp
    monkeypatch.setattr(engine_worker.models, "build_tiny_llama", lambda path, **_: tiny_model)
    # A run asserts everything; that the killed engine held a stream of every kind depends on how the gateway
    # spread them (least loaded, by the counts it had at each request), so a run without is run once more.
    one_of_runs(lambda i: failover_once(scenario, kinds, tmp_path / f"failover-{i}"),
                "no run cut a stream of every kind", tries=2)


def failover_once(scenario: str, kinds: tuple[str, ...], out: Path) -> str | None:
    assert bench_main(["failover", "--scenario", scenario, "--kind", ",".join(kinds), "--streams", str(STREAMS),
                       "--tokens", "100", "--tokens-per-s", "60", "--out", str(out)]) == 0
    (r,) = json.loads((out / "results.json").read_text())["results"]
    assert (r["scenario"], r["backend"], r["streams"], r["ended_normally"]) == (scenario, "synthetic", 6, 6), r
    assert tuple(r["kinds"]) == kinds
    per_kind = STREAMS // len(kinds)
    for kind, k in r["kinds"].items():
        assert (k["streams"], k["ended_normally"]) == (per_kind, per_kind), (kind, k)
        assert all(0 < g < 60 for g in k["gaps_s"]), (kind, k)
    gaps = {kind: len(k["gaps_s"]) for kind, k in r["kinds"].items()}
    if scenario == "engine":
        # the engine under about half the streams was killed: one gap per stream continued elsewhere (the
        # others, on the engine that lived, have none: their next event is no gap)
        migrated = counted(r["migrations"], "tokenfan_migrations_total", "outcome")
        assert set(migrated) == {"continued"} and migrated["continued"] == sum(gaps.values()), (migrated, gaps)
        if not all(gaps.values()):  # the kinds take turns by pairs: one of each pair on each engine, mostly
            return f"a kind without a cut stream: {gaps}"
    else:
        # the owner of every stream was killed: each was adopted and each reader saw its gap
        adopted = counted(r["adoptions"], "tokenfan_adoptions_total", "outcome")
        assert adopted == {"adopted": STREAMS} and gaps == {"plain": STREAMS}, (adopted, gaps)
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# tokenfan bench failover") and f"--scenario {scenario}" in summary
    for kind in kinds:
        assert f"| {scenario} | {kind} | synthetic | {per_kind} | {per_kind} | {gaps[kind]} |" in summary
    return None
