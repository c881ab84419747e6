"""Responses text deltas from a byte template: the same bytes on every framing as the dict path.

The steady state of a streamed response (one ``response.output_text.delta`` per engine step) is rendered
from its message item's :class:`TextDeltaTemplate`; every other event, and the first delta of an item,
stays a dict. Each test runs a response through the real :class:`ResponseRenderer` and
:meth:`Stream.publish`, and a twin :class:`ResponseEvents` through the dict path only
(``ResponseEvents.delta`` for every step, as every text delta was rendered before the template), with the
same item ids and clock, and compares what each framing writes, byte for byte.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from engine_worker import protocol as p
from gateway.api.responses import events as response_events
from gateway.api.responses.events import ResponseEvents, response_from_events
from gateway.api.responses.render import ResponseRenderer
from gateway.api.responses.stream import RESPONSES_MERGE, RESPONSES_SSE, RESPONSES_SSE_TIMING, ResponsesWs
from gateway.api.responses.templates import TextDeltaTemplate
from gateway.core.framing import Framing
from gateway.core.merge import coalesce
from gateway.core.step import Step
from gateway.core.streams import ChunkEvent, Event, Stream

FRAMINGS: list[Framing] = [RESPONSES_SSE, RESPONSES_SSE_TIMING, ResponsesWs(), ResponsesWs("lane-1"),
                           ResponsesWs("lane-2", timing=True)]
# Text that JSON must escape, non-ASCII, what orjson leaves alone (U+2028, "</"), and empty steps.
TRICKY = ['"', "\\", "\n", "\r\n", "\t", "\x00", "\x01", "\x1f", "\x7f", "é", "日本語", "🙂", "👩‍👩‍👧", "\u2028\u2029",
          "</script>", "\\u0041", '{"delta":"x"}', " ", "", "", "a" * 300, "\ud7ff\ue000\uffff", "\U0010ffff"]
CREATED_AT, NOW = 1_700_000_000, 1_700_000_123.0


def fix_ids_and_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item ids from counters that start at 0 (called again before the twin: the same ids) and a fixed
    ``completed_at``."""
    counters: dict[str, itertools.count[int]] = {}

    def new_item_id(prefix: str = "msg") -> str:
        return f"{prefix}_{next(counters.setdefault(prefix, itertools.count())):032x}"

    monkeypatch.setattr(response_events, "new_item_id", new_item_id)
    monkeypatch.setattr(response_events, "time", SimpleNamespace(time=lambda: NOW))


@pytest.fixture(autouse=True)
def fixed_ids_and_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    fix_ids_and_clock(monkeypatch)


def deltas(texts: list[str], finish: str = "stop") -> list[p.Delta]:
    out = [p.Delta("r", i, t, 1, 1_000 + i) for i, t in enumerate(texts)]
    last = out[-1]
    out[-1] = p.Delta("r", last.seq, last.text, 1, last.emit_ns, finish, p.Usage(5, len(texts)))
    return out


def templated(ds: list[p.Delta]) -> tuple[Stream, ResponseEvents]:
    """The response through the real renderer and stream (one engine step per delta)."""
    events = ResponseEvents("resp_1", "m", created_at=CREATED_AT)
    renderer = ResponseRenderer(events)
    stream = Stream("resp_1", "responses", "m")
    for ev in renderer.opening():
        stream.publish(ev, Step(0.0, 7))
    for i, d in enumerate(ds):
        for ev in renderer.step(d):
            stream.publish(ev, Step(float(i), 10_000 + i))
    return stream, events


def dict_path(ds: list[p.Delta]) -> list[dict[str, Any]]:
    """The same response's events as dicts (a fresh id counter: the same ids as the templated twin's)."""
    events = ResponseEvents("resp_1", "m", created_at=CREATED_AT)
    out = events.start()
    for d in ds:
        out += events.delta(d.text)
    return out + events.finish(ds[-1].finish_reason, ds[-1].usage)


def assert_same_bytes(stream: Stream, payloads: list[dict[str, Any]]) -> None:
    assert len(stream.events) == len(payloads)
    for ev, pl in zip(stream.events, payloads, strict=True):
        twin = Event(ev.seq, pl, ev.timing, ev.text, ev.finish_reason)  # same timing object: same frame
        assert ev.json == orjson.dumps(pl), ev
        for framing in FRAMINGS:
            assert framing.build(ev) == framing.build(twin), (framing.name, ev)


def test_text_deltas_from_the_template_are_the_dict_paths_bytes_on_every_framing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [*TRICKY, *(f"w{i} " for i in range(1200))]  # sequence numbers past 9, 99 and 999
    ds = deltas(texts)
    stream, events = templated(ds)
    fix_ids_and_clock(monkeypatch)  # the twin's ids from 0 again
    payloads = dict_path(ds)
    assert_same_bytes(stream, payloads)
    kinds = [type(ev.template).__name__ if ev.template else ev.payload["type"] for ev in stream.events]
    # the first delta opens the item and the last ends the response (dicts); every other non-empty step
    # is the template
    assert kinds.count("TextDeltaTemplate") == len([t for t in texts if t]) - 2
    assert stream.events[-1].seq == payloads[-1]["sequence_number"] > 1000
    assert [ev.payload for ev in stream.events] == payloads  # what GET, merges and the broker parse
    assert response_from_events(ev.payload for ev in stream.events) == events.response()


