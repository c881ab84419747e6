"""Admission (pure state, no engine): total and per-key concurrency, and the event-loop lag guard."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.state import Gateway


class _Engine:
    """The one thing admission reads from the engines: their load (running, waiting)."""

    def __init__(self, waiting: int = 0) -> None:
        self.waiting = waiting

    def load(self) -> tuple[int, int]:
        return 0, self.waiting


def _gateway(waiting: int = 0, **config: Any) -> Gateway:
    cfg = GatewayConfig()
    for k, v in config.items():
        setattr(cfg, k, v)
    return Gateway(config=cfg, engine=_Engine(waiting))  # type: ignore[arg-type]


def _hold(gw: Gateway, client: str, n: int = 1) -> None:
    for _ in range(n):
        gw.admit(client, None)
        gw.clients.acquire("generations", client)


def test_total_and_per_key_limits_refuse_with_429_and_free_on_release() -> None:
    gw = _gateway(max_concurrent=3, max_concurrent_per_key=2, fair_share_at=0)
    for key in ("a", "a", "b"):
        gw.admit(key, key)
        gw.clients.acquire("generations", key)
    with pytest.raises(APIError) as info:
        gw.admit("c", "c")
    assert info.value.status == 429 and info.value.code == "too_many_requests" and info.value.retry_after
    gw.clients.release("generations", "b")
    with pytest.raises(APIError):
        gw.admit("a", "a")  # per key: "a" already has 2
    gw.admit("c", "c")
    assert gw.clients.of("generations", "b") == 0


def test_a_client_over_its_generation_limit_gets_429_naming_the_limit_and_is_counted() -> None:
    gw = _gateway(max_generations_per_client=2)
    _hold(gw, "addr:10.0.0.1", 2)
    with pytest.raises(APIError) as info:
        gw.admit("addr:10.0.0.1", None)
    err = info.value
    assert (err.status, err.type, err.code) == (429, "rate_limit_error", "client_generation_limit")
    assert err.retry_after and "--max-generations-per-client" in err.message
    gw.admit("addr:10.0.0.2", None)  # another client is not affected
    assert gw.metrics.refusals.labels("client_generation_limit")._value.get() == 1


def test_when_saturated_the_biggest_holder_is_refused_and_a_client_holding_nothing_gets_in() -> None:
    gw = _gateway(max_concurrent=10, fair_share_at=0.5, max_generations_per_client=0)
    _hold(gw, "big", 4)
    _hold(gw, "small", 1)  # 5 in flight: the soft cap
    with pytest.raises(APIError) as info:
        gw.admit("big", None)
    assert info.value.code == "fair_share_limit" and info.value.status == 429
    gw.admit("small", None)  # below the average (2.5)
    for i in range(5):  # newcomers get in up to --max-concurrent
        _hold(gw, f"new{i}")
    with pytest.raises(APIError) as info:
        gw.admit("another", None)
    assert info.value.code == "too_many_requests"


def test_while_the_engines_queue_only_a_client_above_the_average_waits() -> None:
    gw = _gateway(waiting=3, max_generations_per_client=0)
    _hold(gw, "alone", 5)
    gw.admit("alone", None)  # alone: the engine's queue is fair enough
    _hold(gw, "other", 5)
    gw.admit("alone", None)  # equal
    _hold(gw, "alone", 1)
    with pytest.raises(APIError) as info:
        gw.admit("alone", None)
    assert info.value.code == "fair_share_limit"
    gw.admit("other", None)


def test_a_late_event_loop_refuses_new_work_with_503() -> None:
    gw = _gateway()
    limit = gw.config.max_loop_lag
    assert limit > 0
    for i in range(5):  # behind on every tick of the last second
        gw.loop.record(i * 0.2, limit * 2)
    with pytest.raises(APIError) as info:
        gw.admit("c", None)
    assert info.value.status == 503 and info.value.code == "overloaded" and info.value.retry_after
    for i in range(5, 15):  # on time again: the window forgets the late ticks
        gw.loop.record(i * 0.2, 0.001)
    assert gw.loop.lag == pytest.approx(0.001)
    gw.admit("c", None)


def test_one_stall_is_not_overload_but_shows_in_the_lag_gauge() -> None:
    gw = _gateway()
    limit = gw.config.max_loop_lag
    ticks = [0.001] * 10 + [limit * 4] + [0.001] * 3  # one long stall among on-time ticks
    for i, overshoot in enumerate(ticks):
        gw.loop.record(i * 0.06, overshoot)
    assert gw.loop.lag == limit * 4  # /metrics still shows the worst tick
    gw.admit("c", None)


def test_a_loop_slower_than_the_window_keeps_three_ticks() -> None:
    gw = _gateway()
    for i in range(6):  # every tick 2 s late: the window would hold a single tick
        gw.loop.record(i * 2.0, 2.0)
    assert len(gw.loop._recent) == 3 and gw.loop.sustained == 2.0
    with pytest.raises(APIError):
        gw.admit("c", None)


def test_stalls_without_work_are_not_overload_even_two_ticks_apart() -> None:
    gw = _gateway()
    limit = gw.config.max_loop_lag
    for i in range(20):
        gw.loop.record(i * 0.05, 0.001, cpu=0.002)
    gw.loop.record(2.5, 1.5, cpu=0.001)  # stopped 1.5 s: late, but the loop's thread did no work
    gw.loop.record(4.0, 1.5, cpu=0.001)  # and again, one tick later: the window holds three ticks, two of them stalls
    assert gw.loop.lag == 1.5 and gw.loop.sustained < limit
    gw.admit("c", None)


def test_ticks_late_because_of_the_loops_own_work_are_overload() -> None:
    gw = _gateway()
    limit = gw.config.max_loop_lag
    for i in range(5):  # every tick late by twice the limit, the thread busy the whole time
        gw.loop.record(i * 0.2, limit * 2, cpu=limit * 2 + 0.05)
    assert gw.loop.sustained == limit * 2
    with pytest.raises(APIError) as info:
        gw.admit("c", None)
    assert info.value.code == "overloaded"


def test_the_busy_part_of_a_tick_is_at_most_its_cpu_time() -> None:
    gw = _gateway()
    limit = gw.config.max_loop_lag
    for i in range(5):  # late by 4 x the limit, half of it working (a host that gives the loop half a core)
        gw.loop.record(i * 0.2, limit * 4, cpu=limit * 2)
    assert gw.loop.sustained == limit * 2 and gw.loop.lag == limit * 4
