"""Admission (pure state, no engine): total and per-key concurrency, and the event-loop lag guard."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.state import Gateway


def _gateway(**config: Any) -> Gateway:
    cfg = GatewayConfig()
    for k, v in config.items():
        setattr(cfg, k, v)
    return Gateway(config=cfg, engine=None)  # type: ignore[arg-type]  # admission never touches the engine


def test_total_and_per_key_limits_refuse_with_429_and_free_on_release() -> None:
    gw = _gateway(max_concurrent=3, max_concurrent_per_key=2)
    for key in ("a", "a", "b"):
        gw._admit(key)
        gw.active[key] += 1
    with pytest.raises(APIError) as info:
        gw._admit("c")
    assert info.value.status == 429 and info.value.code == "too_many_requests" and info.value.retry_after
    gw._release("b")
    with pytest.raises(APIError):
        gw._admit("a")  # per key: "a" already has 2
    gw._admit("c")
    assert "b" not in gw.active


def test_a_late_event_loop_refuses_new_work_with_503() -> None:
    gw = _gateway()
    limit = gw.config.max_loop_lag
    assert limit > 0
    for i in range(5):  # behind on every tick of the last second
        gw.loop.record(i * 0.2, limit * 2)
    with pytest.raises(APIError) as info:
        gw._admit(None)
    assert info.value.status == 503 and info.value.code == "overloaded" and info.value.retry_after
    for i in range(5, 15):  # on time again: the window forgets the late ticks
        gw.loop.record(i * 0.2, 0.001)
    assert gw.loop.lag == pytest.approx(0.001)
    gw._admit(None)


def test_one_stall_is_not_overload_but_shows_in_the_lag_gauge() -> None:
    gw = _gateway()
    limit = gw.config.max_loop_lag
    ticks = [0.001] * 10 + [limit * 4] + [0.001] * 3  # one long stall among on-time ticks
    for i, overshoot in enumerate(ticks):
        gw.loop.record(i * 0.06, overshoot)
    assert gw.loop.lag == limit * 4  # /metrics still shows the worst tick
    gw._admit(None)


def test_a_loop_slower_than_the_window_keeps_three_ticks() -> None:
    gw = _gateway()
    for i in range(6):  # every tick 2 s late: the window would hold a single tick
        gw.loop.record(i * 2.0, 2.0)
    assert len(gw.loop._recent) == 3 and gw.loop.sustained == 2.0
    with pytest.raises(APIError):
        gw._admit(None)
