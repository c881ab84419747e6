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
    limit = getattr(gw.config, "max_loop_lag", 0.5)
    gw.loop.lag = limit * 2
    with pytest.raises(APIError) as info:
        gw._admit(None)
    assert info.value.status == 503 and info.value.code == "overloaded" and info.value.retry_after
    gw.loop.lag = 0.0
    gw._admit(None)
