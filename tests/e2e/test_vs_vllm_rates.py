"""`tokenfan bench vs-vllm`'s equal-rate run, end to end on the synthetic engine: vLLM's own client sends
Poisson arrivals to a real gateway, and the run's row carries the offered schedule and TTFT¹/ITL¹ percentiles."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenfan_bench import vs_vllm as v
from tokenfan_bench.servers.processes import spawn_synthetic


def test_a_rate_run_against_a_synthetic_gateway_reports_its_schedule_and_latencies(tiny_model: Path,
                                                                                   tmp_path: Path) -> None:
    ns = argparse.Namespace(input_len=8, output_len=8, seed=0, rate_duration=2.0, rate_min_prompts=8,
                            arrivals="poisson")
    model = v.Model(path=tiny_model, name="tiny")
    with spawn_synthetic(200.0, 5.0, tmp_path / "logs", gateway_args=["--served-model-name", "tiny"]) as s:
        srv = v.Running(v.ServerSpec("tokenfan", "tokenfan"), s.procs[-1].popen, s.url, tmp_path / "server.log", 0.0)
        row = v.measure_rate(srv, model, ns, tmp_path, 5.0, 0)
    assert row["rate"] == 5.0 and row["num_prompts"] == 10 and row["client"]["failed"] == 0
    assert row["client"]["completed"] == 10
    assert row["schedule"]["requests"] == 10 and row["schedule"]["mean_rate"] == 5.0
    lat = row["latency"]
    assert 0 < lat["p50_content_ttft_ms"] <= lat["p90_content_ttft_ms"] <= lat["p99_content_ttft_ms"]
    assert 0 < lat["p50_content_itl_ms"] <= lat["p99_content_itl_ms"]
    # 200 tokens/s: a gap of about 5 ms between content chunks
    assert 2.0 < lat["p50_content_itl_ms"] < 50.0
