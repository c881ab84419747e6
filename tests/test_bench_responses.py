"""The Responses arms' recording (pure: event bytes in, recorder rows and verdict out)."""

from __future__ import annotations

import asyncio

import orjson

from tokenfan_bench.clients.recorder import to_samples
from tokenfan_bench.clients.responses import ResponseRecorder, ResponseSse, on_response_event
from tokenfan_bench.wire.http1 import ResponseHead


def events(deltas: list[str], final: str | None = None, terminal: str = "response.incomplete",
           reason: str | None = "max_output_tokens") -> list[bytes]:
    """A response's events as the gateway sends them with ``?tokenfan_timing=1``."""
    resp = {"status": "incomplete" if terminal == "response.incomplete" else "completed",
            "incomplete_details": {"reason": reason} if terminal == "response.incomplete" else None,
            "output": [], "usage": {"output_tokens": len(deltas)}}
    evs: list[dict] = [{"type": "response.created", "response": resp}, {"type": "response.in_progress", "response": resp},
                       {"type": "response.output_item.added"}, {"type": "response.content_part.added"}]
    evs += [{"type": "response.output_text.delta", "delta": d, "logprobs": []} for d in deltas]
    evs += [{"type": "response.output_text.done", "text": "".join(deltas) if final is None else final},
            {"type": "response.content_part.done"}, {"type": "response.output_item.done"},
            {"type": terminal, "response": resp}]
    for i, ev in enumerate(evs):
        ev["sequence_number"] = i
        ev["tokenfan"] = {"seq": i, "emit_ns": 1_000 * i, "sent_ns": 1_000 * i + 10}
    return [orjson.dumps(ev) for ev in evs]


def record(raw: list[bytes]) -> tuple[ResponseRecorder, list[bool]]:
    rec = ResponseRecorder(7, 0)
    return rec, [on_response_event(rec, 5_000 + 1_000 * i, ev) for i, ev in enumerate(raw)]


def test_a_whole_response_is_ok_and_only_text_deltas_are_content():
    rec, ends = record(events([" a", " b", " c"]))
    assert ends == [False] * 10 + [True] and rec.done and rec.error is None and rec.lost() == 0
    s = to_samples("resp-sse", [rec])
    assert s.ok.tolist() == [True] and s.content.sum() == 3 and s.live.all()
    assert (s.recv_ns - s.emit_ns)[s.content].tolist() == [5_000] * 3


def test_a_missing_event_a_changed_text_or_a_failure_fails_the_subscriber():
    raw = events([" a", " b", " c"])
    rec, _ = record(raw[:5] + raw[6:])  # one delta lost
    assert to_samples("resp-ws", [rec]).ok.tolist() == [False]
    rec, _ = record(events([" a", " b"], final=" a b c"))
    assert rec.error is not None and "final text" in rec.error
    rec, _ = record(events([" a"], reason="content_filter"))
    assert rec.error == "response.incomplete: content_filter"
    rec, ends = record([orjson.dumps({"type": "error", "code": "engine_unavailable", "sequence_number": 0})])
    assert ends == [True] and rec.error is not None and not rec.done
    rec, _ = record([orjson.dumps({"type": "response.created", "sequence_number": 0})])  # no ?tokenfan_timing=1
    assert rec.error is not None and "tokenfan timing" in rec.error


def test_the_sse_sink_decodes_events_split_across_reads():
    async def run() -> ResponseRecorder:
        rec = ResponseRecorder(1, 0)
        fut = asyncio.get_running_loop().create_future()
        sink = ResponseSse(rec, fut)
        wire = b"".join(b"event: x\ndata: %b\n\n" % ev for ev in events([" a", " b"]))
        sink.head(1, ResponseHead(200, {}))
        for i in range(0, len(wire), 97):
            sink.body(2 + i, wire[i:i + 97])
        sink.end(None)
        await fut
        return rec

    rec = asyncio.run(run())
    assert rec.done and rec.error is None and rec.lost() == 0 and len(rec.rows) == 10


def test_the_sse_sink_reports_an_http_error_with_its_body():
    async def run() -> ResponseRecorder:
        rec = ResponseRecorder(1, 0)
        sink = ResponseSse(rec, asyncio.get_running_loop().create_future())
        sink.head(1, ResponseHead(400, {}))
        sink.body(2, b'{"error":{"message":"unsupported_parameter"}}')
        sink.end(None)
        return rec

    rec = asyncio.run(run())
    assert rec.error is not None and "HTTP 400" in rec.error and "unsupported_parameter" in rec.error
