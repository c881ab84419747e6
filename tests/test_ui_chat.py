"""The AI SDK chat API's pure parts: UI messages -> chat messages, engine deltas -> UI parts, the framing."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from engine_worker import protocol as p
from gateway.api.chat_request import parse_request
from gateway.api.ui_chat.convert import chat_turn
from gateway.api.ui_chat.framing import UI_MERGE, UI_MESSAGE_SSE
from gateway.api.ui_chat.render import UiMessageRenderer
from gateway.api.validation import Limits
from gateway.core.merge import coalesce
from gateway.core.streams import Event, Stream
from gateway.errors import APIError


def user(text: str, mid: str = "u1") -> dict[str, Any]:
    return {"id": mid, "role": "user", "parts": [{"type": "text", "text": text}]}


def delta(text: str = "", finish: str | None = None, chunk: dict[str, Any] | None = None) -> p.Delta:
    return p.Delta(request_id="r", seq=0, text=text, token_count=1, emit_ns=1, finish_reason=finish,
                   chunk=orjson.dumps(chunk) if chunk is not None else b"")


def parts(events: list[Any]) -> list[dict[str, Any]]:
    return [orjson.loads(e.template.render(e.text)) if e.payload is None else e.payload for e in events]


def test_a_tool_loop_turn_becomes_assistant_tool_calls_then_tool_messages() -> None:
    body = {"id": "c1", "trigger": "submit-message", "messageId": None, "max_tokens": 9, "system": "Be terse.",
            "messages": [user("Weather in Paris?"), {"id": "a1", "role": "assistant", "parts": [
                {"type": "step-start"}, {"type": "reasoning", "text": "Need the tool."},
                {"type": "tool-get_weather", "toolCallId": "call1", "state": "output-available",
                 "input": {"city": "Paris"}, "output": {"celsius": 18}},
                {"type": "step-start"}, {"type": "text", "text": "18 C."}]}]}
    turn = chat_turn(body)
    assert turn.chat_id == "c1" and turn.message_id == "a1"  # the assistant message is continued
    assert turn.body["max_tokens"] == 9 and turn.body["stream"] is True
    assert "id" not in turn.body and "trigger" not in turn.body and "system" not in turn.body
    assert turn.body["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning": "Need the tool.", "tool_calls": [
            {"id": "call1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call1", "content": '{"celsius":18}'},
        {"role": "assistant", "content": "18 C."}]
    assert parse_request("chat.completions", turn.body, Limits()).stream


def test_a_new_question_gets_a_new_message_id() -> None:
    assert chat_turn({"id": "c", "messages": [user("hi")]}).message_id.startswith("msg-")


@pytest.mark.parametrize(("part", "param", "code"), [
    ({"type": "file", "mediaType": "image/png", "url": "data:,"}, "messages[0].parts[1]", "unsupported_parameter"),
    ({"type": "custom-thing"}, "messages[0].parts[1]", "unsupported_parameter"),
    ({"type": "text", "text": 3}, "messages[0].parts[1].text", "invalid_value"),
])
def test_refused_user_parts_name_the_part(part: dict[str, Any], param: str, code: str) -> None:
    msg = user("look")
    msg["parts"].append(part)
    with pytest.raises(APIError) as exc:
        chat_turn({"id": "c", "messages": [msg]})
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, param, code)


def test_a_tool_call_without_output_is_refused() -> None:
    msg = {"id": "a", "role": "assistant", "parts": [{"type": "tool-x", "toolCallId": "t", "state": "input-available",
                                                      "input": {}}]}
    with pytest.raises(APIError) as exc:
        chat_turn({"id": "c", "messages": [user("q"), msg]})
    assert exc.value.param == "messages[1].parts[0].state"


def test_settings_are_validated_as_chat_completions() -> None:
    turn = chat_turn({"id": "c", "messages": [user("q")], "temperature": 7})
    with pytest.raises(APIError) as exc:
        parse_request("chat.completions", turn.body, Limits())
    assert exc.value.param == "temperature"


def test_plain_text_deltas_render_the_streamtext_part_order() -> None:
    r = UiMessageRenderer("m1", openai=False)
    out = parts(r.opening() + r.step(delta("Hel")) + r.step(delta("lo")) + r.step(delta("!", "stop")))
    assert out == [{"type": "start", "messageId": "m1"}, {"type": "start-step"},
                   {"type": "text-start", "id": "text-0"}, {"type": "text-delta", "id": "text-0", "delta": "Hel"},
                   {"type": "text-delta", "id": "text-0", "delta": "lo"},
                   {"type": "text-delta", "id": "text-0", "delta": "!"}, {"type": "text-end", "id": "text-0"},
                   {"type": "finish-step"}, {"type": "finish", "finishReason": "stop"}]
    assert r.closing(None) == []  # finished: a late cancel adds nothing


def test_vllm_chunks_render_reasoning_then_text_then_the_tool_call() -> None:
    def chunk(finish: str | None = None, **d: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    r = UiMessageRenderer("m", openai=True)
    call = {"index": 0, "id": "call9", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    steps = [chunk(reasoning="hm"), chunk(content="Ok."), chunk(tool_calls=[call]),
             chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
             chunk("tool_calls", tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}])]
    out = [part for c in steps[:-1] for part in parts(r.step(delta(chunk=c)))]
    out += parts(r.step(delta(chunk=steps[-1], finish="stop")))
    assert [x["type"] for x in out] == [
        "reasoning-start", "reasoning-delta", "reasoning-end", "text-start", "text-delta", "text-end",
        "tool-input-start", "tool-input-delta", "tool-input-delta", "tool-input-available", "finish-step", "finish"]
    assert out[-3] == {"type": "tool-input-available", "toolCallId": "call9", "toolName": "get_weather",
                       "input": {"city": "Oslo"}}
    assert out[-1]["finishReason"] == "tool-calls"  # the chunk's reason, not the engine's "stop"


def test_a_failure_is_an_error_part_and_the_ending_adds_none_then() -> None:
    r = UiMessageRenderer("m", openai=False)
    s = Stream(id="s", endpoint="ui_chat", model="x")
    for ev in r.opening() + r.step(delta("partial")):
        s.publish(ev)
    err = APIError(503, "Service unavailable: engine gone.", code="engine_unavailable")
    for ev in r.closing(err):
        s.publish(ev)
    s.finish("error", err)
    assert s.events[-1].payload == {"type": "error", "errorText": "Service unavailable: engine gone."}
    assert UI_MESSAGE_SSE.ending(s).frame == b"data: [DONE]\n\n"


def test_a_mirror_that_ends_in_error_without_the_part_gets_one_from_the_framing() -> None:
    s = Stream(id="s", endpoint="ui_chat", model="x")
    s.publish(UiMessageRenderer("m", openai=False).opening()[0])
    s.finish("error", APIError(502, "owner gone", code="owner_lost"))
    assert UI_MESSAGE_SSE.ending(s).frame == b'data: {"type":"error","errorText":"owner gone"}\n\ndata: [DONE]\n\n'


def test_a_lagging_reader_gets_text_deltas_of_one_part_merged_and_nothing_else() -> None:
    def ev(seq: int, payload: dict[str, Any]) -> Event:
        return Event(seq, payload, None, payload.get("delta", ""), None)

    events = [ev(0, {"type": "text-start", "id": "t"}), ev(1, {"type": "text-delta", "id": "t", "delta": "a"}),
              ev(2, {"type": "text-delta", "id": "t", "delta": "b"}), ev(3, {"type": "text-end", "id": "t"})]
    merged = coalesce(events, UI_MERGE)
    assert [e.payload for e in merged] == [{"type": "text-start", "id": "t"},
                                           {"type": "text-delta", "id": "t", "delta": "ab"},
                                           {"type": "text-end", "id": "t"}]
    assert merged[1].seq == 2


@pytest.mark.parametrize("cut", range(1, 9))
def test_a_renderer_rebuilt_from_the_log_continues_the_answer_as_if_uninterrupted(cut: int) -> None:
    """Adoption (gateway.api.adoption): the parts written so far fold back into a renderer whose parts for the
    rest, appended, equal an uninterrupted run's (the same message id, part ids, open text part)."""
    chunks = [delta(chunk={"choices": [{"index": 0, "delta": d}]}) for d in (
        {"reasoning": "Think"}, {"reasoning": "ing."}, {"content": "Hel"}, {"content": "lo"},
        {"reasoning": " more"}, {"content": " there"}, {"content": "."})]
    steps = [*chunks, delta(finish="stop", chunk={"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})]

    def run(r: UiMessageRenderer, ds: list[p.Delta]) -> list[dict[str, Any]]:
        return parts([e for d in ds for e in r.step(d)])

    whole = UiMessageRenderer("msg-1", openai=True)
    control = parts(whole.opening()) + run(whole, steps)
    first = UiMessageRenderer("msg-1", openai=True)
    before = parts(first.opening()) + run(first, steps[:cut])
    rest = run(UiMessageRenderer.from_log(before, openai=True), steps[cut:])
    assert before + rest == control