@pytest.mark.parametrize("seed", range(5))
def test_random_text_and_lengths_render_the_same_bytes(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in (*range(0x80), 0xA0, 0xE9, 0x2028, 0x4E2D, 0xFFFD, 0x1F642)]
    texts = ["".join(rng.choices(alphabet, k=rng.choice((0, 1, 2, 5, 40)))) for _ in range(300)]
    texts[0] = texts[0] or "x"
    ds = deltas(texts, rng.choice(("stop", "length")))
    stream, _ = templated(ds)
    fix_ids_and_clock(monkeypatch)
    assert_same_bytes(stream, dict_path(ds))


def chat_chunk(delta: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """A chunk of vLLM's layer (its chat stream generator's shape)."""
    c: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                         "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    if usage is not None:
        c["usage"] = usage
    return c


def test_content_chunks_of_vllms_layer_take_the_template_with_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under vLLM's layer (tools, parsers) a chunk of only content is a template delta too; reasoning, tool
    calls, a chunk with content and reasoning at once and usage keep the dict path, in the same order."""
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12,
             "completion_tokens_details": {"reasoning_tokens": 2}}
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    chunks = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"reasoning": "think"}),
              *(chat_chunk({"content": t}) for t in TRICKY), chat_chunk({"reasoning": "more", "content": "a"}),
              chat_chunk({"content": "b"}), chat_chunk({"content": "c"}, usage),
              chat_chunk({"tool_calls": [call]}), chat_chunk({"content": "after"}), chat_chunk({"content": "!"}),
              {**chat_chunk({}), "choices": [], "usage": usage}]
    ds = [p.Delta("r", i, "", 1, 1_000 + i, None, None, orjson.dumps(c)) for i, c in enumerate(chunks)]
    ds.append(p.Delta("r", len(ds), "", 0, 9_000, "stop", p.Usage(3, 9), orjson.dumps(chat_chunk({}))))
    stream, events = templated(ds)
    fix_ids_and_clock(monkeypatch)
    twin = ResponseEvents("resp_1", "m", created_at=CREATED_AT)
    payloads = twin.start()
    for d in ds:
        payloads += twin.chunk(orjson.loads(d.chunk))
    payloads += twin.finish("stop", ds[-1].usage)
    assert_same_bytes(stream, payloads)
    templated_texts = [ev.text for ev in stream.events if ev.template is not None]
    assert templated_texts == [t for t in TRICKY[1:] if t] + ["b", "!"]
    assert response_from_events(ev.payload for ev in stream.events) == twin.response() == events.response()


def test_every_rendered_delta_is_an_sdk_event_with_its_sequence_number() -> None:
    stream, _ = templated(deltas(["Hello", ", ", 'wo"rld', "\n", "!"]))
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_json(ev.json) for ev in stream.events]
    assert [e.sequence_number for e in parsed] == list(range(len(stream.events)))
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == 'Hello, wo"rld\n!'
    assert parsed[-1].type == "response.completed"


def test_a_lagging_reader_gets_the_same_merged_events_from_templated_deltas(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = deltas(["a", "é", '"', "", "\n", "z"] * 5)
    stream, _ = templated(ds)
    fix_ids_and_clock(monkeypatch)
    twins = [Event(ev.seq, pl, ev.timing, ev.text, ev.finish_reason)
             for ev, pl in zip(stream.events, dict_path(ds), strict=True)]
    merged, merged_twins = coalesce(stream.events, RESPONSES_MERGE), coalesce(twins, RESPONSES_MERGE)
    assert [(e.seq, e.payload) for e in merged] == [(e.seq, e.payload) for e in merged_twins]
    assert any(e.timing.get("coalesced", 1) > 1 for e in merged)


def test_text_delta_takes_only_the_steps_that_add_one_event_to_an_open_message() -> None:
    events = ResponseEvents("resp_1", "m")
    events.start()
    assert events.text_delta("Hi") is None  # no item yet: delta() adds the item, its part and the delta
    first = events.delta("Hi")
    assert [e["type"] for e in first] == ["response.output_item.added", "response.content_part.added",
                                          "response.output_text.delta"]
    seq = events.seq
    assert events.text_delta("") is None and events.seq == seq  # nothing generated: no event, no number
    got = events.text_delta(" there")
    assert got is not None and got[1] == seq and events.seq == seq + 1
    assert isinstance(got[0], TextDeltaTemplate) and events.text_delta("!") == (got[0], seq + 1)
    assert events.text == "Hi there!"
    events.reasoning("hmm")  # another item kind is open: the dict path closes it first
    assert events.text_delta("x") is None


def test_a_payload_published_at_another_seq_than_it_names_is_refused() -> None:
    stream = Stream("resp_1", "responses", "m")
    template = TextDeltaTemplate("msg_1", 0)
    with pytest.raises(ValueError, match="numbered 3 published at seq 0"):
        stream.publish(ChunkEvent(None, 1, "x", 1, template=template, seq=3))
    stream.publish(ChunkEvent(None, 1, "x", 1, template=template, seq=0))
    assert stream.events[0].payload["sequence_number"] == 0
