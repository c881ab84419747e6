"""``tokenfan bench capacity``'s decisions (pure): when a level holds, which level is the capacity, tokens per
core, the floor beside it, the bound of a merged event, and the profile's hottest frames."""

from __future__ import annotations

import argparse

import pytest

from tokenfan_bench.cpu import capacity, gateway_cost


def level(streams: int, tokens: float, held: bool, cpu: float = 0.5, p99: float = 10.0) -> dict:
    return {"streams": streams, "tokens_per_s": tokens, "events_per_s": tokens, "held": held,
            "delivery_ms": {"p99": p99}, "server_cpu_util": cpu,
            "tokens_per_server_core": gateway_cost.tokens_per_core(tokens, cpu)}


def test_a_level_holds_only_within_the_bound_without_errors_and_with_the_offered_tokens() -> None:
    assert gateway_cost.why_not_held(30.0, 0, 9_600.0, 10_000.0, 50.0) is None
    assert "p99" in (gateway_cost.why_not_held(50.1, 0, 10_000.0, 10_000.0, 50.0) or "")
    assert "error" in (gateway_cost.why_not_held(10.0, 2, 10_000.0, 10_000.0, 50.0) or "")
    assert "offered" in (gateway_cost.why_not_held(10.0, 0, 9_400.0, 10_000.0, 50.0) or "")
    assert gateway_cost.why_not_held(None, 0, 10_000.0, 10_000.0, 50.0) == "no event timed"
    assert gateway_cost.held(50.0, 0, 9_500.0, 10_000.0, 50.0)  # both bounds are inclusive
    assert gateway_cost.why_not_held(10.0, 0, 100.0, 10_000.0, 50.0, min_delivered=0.0) is None


def test_the_capacity_is_the_best_level_that_held_and_reports_that_level() -> None:
    levels = [level(128, 6_400.0, True, 0.2), level(256, 12_700.0, True, 0.5), level(384, 15_000.0, False, 0.9)]
    c = gateway_cost.capacity_of(levels, 50.0)
    assert (c["tokens_per_s"], c["streams"], c["best"]) == (12_700.0, 256, levels[1])
    assert gateway_cost.capacity_of(levels[2:], 50.0)["tokens_per_s"] is None
    # a level of the old shape (events only) still counts
    assert gateway_cost.capacity_of([{"streams": 4, "events_per_s": 200.0, "held": True}], 50.0)["tokens_per_s"] == 200.0


def test_tokens_per_core_divides_by_the_cores_used() -> None:
    assert gateway_cost.tokens_per_core(12_000.0, 0.4) == pytest.approx(30_000.0)
    assert gateway_cost.tokens_per_core(12_000.0, 0.0) is None and gateway_cost.tokens_per_core(None, 1.0) is None


def test_an_event_of_several_tokens_widens_the_bound_by_what_it_holds() -> None:
    assert gateway_cost.hold_ms(1, 50.0) == 0.0
    assert gateway_cost.hold_ms(4, 50.0) == pytest.approx(60.0)  # its oldest token waited three steps


def test_the_headline_sets_the_gateway_beside_the_floor_at_the_same_level() -> None:
    gw = gateway_cost.capacity_of([level(256, 12_800.0, True, 0.8), level(384, 16_000.0, False, 1.0)], 50.0)
    raw = gateway_cost.capacity_of([level(256, 12_800.0, True, 0.2), level(384, 19_200.0, True, 0.3)], 50.0)
    h = capacity.headline(gw, raw)
    assert (h["tokens_per_s"], h["streams"], h["gateway_cpu_util"]) == (12_800.0, 256, 0.8)
    assert h["tokens_per_gateway_core"] == pytest.approx(16_000.0)
    assert h["raw_tokens_per_s"] == 19_200.0 and h["raw_at_gateway_level"]["cpu_util"] == 0.2
    assert h["floor_ratio"] == pytest.approx(1.5) and h["floor_per_core_ratio"] == pytest.approx(4.0)
    assert h["top_level_reached"] == {"gateway": False, "raw": True}
    assert h["goal"]["met"]  # within 1.5x of the floor's tokens/s
    assert not capacity.headline(gateway_cost.capacity_of([level(256, 12_800.0, False)], 50.0), raw)["goal"]["met"]
    per_core = gateway_cost.capacity_of([level(256, 12_800.0, True, 0.4)], 50.0)
    far = gateway_cost.capacity_of([level(256, 12_800.0, True), level(1024, 51_200.0, True)], 50.0)
    assert capacity.headline(per_core, far)["goal"]["met"]  # 32,000 tokens per gateway core


def test_hottest_counts_leaf_frames_and_frames_on_the_stack_once_per_sample() -> None:
    raw = "main;loop;write (libc) 6\nmain;loop;publish;loop 3\nmain;gc 1\nnot a sample line\n"
    h = capacity.hottest(raw, 2)
    assert h["samples"] == 10
    assert h["self"] == [("write (libc)", 0.6), ("loop", 0.3)]
    assert h["inclusive"] == [("main", 1.0), ("loop", 0.9)]  # "loop" twice on one stack counts once
    assert capacity.hottest("") == {"samples": 0, "self": [], "inclusive": []}


def test_levels_must_ascend_and_transports_are_the_three() -> None:
    ap = capacity.parser()
    assert ap.parse_args(["--levels", "4,8", "--transports", "c,a"]).levels == [4, 8]
    for bad in (["--levels", "8,4"], ["--levels", "0,4"], ["--transports", "d"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    assert isinstance(ap.parse_args([]), argparse.Namespace)
