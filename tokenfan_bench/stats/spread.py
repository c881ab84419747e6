"""Fan-out accounting (``tokenfan bench fanout``), pure: per-event receipt tallies in, spread and delivery out.

A client process keeps, per stream and per ``seq``, one :data:`Tally` row ``[count, first_ns, last_ns]``: how
many of its subscribers got that event and the earliest and latest receipt (``time.monotonic_ns()``, one
clock for every process of the machine). :func:`merge` folds the processes' rows; the *spread* of an
event is ``last_ns - first_ns`` over every subscriber of every process: how long after the first
subscriber had it the last one got it. :func:`window_spread` summarizes the events whose first receipt
fell in the measured window, when every subscriber was connected and live.

Delivery is checked per subscriber (:class:`Outcome`): it must have every event of its stream from seq 0
to the stream's last, each once and in order, and the stream's end. Slow subscribers (made slow on
purpose) are excluded from the spread and reported apart: cut (the gateway's ``slow_consumer``) or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

Tally = dict[int, list[int]]  # seq -> [count, first_ns, last_ns]


def add_receipt(tally: Tally, seq: int, t_ns: int) -> None:
    """One subscriber got event ``seq`` at ``t_ns``."""
    row = tally.get(seq)
    if row is None:
        tally[seq] = [1, t_ns, t_ns]
        return
    row[0] += 1
    if t_ns < row[1]:
        row[1] = t_ns
    elif t_ns > row[2]:
        row[2] = t_ns


def merge(tallies: list[Tally]) -> Tally:
    """The rows of several processes (of one stream) as one."""
    out: Tally = {}
    for tally in tallies:
        for seq, (n, first, last) in tally.items():
            row = out.get(seq)
            if row is None:
                out[seq] = [n, first, last]
            else:
                row[0] += n
                row[1] = min(row[1], first)
                row[2] = max(row[2], last)
    return out


def window_spread(tally: Tally, t0_ns: int, t1_ns: int, subscribers: int) -> dict[str, Any]:
    """Spread (ms) of the events first received in ``[t0_ns, t1_ns)``: n, p50, p99, max; ``complete``: how
    many of them every one of ``subscribers`` got (the spread of one some missed would be too short)."""
    rows = [r for r in tally.values() if t0_ns <= r[1] < t1_ns]
    spreads = np.array([(r[2] - r[1]) / 1e6 for r in rows], dtype=np.float64)
    deliveries = sum(r[0] for r in rows)
    if not len(spreads):
        return {"events": 0, "complete": 0, "deliveries": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"events": len(rows), "complete": sum(1 for r in rows if r[0] == subscribers), "deliveries": deliveries,
            "p50_ms": float(np.percentile(spreads, 50)), "p99_ms": float(np.percentile(spreads, 99)),
            "max_ms": float(spreads.max())}


@dataclass(slots=True)
class Outcome:
    """What one subscriber got: the first and last seq, how many events, gaps and repeats, how it ended
    (``done``: the stream's end; ``cut``: the gateway's slow-consumer cut; ``error``: another error event;
    ``lost``: the connection closed without an end; ``failed``: it never subscribed) and whether it was
    one of the deliberately slow ones."""

    stream: int
    transport: str
    slow: bool
    first: int = -1
    last: int = -1
    received: int = 0
    gaps: int = 0
    repeats: int = 0
    end: str = "lost"
    detail: str = ""

    def got(self, seq: int) -> None:
        if self.first < 0:
            self.first = seq
        elif seq <= self.last:
            self.repeats += 1
            return
        elif seq > self.last + 1:
            self.gaps += seq - self.last - 1
        self.last = seq
        self.received += 1

    def as_row(self) -> tuple[Any, ...]:
        return (self.stream, self.transport, self.slow, self.first, self.last, self.received, self.gaps,
                self.repeats, self.end, self.detail)


def delivery(outcomes: list[tuple[Any, ...]], events_per_stream: dict[int, int]) -> dict[str, Any]:
    """Every subscriber that is not slow must have had all ``events_per_stream[stream]`` events (seq 0 to the
    last), once each, then its end. Counts: ``expected`` and ``delivered`` events, subscribers ``complete``,
    and the first few that were not (with why)."""
    fast = [Outcome(*row) for row in outcomes if not row[2]]
    slow = [Outcome(*row) for row in outcomes if row[2]]
    expected = sum(events_per_stream.get(o.stream, 0) for o in fast)
    short: list[dict[str, Any]] = []
    for o in fast:
        n = events_per_stream.get(o.stream, 0)
        ok = o.first == 0 and o.last == n - 1 and o.received == n and not o.gaps and not o.repeats and o.end == "done"
        if not ok:
            short.append({"stream": o.stream, "transport": o.transport, "first": o.first, "last": o.last,
                          "received": o.received, "of": n, "gaps": o.gaps, "repeats": o.repeats, "end": o.end,
                          "detail": o.detail})
    return {"subscribers": len(fast), "complete": len(fast) - len(short), "expected_events": expected,
            "delivered_events": sum(min(o.received, events_per_stream.get(o.stream, 0)) for o in fast),
            "incomplete": len(short), "incomplete_examples": short[:5],
            "slow": {"subscribers": len(slow), "cut": sum(1 for o in slow if o.end == "cut"),
                     "done": sum(1 for o in slow if o.end == "done"),
                     "other": sum(1 for o in slow if o.end not in ("cut", "done"))}}
