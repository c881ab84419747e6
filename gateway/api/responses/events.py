"""The events of one response (pure): :class:`ResponseEvents` builds them exactly as the official SDKs type
them, numbered by contiguous ``sequence_number`` from 0 (the stream log's ``seq``), from text deltas (the
engine's plain path) or from vLLM's chat chunks (``delta.reasoning``, ``delta.content``, ``delta.tool_calls``),
which become reasoning, message and ``function_call`` output items, in the order and shapes ``vllm serve``'s
``/v1/responses`` streams them; and folds a log of those events back into the ``Response``
(:func:`response_from_events`), so ``GET /v1/responses/{id}`` works wherever the log is (the owner or a
broker mirror). An output item is added when its first delta arrives (as vLLM does), so a response that
generated nothing has no output item."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from engine_worker import protocol as p
from gateway.api.responses.objects import (
    failure_object,
    message_item,
    new_item_id,
    reasoning_part,
    response_object,
    text_part,
    usage_object,
)
from gateway.api.responses.request import CANCELLED_CODE, ResponsesRequest, Status
from gateway.api.responses.templates import TextDeltaTemplate, text_delta_event
from gateway.errors import APIError, ClientError

ItemKind = Literal["message", "reasoning", "function_call"]


# the delta event of each item kind (what a delta adds to the open item)
DELTA_EVENTS: dict[str, ItemKind] = {"response.output_text.delta": "message",
                                     "response.reasoning_text.delta": "reasoning",
                                     "response.function_call_arguments.delta": "function_call"}


@dataclass(slots=True)
class _OpenItem:
    """The output item receiving deltas: its ``output_item.added`` form and the text so far."""

    index: int  # output_index
    item: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    tool_index: int | None = None  # the chat tool call's index (a new index is a new item)
    template: TextDeltaTemplate | None = None  # a message item's text deltas, cut at its second delta

    @property
    def kind(self) -> ItemKind:
        return self.item["type"]  # type: ignore[no-any-return]

    def render(self, status: str) -> dict[str, Any]:
        """The item with its text so far, in ``status``."""
        text = "".join(self.parts)
        if self.kind == "message":
            return message_item(self.item["id"], text, status)
        if self.kind == "reasoning":
            return {**self.item, "content": [reasoning_part(text)], "status": status}
        return {**self.item, "arguments": text, "status": status}


class ResponseEvents:
    """The events of one response, in order, each numbered by the next ``sequence_number``.

    ``start()`` (= ``created()`` + ``in_progress()``), then per engine step ``delta(text)`` (plain path;
    ``text_delta(text)`` first, the same event as a template while a message item is open)
    or ``chunk(chat_chunk)`` (vLLM's layer), then exactly one of ``finish(finish_reason, usage)``,
    ``fail(error)`` or ``cancel()``. Every method returns the payloads to append to the log;
    ``response()`` is the ``Response`` object now.

    Output items open lazily on their first delta and close when another kind (or another tool call)
    starts or the response ends, as vLLM's ``SimpleStreamingEventProcessor`` does: a message item
    (``output_text`` part), a reasoning item (``reasoning_text`` part) or a ``function_call`` item
    (``function_call_arguments`` deltas).
    """

    def __init__(self, rid: str, model: str, created_at: int | None = None,
                 request: ResponsesRequest | None = None) -> None:
        self.id = rid
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items; the open one as it was added
        self._open: _OpenItem | None = None
        self.reasoning_tokens = 0  # as vLLM's layer counts them (its usage chunk)
        self._response = response_object(rid, model, int(time.time()) if created_at is None else created_at,
                                         request, status="queued" if request and request.background else "in_progress")

    @classmethod
    def from_events(cls, events: Iterable[dict[str, Any]]) -> ResponseEvents:
        """The builder state after ``events`` (a log prefix), e.g. to close a mirrored response."""
        events = list(events)
        if not events or events[0].get("type") != "response.created":
            raise ValueError("a response log starts with response.created")
        first = events[0]["response"]
        b = cls.__new__(cls)  # its own state, rebuilt: the private members are this class's
        b.id, b.seq, b.items, b._open, b.reasoning_tokens = first["id"], 0, [], None, 0  # noqa: SLF001
        b._response = dict(first)  # noqa: SLF001
        for ev in events:
            b._apply(ev)  # noqa: SLF001
        return b

    def _apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "response.output_item.added":
            self._added(dict(ev["item"]))
        elif kind in DELTA_EVENTS and self._open is not None:
            self._open.parts.append(ev["delta"])
        elif kind == "response.output_item.done":
            self.items[ev["output_index"]] = ev["item"]
            self._open = None
        elif "response" in ev:
            self._response = dict(ev["response"])
        elif kind == "error" and ev.get("code") == CANCELLED_CODE:
            self._end("cancelled")
        self.seq = ev["sequence_number"] + 1

    def _added(self, item: dict[str, Any], tool_index: int | None = None) -> _OpenItem:
        self._open = _OpenItem(len(self.items), item, tool_index=tool_index)
        self.items.append(item)
        return self._open

    @property
    def text(self) -> str:
        """The output text: every message item's."""
        return "".join(part["text"] for item in self._output() if item["type"] == "message"
                       for part in item["content"])

    @property
    def started(self) -> bool:
        """Whether any output item was added."""
        return bool(self.items)

    @property
    def status(self) -> Status:
        return self._response["status"]  # type: ignore[no-any-return]

    @property
    def done(self) -> bool:
        return self.status in ("completed", "incomplete", "failed", "cancelled")

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def _output(self) -> list[dict[str, Any]]:
        out = list(self.items)
        if self._open is not None:
            out[self._open.index] = self._open.render("in_progress")
        return out

    def response(self) -> dict[str, Any]:
        """The ``Response`` now (for ``GET /v1/responses/{id}``, a non-streaming reply, each lifecycle event)."""
        return {**self._response, "output": self._output()}

    def turn(self) -> dict[str, Any]:
        """This response's output as the assistant chat message a later turn continues from (reasoning
        is not carried over, as in vLLM)."""
        calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                         "arguments": it["arguments"]}}
                 for it in self._output() if it["type"] == "function_call"]
        text = self.text
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text or None, "tool_calls": calls}

    def created(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response())]

    def in_progress(self) -> list[dict[str, Any]]:
        """The response runs (the engine accepted it)."""
        self._response["status"] = "in_progress"
        return [self._event("response.in_progress", response=self.response())]

    def start(self) -> list[dict[str, Any]]:
        return self.created() + self.in_progress()

    # -- output items ---------------------------------------------------------------------------

    def _switch(self, kind: ItemKind, tool_index: int | None = None) -> list[dict[str, Any]]:
        """Close the open item unless it is ``kind`` (and the same tool call)."""
        o = self._open
        if o is None or (o.kind == kind and o.tool_index == tool_index):
            return []
        return self._close("completed")

    def _open_item(self, item: dict[str, Any], part: dict[str, Any] | None,
                   tool_index: int | None = None) -> list[dict[str, Any]]:
        o = self._added(item, tool_index)
        events = [self._event("response.output_item.added", output_index=o.index, item=item)]
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=o.index,
                                      content_index=0, part=part))
        return events

    def delta(self, text: str) -> list[dict[str, Any]]:
        """Output text (a message item)."""
        if not text:
            return []
        events = self._switch("message")
        if self._open is None:
            events += self._open_item(message_item(new_item_id("msg"), None, "in_progress"), text_part(""))
        o = self._open
        assert o is not None
        o.parts.append(text)
        seq = self.seq
        self.seq += 1
        return [*events, text_delta_event(o.item["id"], o.index, text, seq)]

    def text_delta(self, text: str) -> tuple[TextDeltaTemplate, int] | None:
        """Output text while a message item is open: its ``response.output_text.delta`` as the item's
        template and the event's ``sequence_number`` (the event :meth:`delta` would give as a dict). None,
        with nothing changed, when the text adds no event (empty) or more than one (no message item open:
        call :meth:`delta`)."""
        o = self._open
        if not text or o is None:
            return None
        template = o.template
        if template is None:
            if o.item["type"] != "message":
                return None
            template = o.template = TextDeltaTemplate(o.item["id"], o.index)
        o.parts.append(text)
        seq = self.seq
        self.seq = seq + 1
        return template, seq

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        """Reasoning text (a reasoning item), as vLLM's reasoning parser separates it."""
        if not text:
            return []
        events = self._switch("reasoning")
        if self._open is None:
            item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            events += self._open_item(item, reasoning_part(""))
        o = self._open
        assert o is not None
        o.parts.append(text)
        return [*events, self._event("response.reasoning_text.delta", item_id=o.item["id"], output_index=o.index,
                                     content_index=0, delta=text)]

    def tool_call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[dict[str, Any]]:
        """A piece of chat tool call ``index`` (a ``function_call`` item): its first piece names it."""
        events = self._switch("function_call", index)
        if self._open is None:
            item = {"id": new_item_id("fc"), "type": "function_call", "call_id": call_id or new_item_id("call"),
                    "name": name or "", "arguments": "", "status": "in_progress"}
            events += self._open_item(item, None, index)
        o = self._open
        assert o is not None
        if not arguments:
            return events
        o.parts.append(arguments)
        return [*events, self._event("response.function_call_arguments.delta", item_id=o.item["id"],
                                     output_index=o.index, delta=arguments)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat chunk of vLLM's layer: its reasoning, content and tool calls, in that order (vLLM's
        ``split_delta``); the usage chunk adds no event (the engine's last delta carries usage), only its
        count of reasoning tokens."""
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.reasoning_tokens = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
        choices = chunk.get("choices") or []
        delta = choices[0].get("delta") if choices else None
        if not isinstance(delta, dict):
            return []
        events = self.reasoning(delta.get("reasoning") or delta.get("reasoning_content") or "")
        events += self.delta(delta.get("content") or "")
        for tc in delta.get("tool_calls") or ():
            fn = tc.get("function") or {}
            events += self.tool_call(int(tc.get("index") or 0), tc.get("id"), fn.get("name"),
                                     fn.get("arguments") or "")
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        o = self._open
        if o is None:
            return []
        self._open = None
        item_id, text = o.item["id"], "".join(o.parts)
        done = self.items[o.index] = o.render(status)
        if o.kind == "message":
            events = [
                self._event("response.output_text.done", item_id=item_id, output_index=o.index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item_id, output_index=o.index, content_index=0,
                            part=text_part(text)),
            ]
        elif o.kind == "reasoning":
            events = [
                self._event("response.reasoning_text.done", item_id=item_id, output_index=o.index, content_index=0,
                            text=text),
                self._event("response.content_part.done", item_id=item_id, output_index=o.index, content_index=0,
                            part=reasoning_part(text)),
            ]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item_id, output_index=o.index,
                                  arguments=text)]
        return [*events, self._event("response.output_item.done", output_index=o.index, item=done)]

    # -- the end --------------------------------------------------------------------------------

    def _end(self, status: Status, usage: p.Usage | None = None) -> dict[str, Any]:
        r = self._response
        r["status"] = status
        r["usage"] = usage_object(usage, self.reasoning_tokens) if usage is not None else r["usage"]
        r["completed_at"] = int(time.time()) if status == "completed" else None
        return self.response()

    def finish(self, finish_reason: str | None, usage: p.Usage | None) -> list[dict[str, Any]]:
        """The generation ended: ``length`` -> ``response.incomplete`` (max_output_tokens), ``stop`` or
        none -> ``response.completed``; ``abort`` -> :meth:`cancel`; ``error`` -> :meth:`fail`."""
        if finish_reason == "abort":
            return self.cancel()
        if finish_reason == "error":
            return self.fail(APIError(500, "The engine failed while generating.", type="server_error",
                                      code="engine_error"))
        if finish_reason == "length":
            events = self._close("incomplete")
            self._response["incomplete_details"] = {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self._end("incomplete", usage))]
        events = self._close("completed")
        return events + [self._event("response.completed", response=self._end("completed", usage))]

    def fail(self, err: APIError) -> list[dict[str, Any]]:
        """An engine-side failure after the response started: ``response.failed`` with ``error``."""
        events = self._close("incomplete")
        self._response["error"] = failure_object(err)
        return events + [self._event("response.failed", response=self._end("failed"))]

    def cancel(self) -> list[dict[str, Any]]:
        """Cancelled (``POST /v1/responses/{id}/cancel``): close the item, then an ``error`` event with
        code ``response_cancelled``; :meth:`response` has status ``cancelled``."""
        events = self._close("incomplete")
        self._end("cancelled")
        err = ClientError(400, f"Response '{self.id}' was cancelled.", code=CANCELLED_CODE)
        return events + [self._event("error", code=err.code, message=err.message, param=None)]


def chunk_text(chunk: dict[str, Any]) -> str | None:
    """The output text of a chat chunk of vLLM's layer that carries nothing else (no reasoning, tool call
    or usage), which :meth:`ResponseEvents.chunk` turns into :meth:`ResponseEvents.delta` alone; None for
    any other chunk."""
    choices = chunk.get("choices")
    delta = choices[0].get("delta") if choices else None
    if not isinstance(delta, dict) or chunk.get("usage") is not None or delta.get("reasoning") \
            or delta.get("reasoning_content") or delta.get("tool_calls"):
        return None
    content = delta.get("content")
    return content if isinstance(content, str) else None


def response_from_events(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Fold a response's log (its events, in order) into its ``Response`` object now."""
    return ResponseEvents.from_events(events).response()


def delta_text(event: dict[str, Any]) -> str:
    """The generated text an event carries (any ``*.delta``), for the stream's accounting."""
    return event["delta"] if event["type"] in DELTA_EVENTS else ""
