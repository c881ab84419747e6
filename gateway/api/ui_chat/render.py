"""Engine deltas -> UI message stream parts (a :class:`gateway.core.generation.Renderer`).

The parts and their order are those ``streamText(...).toUIMessageStream()`` writes for one step
(``ai`` 7.0.173: ``src/ui-message-stream/ui-message-chunks.ts`` for the shapes,
``src/ui-message-stream/to-ui-message-stream.ts`` for the order)::

    start {messageId}   start-step
    reasoning-start / reasoning-delta* / reasoning-end          (vLLM's reasoning parser: delta.reasoning)
    text-start / text-delta* / text-end                         (delta.content, or the plain path's text)
    tool-input-start / tool-input-delta* / tool-input-available (delta.tool_calls, vLLM's tool parser)
    finish-step   finish {finishReason}

``start`` and ``start-step`` are appended when the generation starts, so a reader that resumes at once
already learns the message id. A failure appends ``error`` {errorText}, a cancel ``abort``: the log holds
them, so every reader (resumed, on another replica) sees the same end. Text and reasoning deltas render
from a byte template per part (:class:`DeltaTemplate`): only the text is spliced in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from engine_worker import protocol as p
from gateway.core.streams import ChunkEvent
from gateway.errors import APIError

Kind = Literal["text", "reasoning"]

# OpenAI finish_reason -> the SDK's FinishReason (src/types/language-model.ts)
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool-calls", "function_call": "tool-calls",
                  "content_filter": "content-filter", "error": "error"}


class DeltaTemplate:
    """A ``text-delta`` or ``reasoning-delta`` part of one part id as bytes with a hole for the text."""

    __slots__ = ("prefix",)

    def __init__(self, kind: Kind, part_id: str) -> None:
        self.prefix = b'{"type":"%b-delta","id":%b,"delta":' % (kind.encode(), orjson.dumps(part_id))

    def render(self, text: str, seq: int = 0) -> bytes:
        """The part carrying ``text`` (a part does not number itself: ``seq`` is not in it)."""
        return self.prefix + orjson.dumps(text) + b"}"


@dataclass(slots=True)
class _Call:
    """A tool call being streamed (by its index in the chunks' ``tool_calls``)."""

    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class UiMessageRenderer:
    """One generation's UI message parts (see the module doc). ``openai``: the engine serves the request with
    vLLM's layer and each delta carries its chat chunk; else each delta's text is answer text."""

    def __init__(self, message_id: str, openai: bool) -> None:
        self.message_id = message_id
        self.openai = openai
        self.open: Kind | None = None  # the text or reasoning part being written
        self.template: DeltaTemplate | None = None
        self.parts = 0  # part ids issued
        self.calls: dict[int, _Call] = {}
        self.finish_reason: str | None = None  # the chunks' own (``tool_calls`` where the delta says ``stop``)
        self.done = False
        self.held = 0  # tokens of steps that added no part, counted with the next one

    @classmethod
    def from_log(cls, payloads: Iterable[dict[str, Any]], openai: bool) -> UiMessageRenderer:
        """The renderer of the rest of an answer whose parts so far are ``payloads`` (a stream adopted from
        its log: :mod:`gateway.api.adoption`): the same message id, part ids continuing, the open part open."""
        r = cls("", openai)
        for part in payloads:
            kind = part.get("type", "")
            if kind == "start":
                r.message_id = part.get("messageId", "")
            elif kind in ("text-start", "reasoning-start"):
                r.open = kind.removesuffix("-start")  # type: ignore[assignment]
                r.template = DeltaTemplate(r.open, part["id"])  # type: ignore[arg-type]
                r.parts += 1
            elif kind in ("text-end", "reasoning-end"):
                r.open = r.template = None
            elif kind in ("finish", "error", "abort"):
                r.done = True
        return r

    def opening(self) -> list[ChunkEvent]:
        now = p.now_ns()
        return [ChunkEvent({"type": "start", "messageId": self.message_id}, now, "", 0),
                ChunkEvent({"type": "start-step"}, now, "", 0)]

    def step(self, d: p.Delta) -> list[ChunkEvent]:
        out: list[ChunkEvent] = []
        self.held += d.token_count
        if not self.openai:
            self._write("text", d.text, d.emit_ns, out)
        elif d.chunk:
            self._chunk(orjson.loads(d.chunk), d.emit_ns, out)
        if d.finish_reason is not None:
            self._finish(self.finish_reason or d.finish_reason, d.emit_ns, out)
        if out and self.held:
            out[0].tokens, self.held = self.held, 0
        return out

    def closing(self, err: APIError | None) -> list[ChunkEvent]:
        if self.done:
            return []
        self.done = True
        part = {"type": "error", "errorText": err.message} if err is not None else {"type": "abort",
                                                                                     "reason": "cancelled"}
        return [ChunkEvent(part, p.now_ns(), "", 0)]

    # -- per chunk ---------------------------------------------------------------------------------

    def _chunk(self, chunk: dict[str, Any], emit_ns: int, out: list[ChunkEvent]) -> None:
        choices = chunk.get("choices") or []
        if not choices:
            return  # the usage chunk
        choice = choices[0]
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if isinstance(reasoning, str):
            self._write("reasoning", reasoning, emit_ns, out)
        content = delta.get("content")
        if isinstance(content, str):
            self._write("text", content, emit_ns, out)
        for tc in delta.get("tool_calls") or []:
            self._tool_delta(tc, emit_ns, out)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def _write(self, kind: Kind, text: str, emit_ns: int, out: list[ChunkEvent]) -> None:
        if not text:
            return
        if self.open != kind:
            self._close(emit_ns, out)
            part_id = f"{kind}-{self.parts}"
            self.parts += 1
            self.open, self.template = kind, DeltaTemplate(kind, part_id)
            out.append(ChunkEvent({"type": f"{kind}-start", "id": part_id}, emit_ns, "", 0))
        out.append(ChunkEvent(None, emit_ns, text, 0, template=self.template))

    def _close(self, emit_ns: int, out: list[ChunkEvent]) -> None:
        if self.open is not None:
            out.append(ChunkEvent({"type": f"{self.open}-end", "id": f"{self.open}-{self.parts - 1}"},
                                  emit_ns, "", 0))
            self.open = self.template = None

    def _tool_delta(self, tc: dict[str, Any], emit_ns: int, out: list[ChunkEvent]) -> None:
        index = tc.get("index", 0)
        fn = tc.get("function") or {}
        call = self.calls.get(index)
        if call is None:
            self._close(emit_ns, out)
            call = self.calls[index] = _Call(tc.get("id") or f"call-{self.message_id}-{index}", fn.get("name") or "")
            out.append(ChunkEvent({"type": "tool-input-start", "toolCallId": call.id, "toolName": call.name},
                                  emit_ns, "", 0))
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            call.arguments.append(args)
            out.append(ChunkEvent({"type": "tool-input-delta", "toolCallId": call.id, "inputTextDelta": args},
                                  emit_ns, "", 0))

    def _finish(self, reason: str, emit_ns: int, out: list[ChunkEvent]) -> None:
        self._close(emit_ns, out)
        for index in sorted(self.calls):
            out.append(ChunkEvent(_input_part(self.calls[index]), emit_ns, "", 0))
        out.append(ChunkEvent({"type": "finish-step"}, emit_ns, "", 0))
        out.append(ChunkEvent({"type": "finish", "finishReason": FINISH_REASONS.get(reason, "other")}, emit_ns, "",
                              0, reason))
        self.done = True


def _input_part(call: _Call) -> dict[str, Any]:
    """``tool-input-available`` with the parsed arguments, or ``tool-input-error`` if they are not JSON."""
    raw = "".join(call.arguments)
    try:
        value = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        return {"type": "tool-input-error", "toolCallId": call.id, "toolName": call.name, "input": raw,
                "errorText": f"The tool call's arguments are not valid JSON: {exc}"}
    return {"type": "tool-input-available", "toolCallId": call.id, "toolName": call.name, "input": value}
