"""Client-side helpers for e2e tests: SSE parsing and metric scraping with real clients."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import httpx


def sse_events(text: str) -> list[dict[str, str]]:
    """Parse an SSE body into events ({"id","event","data"}); comments skipped."""
    events = []
    for block in text.split("\n\n"):
        ev: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            ev[key] = ev.get(key, "") + value if key == "data" and key in ev else value
        if ev:
            events.append(ev)
    return events


def chunk_text(chunk: dict) -> str:
    if not chunk.get("choices"):
        return ""
    c = chunk["choices"][0]
    return c["delta"].get("content") or "" if "delta" in c else c.get("text") or ""


def metric(url: str, name: str, labels: str = "") -> float:
    body = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def engine_load(url: str) -> tuple[int, int]:
    eng = httpx.get(url + "/health").json()["engine"]
    return eng["running"], eng["waiting"]


def data_json(ev: dict[str, str]) -> dict:
    return json.loads(ev["data"])
