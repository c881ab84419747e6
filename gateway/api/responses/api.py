"""OpenAI Responses API: request parsing and the event/response objects (pure, no I/O).

- :func:`decode_create` reads a ``POST /v1/responses`` body (or a WebSocket ``response.create``
  object) into a typed :class:`CreateRequest`; :func:`build_request` turns it, plus the transcript of
  ``previous_response_id`` that the caller looked up, into a chat-completions submission (endpoint
  ``chat.completions``, the chat body of :mod:`gateway.api.responses.chat`): the engine serves it as a chat
  request, with vLLM's own tool and reasoning parsers and structured outputs when it runs them.
- :class:`ResponseEvents` builds the events of one response, exactly as the official SDKs type
  them, numbered by contiguous ``sequence_number`` from 0 (the stream log's ``seq``): from text deltas
  (the engine's plain path) or from vLLM's chat chunks (``delta.reasoning``, ``delta.content``,
  ``delta.tool_calls``), which become reasoning, message and ``function_call`` output items, in the
  order and shapes ``vllm serve``'s ``/v1/responses`` streams them.
- :class:`TextDeltaTemplate`: the steady state of a streamed answer, a ``response.output_text.delta`` per
  engine step, rendered from bytes cut once per message item with only the text and ``sequence_number``
  spliced in (:meth:`ResponseEvents.text_delta`); every other event is a dict, serialized whole.
- :func:`response_from_events` folds a log of those events back into the ``Response`` object, so
  ``GET /v1/responses/{id}`` works wherever the log is (the owner or a broker mirror).

Deliberate differences from OpenAI: fields we cannot honour (built-in tools, files, images, logprobs,
reasoning summaries, ...) are refused with a 400 naming the field instead of being ignored; unknown
fields are ignored, as on the chat endpoints. A cancelled response's stream ends with an ``error``
event of code ``response_cancelled`` (the SDKs have no cancel event); its object has status
``cancelled``. An output item is added when its first delta arrives (as vLLM does), so a response that
generated nothing has no output item.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import orjson

from engine_worker import protocol as p
from gateway.api.openai.request import ParsedRequest, parse_request
from gateway.api.responses import chat as rc
from gateway.api.validation import (
    Limits,
    check_json_depth,
    check_range,
    convert,
    decode_json_object,
    invalid,
    max_tokens,
    unsupported,
)
from gateway.errors import APIError

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
TERMINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
CANCELLED_CODE = "response_cancelled"

# metadata limits (OpenAI's): at most 16 pairs, keys up to 64 and values up to 512 characters
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class StreamOptions(msgspec.Struct):
    include_obfuscation: bool | None = None  # accepted; no obfuscation field is ever added


class CreateRequest(msgspec.Struct):
    """The body of ``POST /v1/responses`` (and of a WebSocket ``response.create``).

    Fields we support are typed; ``tools``, ``tool_choice``, ``reasoning`` and ``text`` are checked by
    :mod:`gateway.api.responses.chat`; fields we refuse unless harmless (see :data:`REFUSED`) are ``Any`` so
    their presence can be named in the error; vLLM's extension fields (:data:`gateway.api.responses.chat.FORWARDED`)
    are ``Any`` too, validated by the engine. Unknown fields are ignored."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    background: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    reasoning: Any = None
    # refused unless harmless:
    include: Any = None
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    truncation: Any = None
    image: Any = None
    moderation: Any = None
    access_programs: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None
    # vLLM's extensions, forwarded to the engine's chat request:
    chat_template_kwargs: Any = None
    structured_outputs: Any = None
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    stop: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    ignore_eos: Any = None
    include_reasoning: Any = None


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


