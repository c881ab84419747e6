"""``tokenfan bench fanout``'s accounting (:mod:`tokenfan_bench.stats.spread`) and its subscriber plan."""

from __future__ import annotations

from tokenfan_bench.fanout import subscriber_plan
from tokenfan_bench.stats.spread import Outcome, add_receipt, delivery, merge, window_spread


def test_spread_of_an_event_runs_from_the_first_receipt_in_any_process_to_the_last():
    a: dict[int, list[int]] = {}
    b: dict[int, list[int]] = {}
    for t in (1_000_000, 3_000_000):
        add_receipt(a, 0, t)
    for t in (2_000_000, 9_000_000):
        add_receipt(b, 0, t)
    add_receipt(b, 1, 50_000_000)
    merged = merge([a, b])
    assert merged[0] == [4, 1_000_000, 9_000_000]
    s = window_spread(merged, 0, 10_000_000, subscribers=4)
    assert s["events"] == 1 and s["complete"] == 1 and s["deliveries"] == 4
    assert s["p50_ms"] == s["max_ms"] == 8.0  # 9 ms - 1 ms; seq 1 was first received after the window


def test_an_event_some_subscriber_missed_is_not_complete():
    tally: dict[int, list[int]] = {}
    add_receipt(tally, 0, 5)
    assert window_spread(tally, 0, 10, subscribers=2)["complete"] == 0


def test_delivery_counts_every_event_of_every_subscriber_and_names_the_short_ones():
    whole = Outcome(0, "sse", False)
    for seq in range(5):
        whole.got(seq)
    whole.end = "done"
    gap = Outcome(0, "ws", False)
    for seq in (0, 1, 3, 4):
        gap.got(seq)
    gap.end = "done"
    repeat = Outcome(0, "ws", False)
    for seq in (0, 1, 2, 3, 3, 4):
        repeat.got(seq)
    repeat.end = "done"
    no_end = Outcome(0, "sse", False)
    for seq in range(5):
        no_end.got(seq)
    slow = Outcome(0, "sse", True, end="cut")
    d = delivery([o.as_row() for o in (whole, gap, repeat, no_end, slow)], {0: 5})
    assert d["subscribers"] == 4 and d["complete"] == 1 and d["incomplete"] == 3
    assert d["expected_events"] == 20 and d["delivered_events"] == 5 + 4 + 5 + 5
    assert {e["transport"] for e in d["incomplete_examples"]} == {"ws", "sse"}
    assert d["slow"] == {"subscribers": 1, "cut": 1, "done": 0, "other": 0}


def test_plan_mixes_transports_and_spreads_the_slow_ones_over_the_streams():
    plan = subscriber_plan(1000, 2, "mix", 0.01)
    assert sum(1 for _, t, _ in plan if t == "ws") == 500
    assert sum(1 for *_, slow in plan if slow) == 10
    assert {(k, t) for k, t, slow in plan if slow} == {(0, "sse"), (0, "ws"), (1, "sse"), (1, "ws")}
    assert {t for _, t, slow in subscriber_plan(1000, 1, "mix", 0.01) if slow} == {"sse", "ws"}
    assert not any(slow for *_, slow in subscriber_plan(100, 1, "sse", 0.0))
