"""What one subscriber saw: :class:`Recorder` (one row per received chunk, with its receive time) and
its conversion to :class:`~tokenfan_bench.stats.metrics.ArmSamples`.

Both clients (``--client python`` and ``fast``) record through :func:`on_sse_event` and
:func:`on_ws_message`, so they agree on what counts as a chunk, a normal end and an error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenfan_bench.stats.metrics import ArmSamples
from tokenfan_bench.wire.events import ChunkSample, SseEvent, chunk_sample, decode_ws, sample_sse


class Recorder:
    """Everything one subscriber saw: one row per chunk, ``(recv_ns, sample)``."""

    __slots__ = ("connected_ns", "done", "error", "post_ns", "rows", "stream")

    def __init__(self, stream: int, post_ns: int) -> None:
        self.stream, self.post_ns, self.connected_ns = stream, post_ns, 0
        self.done = False
        self.error: str | None = None
        self.rows: list[tuple[int, ChunkSample]] = []

    def add(self, recv_ns: int, chunk: dict[str, Any]) -> None:
        """Record an already decoded chunk."""
        self.rows.append((recv_ns, chunk_sample(chunk)))

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why

    @property
    def events(self) -> int:
        return len(self.rows)

    def lost(self) -> int:
        """Events missing: the last ``seq`` + 1 minus the deltas received (a coalesced event counts
        for every delta it carries)."""
        if not self.rows:
            return 0
        return self.rows[-1][1].seq + 1 - sum(s.deltas for _, s in self.rows)


def on_sse_event(rec: Recorder, recv_ns: int, ev: SseEvent) -> None:
    if ev.data == b"[DONE]":
        rec.done = True
    elif ev.event == "message":
        rec.rows.append((recv_ns, sample_sse(ev.data)))
    else:  # "error", or "end" (cancelled): the stream did not finish normally
        rec.fail(f"SSE event {ev.event}: {ev.data[:400]!r}")  # long enough for an error's code


def on_ws_message(rec: Recorder, recv_ns: int, raw: bytes | str) -> None:
    msg, sample = decode_ws(raw)
    if sample is not None:
        rec.rows.append((recv_ns, sample))
    elif msg.type == "done" and msg.reason is None:
        rec.done = True
    else:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        rec.fail(f"WS {msg.type}: {text[:400]}")  # long enough for an error's code


def to_samples(transport: str, recs: list[Recorder]) -> ArmSamples:
    a = ArmSamples(transport)
    n = [len(r.rows) for r in recs]
    rows = [(t, *s[:5]) for r in recs for t, s in r.rows]  # recv, seq, emit, sent, deltas, content
    m = np.array(rows, np.int64).reshape(-1, 6)
    a.stream = np.repeat(np.array([r.stream for r in recs], np.int64), n)
    a.recv_ns, a.seq, a.emit_ns, a.sent_ns, a.deltas = (np.ascontiguousarray(m[:, i]) for i in range(5))
    a.content = m[:, 5].astype(bool)
    migrated = [s.migrated for r in recs for _, s in r.rows]
    if any(migrated):
        a.migrated = np.array(migrated, bool)
    a.sub_stream = np.array([r.stream for r in recs], np.int64)
    a.post_ns = np.array([r.post_ns for r in recs], np.int64)
    a.connected_ns = np.array([r.connected_ns for r in recs], np.int64)
    a.live = a.emit_ns >= np.repeat(a.connected_ns, n)
    lost = np.array([r.lost() for r in recs], np.int64)
    a.ok = np.array([r.done and r.error is None for r in recs], bool) & (lost == 0)
    a.errors = [r.error for r in recs if r.error] + [f"lost {k} events" for k in lost if k]
    return a