# field -> (value is harmless, why it is refused)
REFUSED: dict[str, tuple[Any, str]] = {
    "include": (_empty, "include (extra output data) is not supported by this server"),
    "prompt": (_empty, "stored prompt templates are not supported by this server"),
    "conversation": (_empty, "conversations are not supported by this server; use previous_response_id"),
    "context_management": (_empty, "context_management (compaction) is not supported by this server"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported by this server"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported by this server"),
    "truncation": (lambda v: v in (None, "disabled"),
                   "truncation 'auto' is not supported; a prompt longer than the context fails instead"),
    "image": (_empty, "image options are not supported by this server"),
    "moderation": (_empty, "moderation options are not supported by this server"),
    "access_programs": (_empty, "access_programs are not supported by this server"),
    "background_options": (_empty, "background_options are not supported by this server"),
    "prompt_cache_options": (_empty, "prompt_cache_options are not supported by this server"),
}


def previous_response_not_found(response_id: str) -> APIError:
    """The documented error for a ``previous_response_id`` that is unknown, expired or not stored."""
    return APIError(400, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                    code="previous_response_not_found")


def response_not_found(response_id: str) -> APIError:
    """OpenAI's 404 for an unknown or deleted response (its message; tokenfan names the code and param)."""
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def response_expired(response_id: str) -> APIError:
    """A response that existed but is no longer retained (TTL or byte budget), as 410 for streams."""
    return APIError(410, f"Response '{response_id}' is no longer retained.", param="response_id",
                    code="response_expired")


def decode_create(body: bytes | dict[str, Any]) -> CreateRequest:
    """A request body (bytes, or an already decoded object) -> :class:`CreateRequest`, or a 400."""
    if isinstance(body, dict):
        check_json_depth(body)
    req = convert(body if isinstance(body, dict) else decode_json_object(body), CreateRequest)
    _refuse_unsupported(req)
    return req


def _refuse_unsupported(req: CreateRequest) -> None:
    for name, (harmless, why) in REFUSED.items():
        if not harmless(getattr(req, name)):
            raise unsupported(name, why)
    rc.function_tools(req.tools)
    rc.tool_choice(req.tool_choice)
    rc.text_format(req.text)
    if (req.text or {}).get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", "only the default verbosity 'medium' is supported")
    _reasoning_effort(req.reasoning)
    if req.background and req.store is False:
        raise invalid("store", "background responses must be stored: background=true needs store=true.")


