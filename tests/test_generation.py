"""Engine deltas -> OpenAI chunks and Responses events: one chunk per engine step, no token uncounted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from engine_worker import protocol as p
from gateway.api.chat_render import chunk_events
from gateway.api.chat_request import ChunkBuilder
from gateway.api.responses.events import ResponseEvents
from gateway.api.responses.render import ResponseRenderer
from gateway.core.streams import ChunkEvent

USAGE = p.Usage(prompt_tokens=3, completion_tokens=4)
# A byte-fallback token whose text the detokenizer holds back, then the token completing it.
DELTAS = [p.Delta("r", 0, "Hi", 1, 1), p.Delta("r", 1, "", 1, 2), p.Delta("r", 2, "é", 1, 3),
          p.Delta("r", 3, " x", 1, 4, "length", USAGE)]


class Handle:
    openai = False

    async def deltas(self, idle: float | None = None) -> AsyncIterator[p.Delta | None]:
        for d in DELTAS:
            yield d


async def collect(it: AsyncIterator[Any]) -> list[Any]:
    return [x async for x in it]


def test_a_held_back_step_is_an_empty_chunk_as_vllm_serve_sends_it() -> None:
    builder = ChunkBuilder("chat.completions", "chatcmpl-1", "m", include_usage=True)
    events: list[ChunkEvent] = asyncio.run(collect(chunk_events(Handle(), builder)))  # type: ignore[arg-type]
    deltas = [ev.parsed["choices"][0]["delta"] if ev.parsed["choices"] else None for ev in events]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": ""}, {"content": "é"},
                      {"content": " x"}, None]
    assert sum(ev.tokens for ev in events) == USAGE.completion_tokens
    assert events[-1].parsed["usage"]["completion_tokens"] == USAGE.completion_tokens


def test_responses_send_no_empty_delta_but_count_its_tokens() -> None:
    renderer = ResponseRenderer(ResponseEvents("resp_1", "m"))
    out: list[ChunkEvent] = renderer.opening() + [ev for d in DELTAS for ev in renderer.step(d)]
    deltas = [ev.parsed["delta"] for ev in out if ev.parsed["type"] == "response.output_text.delta"]
    assert deltas == ["Hi", "é", " x"]
    assert sum(ev.tokens for ev in out) == USAGE.completion_tokens
    assert out[-1].parsed["type"] == "response.incomplete"


def test_a_response_is_continuable_in_the_pass_that_finishes_it_before_its_last_events() -> None:
    """The transcript (``previous_response_id``) is kept before ``response.completed`` can reach a reader, so a
    client that continues at once, here or on another replica, never gets ``previous_response_not_found``."""
    events = ResponseEvents("resp_1", "m")
    seen: list[list[dict[str, Any]]] = []
    renderer = ResponseRenderer(events, lambda: seen.append(events.turn()))
    renderer.opening()
    for d in DELTAS[:-1]:
        renderer.step(d)
    assert seen == []
    last = renderer.step(DELTAS[-1])
    assert len(seen) == 1 and last[-1].parsed["type"] == "response.incomplete"
    assert seen[0] == events.turn()


class EngineChunks:
    """A request the engine served with vLLM's OpenAI layer: whole chunks, then the end delta."""

    openai = True

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self.items = [p.Delta("r", i, "", 1, 10 + i, chunk=orjson.dumps(c)) for i, c in enumerate(chunks)]
        self.items.append(p.Delta("r", len(chunks), "", 0, 99, "stop", USAGE))

    async def deltas(self, idle: float | None = None) -> AsyncIterator[p.Delta | None]:
        for d in self.items:
            yield d


def test_engine_chunks_pass_through_unchanged() -> None:
    """Tool-call, reasoning and logprob deltas are vllm serve's own chunks: the gateway adds nothing."""
    tool = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"ci"}}]},
         "logprobs": None, "finish_reason": None}]}
    text = {"id": "chatcmpl-1", "choices": [{"index": 1, "delta": {"content": "hé"}, "finish_reason": "stop"}]}
    usage = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3}}
    builder = ChunkBuilder("chat.completions", "chatcmpl-1", "m", include_usage=True)
    events = asyncio.run(collect(chunk_events(EngineChunks([tool, text, usage]), builder)))  # type: ignore[arg-type]
    assert [e.parsed for e in events] == [tool, text, usage]
    assert [(e.text, e.finish_reason, e.tokens, e.emit_ns) for e in events] == [
        ("", None, 1, 10), ("hé", "stop", 1, 11), ("", None, 1, 12)]
