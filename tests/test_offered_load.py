"""`tokenfan bench vs-vllm` at equal offered request rates: the arrival schedule (against vLLM's own client),
the rate levels and run order, the latency percentiles and their aggregation, and the summary table."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tokenfan_bench import offered_load as ol
from tokenfan_bench import vs_vllm as v


def test_fixed_arrivals_are_one_request_every_interval() -> None:
    t = ol.arrival_times(4.0, 8, "fixed", seed=1)
    assert np.allclose(np.diff(t), 0.25) and t[0] == pytest.approx(0.25) and t[-1] == pytest.approx(2.0)
    assert ol.schedule_summary(t)["interval_cv"] == pytest.approx(0.0, abs=1e-12)


def test_poisson_arrivals_are_seeded_and_offer_the_rate_exactly() -> None:
    a, b, c = (ol.arrival_times(2.0, 2000, "poisson", seed=s) for s in (7, 7, 8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.all(np.diff(a) > 0)
    summary = ol.schedule_summary(a)
    assert summary["duration_s"] == pytest.approx(1000.0) and summary["mean_rate"] == pytest.approx(2.0)
    assert 0.9 < summary["interval_cv"] < 1.1  # exponential intervals: sd = mean


@pytest.mark.parametrize(("arrivals", "rate", "n"), [("poisson", 50.0, 40), ("fixed", 20.0, 12)])
def test_the_schedule_is_the_one_vllms_client_sends(monkeypatch: pytest.MonkeyPatch, arrivals: str, rate: float,
                                                    n: int) -> None:
    from vllm.benchmarks import serve  # (imported here: vLLM's import costs seconds)

    clock = [1000.0]
    sent: list[float] = []

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(serve.time, "time", lambda: clock[0])
    monkeypatch.setattr(serve.asyncio, "sleep", sleep)

    async def drive() -> None:
        async for _ in serve.get_request(list(range(n)), rate, ol.ARRIVALS[arrivals]):
            sent.append(clock[0] - 1000.0)

    np.random.seed(3)
    asyncio.run(drive())
    assert np.allclose(sent, ol.arrival_times(rate, n, arrivals, seed=3))


def test_levels_are_fractions_of_the_slower_servers_best_throughput() -> None:
    runs = [_conc("tokenfan", 8, 0, 4.0), _conc("tokenfan", 64, 0, 9.0), _conc("tokenfan", 64, 1, 7.0),
            _conc("vllm", 8, 0, 3.0), _conc("vllm", 64, 0, 5.0), _conc("vllm", 64, 1, 6.0)]
    cap = ol.capacity(runs)
    assert cap == (5.5, "vllm")  # tokenfan's best point 8.0 (median of 9 and 7); vllm's 5.5
    assert ol.rate_levels(5.5, (0.75, 0.25, 0.5)) == [1.38, 2.75, 4.12]
    assert ol.capacity([]) is None
    with pytest.raises(ValueError):
        ol.rate_levels(5.5, (0.5, 1.0))


def test_prompts_cover_the_duration_above_a_floor() -> None:
    assert ol.prompts_for(2.0, 30.0, 32) == 60 and ol.prompts_for(0.5, 30.0, 32) == 32


def test_server_order_alternates_per_level_and_round() -> None:
    orders = [ol.interleaved("AB", level, 0) for level in range(4)]
    assert ["".join(o) for o in orders] == ["AB", "BA", "AB", "BA"]
    assert ol.interleaved("AB", 0, 1) == ["B", "A"]


def test_rate_latencies_skip_the_role_chunk_and_pool_the_gaps() -> None:
    ttfts = [0.010, 0.020, 0.5]
    itls: list[list[float] | None] = [[0.100, 0.001, 0.003], [0.200, 0.002], None]  # the third request failed
    lat = ol.rate_latencies(ttfts, itls)
    assert lat["p50_content_ttft_ms"] == pytest.approx(165.0)  # (110 + 220) / 2
    assert lat["p90_content_ttft_ms"] == pytest.approx(209.0)
    assert lat["p50_content_itl_ms"] == pytest.approx(2.0)  # pooled 1, 2, 3 ms
    assert lat["p99_content_itl_ms"] == pytest.approx(2.98)
    assert ol.rate_latencies([], [])["p50_content_ttft_ms"] is None


def _conc(server: str, c: int, rnd: int, rps: float) -> dict[str, Any]:
    return {"server": server, "concurrency": c, "round": rnd, "client": {"request_throughput": rps}}


def _rate_run(server: str, rate: float, rnd: int, ttft50: float, achieved: float, failed: int = 0) -> dict[str, Any]:
    latency = {k: None for k, _ in ol.RATE_METRICS}
    latency.update(p50_content_ttft_ms=ttft50, p99_content_itl_ms=ttft50 / 10)
    return {"server": server, "kind": server, "rate": rate, "round": rnd, "load_before": (0.5, 0.5, 0.5),
            "client": {"request_throughput": achieved, "failed": failed}, "latency": latency}


def test_aggregation_takes_medians_over_rounds_per_server_and_rate() -> None:
    runs = [_rate_run("tokenfan", 1.0, r, t, a) for r, (t, a) in enumerate(((30.0, 0.9), (10.0, 1.0), (20.0, 1.1)))]
    runs.append(_rate_run("tokenfan", 2.0, 0, 50.0, 1.9, failed=2))
    agg = ol.aggregate_rates(runs)["tokenfan"]
    assert agg[1.0]["p50_content_ttft_ms"] == 20.0 and agg[1.0]["achieved_rps"] == 1.0 and agg[1.0]["rounds"] == 3
    assert agg[1.0]["p90_content_ttft_ms"] is None
    assert agg[2.0]["failed"] == 2 and agg[2.0]["p99_content_itl_ms"] == 5.0


def test_summary_has_the_equal_rate_table_with_ratios_against_vllm() -> None:
    results = {"meta": {"model": "tiny", "command": ["tokenfan", "bench", "vs-vllm"], "machine": "2 CPUs",
                        "load_start": "1 1 1", "rounds": 1, "concurrency": [], "rates": [1.0, 2.0],
                        "arrivals": "poisson", "seed": 0, "rate_duration_s": 30.0,
                        "capacity": {"requests_per_s": 4.0, "server": "vllm", "fractions": [0.25, 0.5]}},
               "servers": [{"label": "tokenfan", "kind": "tokenfan"}, {"label": "vllm", "kind": "vllm"}],
               "runs": [], "rate_runs": [_rate_run("tokenfan", 1.0, 0, 30.0, 1.0), _rate_run("vllm", 1.0, 0, 40.0, 1.0),
                                         _rate_run("tokenfan", 2.0, 0, 60.0, 2.0), _rate_run("vllm", 2.0, 0, 40.0, 2.0)]}
    md = v.summary_md(results)
    assert "## At equal offered request rates" in md and "vllm: 4.00 req/s" in md
    header = next(line for line in md.splitlines() if line.startswith("| server | rate req/s |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[3:6] == ["TTFT¹ p50", "TTFT¹ p90", "TTFT¹ p99"] and cols[6:9] == ["ITL¹ p50", "ITL¹ p90", "ITL¹ p99"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith("| tokenfan / vllm | ")]
    assert [r[1] for r in rows] == ["1", "2"]
    assert rows[0][cols.index("TTFT¹ p50")] == "**0.75×**" and rows[1][cols.index("TTFT¹ p50")] == "**1.50×**"
    assert rows[0][cols.index("TTFT¹ p90")] == "–"
    assert v.rate_table({**results, "rate_runs": []}) == []


def test_the_client_is_open_loop_at_a_rate_and_closed_loop_at_a_concurrency() -> None:
    assert v.Load(rate=2.5, arrivals="fixed").args() == ["--request-rate", "2.5", "--burstiness", "inf"]
    assert v.Load(rate=2.5).args() == ["--request-rate", "2.5", "--burstiness", "1"]
    assert v.Load(concurrency=8).args() == ["--max-concurrency", "8"]