def _reasoning_effort(reasoning: Any) -> str | None:
    """``reasoning.effort`` (the chat request's ``reasoning_effort``); summaries are refused."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise invalid("reasoning", "reasoning must be an object.")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise unsupported(f"reasoning.{key}", "reasoning summaries are not supported by this server")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise invalid("reasoning.effort", "reasoning.effort must be a string.")
    return effort


# -- request -> engine submission --------------------------------------------------------------


@dataclass(slots=True)
class ResponsesRequest:
    """A parsed create request: what the engine gets (``chat``) and what the Response echoes."""

    chat: ParsedRequest  # endpoint "chat.completions": the engine path is the chat path
    req: CreateRequest
    max_tokens: int
    temperature: float
    top_p: float
    input_messages: list[rc.Message]  # this turn's input (without instructions), as chat messages
    history: list[rc.Message] = field(default_factory=list)  # previous_response_id's transcript
    tools: list[dict[str, Any]] = field(default_factory=list)  # function tools, as the Response echoes them
    tool_choice: str | dict[str, Any] = "auto"
    text_format: dict[str, Any] | None = None  # None: plain text
    reasoning_effort: str | None = None

    @property
    def stream(self) -> bool:
        return bool(self.req.stream)

    @property
    def background(self) -> bool:
        return bool(self.req.background)

    @property
    def store(self) -> bool:
        return self.req.store is not False

    def transcript(self, turn: rc.Message | None) -> list[rc.Message]:
        """What a later ``previous_response_id`` continues from: prior turns, this input, this output's
        assistant message (:meth:`ResponseEvents.turn`; ``None``: no output, e.g. a WebSocket warmup).
        Instructions are not carried over (as on OpenAI)."""
        return [*self.history, *self.input_messages, *([] if turn is None else [turn])]


def parse_create(body: bytes | dict[str, Any], limits: Limits,
                 history: Sequence[rc.Message] = ()) -> ResponsesRequest:
    """:func:`decode_create` then :func:`build_request` (callers that resolve ``previous_response_id``
    call the two steps themselves, looking the transcript up in between)."""
    return build_request(decode_create(body), limits, history)


def build_request(req: CreateRequest, limits: Limits, history: Sequence[rc.Message] = ()) -> ResponsesRequest:
    """A decoded request + the transcript of its ``previous_response_id`` -> :class:`ResponsesRequest`."""
    limit = max_tokens(req.max_output_tokens, "max_output_tokens", limits)
    check_range("temperature", req.temperature, 0.0, 2.0)
    check_range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    _check_metadata(req.metadata)
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    inputs = rc.input_messages(req.input, allow_empty=bool(req.previous_response_id))
    messages = list(history) + inputs
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise invalid("input", "input must not be empty.")
    tools = rc.function_tools(req.tools)
    choice = rc.tool_choice(req.tool_choice)
    fmt = rc.text_format(req.text)
    effort = _reasoning_effort(req.reasoning)
    body: dict[str, Any] = {"messages": messages, "max_tokens": limit, "stream": True,
                            "stream_options": {"include_usage": True}}
    for name, value in (("model", req.model), ("temperature", req.temperature), ("top_p", req.top_p)):
        if value is not None:
            body[name] = value
    if tools:
        body["tools"] = rc.chat_tools(tools)
    if choice is not None and (tools or choice not in ("auto", "none")):
        body["tool_choice"] = rc.chat_tool_choice(choice)
    if req.parallel_tool_calls is not None and tools:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if fmt is not None:
        body["response_format"] = rc.response_format(fmt)
    if effort is not None:
        body["reasoning_effort"] = effort
    for name in rc.FORWARDED:
        if (value := getattr(req, name)) is not None:
            body[name] = value
    # The chat path's own parser: a plain body is served by tokenfan's plain path (typed sampling and
    # messages), any other by vLLM's layer in the engine. The engine streams chunks whatever the client
    # asked (``stream`` is true in the body): a non-streamed response is its folded events.
    chat = parse_request("chat.completions", body, limits)
    return ResponsesRequest(chat=chat, req=req, max_tokens=limit, temperature=temperature, top_p=top_p,
                            input_messages=inputs, history=list(history), tools=tools,
                            tool_choice=choice or "auto", text_format=fmt, reasoning_effort=effort)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid("metadata", f"metadata allows at most {MAX_METADATA_PAIRS} key-value pairs.")
    for k, v in metadata.items():
        if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise invalid("metadata", f"metadata keys are limited to {MAX_METADATA_KEY} characters and values "
                                      f"to {MAX_METADATA_VALUE}.")


# -- events and the Response object ------------------------------------------------------------


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def new_item_id(prefix: str = "msg") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(usage: p.Usage | None, reasoning_tokens: int = 0) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(rid: str, model: str, created_at: int, request: ResponsesRequest | None, *,
                    status: Status, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ``Response`` with the request's settings echoed, ``status`` set and no result yet."""
    req = request.req if request is not None else CreateRequest()
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": bool(req.background),
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": output if output is not None else [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": request.reasoning_effort if request is not None else None, "summary": None},
        "service_tier": "default",
        "temperature": request.temperature if request is not None else 1.0,
        "text": {"format": (request.text_format if request is not None else None) or {"type": "text"},
                 "verbosity": "medium"},
        "tool_choice": request.tool_choice if request is not None else "auto",
        "tools": list(request.tools) if request is not None else [],
        "top_logprobs": 0,
        "top_p": request.top_p if request is not None else 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": dict(req.metadata or {}),
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
    }


def text_delta_event(item_id: str, output_index: int, text: str, sequence_number: int | str) -> dict[str, Any]:
    """A message item's ``response.output_text.delta`` event: what :meth:`ResponseEvents.delta` appends
    and what :class:`TextDeltaTemplate` is cut from (``sequence_number`` is a string only for that cut)."""
    return {"type": "response.output_text.delta", "item_id": item_id, "output_index": output_index,
            "content_index": 0, "delta": text, "logprobs": [], "sequence_number": sequence_number}


class TextDeltaTemplate:
    """The ``response.output_text.delta`` events of one message item as bytes with two holes, the text and
    the ``sequence_number``: one is ``prefix + orjson.dumps(text) + middle + str(seq) + suffix``, ~0.35 µs
    (the dict and its serialization cost ~0.5 µs, the builder's Python around them as much again). The
    bytes are cut from :func:`text_delta_event`'s own, so both paths give the same bytes; :meth:`sse` is the
    whole SSE frame (``event:`` + ``data:``) in one formatting. A :class:`gateway.core.generation.Template`."""

    __slots__ = ("middle", "prefix", "sse_prefix", "suffix")

    TYPE = "response.output_text.delta"
    _TEXT, _SEQ = "\x00tokenfan-text\x00", "\x00tokenfan-seq\x00"

    def __init__(self, item_id: str, output_index: int) -> None:
        whole = orjson.dumps(text_delta_event(item_id, output_index, self._TEXT, self._SEQ))
        self.prefix, rest = whole.split(orjson.dumps(self._TEXT))
        self.middle, self.suffix = rest.split(orjson.dumps(self._SEQ))
        self.sse_prefix = b"event: " + self.TYPE.encode() + b"\ndata: " + self.prefix

    def render(self, text: str, seq: int) -> bytes:
        """The event's JSON (``seq``: its ``sequence_number``, the stream log's ``seq``)."""
        return b"%b%b%b%d%b" % (self.prefix, orjson.dumps(text), self.middle, seq, self.suffix)

    def sse(self, text: str, seq: int) -> bytes:
        """The event's SSE frame, as :class:`gateway.api.responses.stream.ResponsesSse` frames a dict event."""
        return b"%b%b%b%d%b\n\n" % (self.sse_prefix, orjson.dumps(text), self.middle, seq, self.suffix)


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def error_event(err: APIError, sequence_number: int) -> dict[str, Any]:
    """An SSE-mode ``error`` event. For a reader-level failure that is not part of the log (e.g. a
    slow reader cut), pass the last ``sequence_number`` the reader got, so that resuming with
    ``starting_after`` = the last number seen never skips a log event."""
    return {"type": "error", "code": err.code, "message": err.message, "param": err.param,
            "sequence_number": sequence_number}


_FAILED_CODES = {429: "rate_limit_exceeded"}


def failure_object(err: APIError) -> dict[str, Any]:
    """``Response.error`` for a failed response. The SDKs type its ``code`` as a closed set, so
    tokenfan's code travels in ``type`` and the message."""
    code = _FAILED_CODES.get(err.status, "invalid_prompt" if 400 <= err.status < 500 else "server_error")
    return {"code": code, "message": err.message, "param": err.param, "type": err.code or err.type}


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
            return _message(self.item["id"], text, status)
        if self.kind == "reasoning":
            return {**self.item, "content": [_reasoning_part(text)], "status": status}
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
        b = cls.__new__(cls)
        b.id, b.seq, b.items, b._open, b.reasoning_tokens = first["id"], 0, [], None, 0
        b._response = dict(first)
        for ev in events:
            b._apply(ev)
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
            events += self._open_item(_message(new_item_id("msg"), None, "in_progress"), _text_part(""))
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
            events += self._open_item(item, _reasoning_part(""))
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
                            part=_text_part(text)),
            ]
        elif o.kind == "reasoning":
            events = [
                self._event("response.reasoning_text.done", item_id=item_id, output_index=o.index, content_index=0,
                            text=text),
                self._event("response.content_part.done", item_id=item_id, output_index=o.index, content_index=0,
                            part=_reasoning_part(text)),
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
        err = APIError(400, f"Response '{self.id}' was cancelled.", code=CANCELLED_CODE)
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
