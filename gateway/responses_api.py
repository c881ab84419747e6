"""OpenAI Responses API: request parsing and the event/response objects (pure, no I/O).

- :func:`decode_create` reads a ``POST /v1/responses`` body (or a WebSocket ``response.create``
  object) into a typed :class:`CreateRequest`; :func:`build_request` turns it, plus the transcript of
  ``previous_response_id`` that the caller looked up, into the same :class:`ParsedRequest`
  (endpoint ``chat.completions``) that the chat path submits, so the engine path is unchanged.
- :class:`ResponseEvents` builds the events of one response, exactly as the official SDKs type
  them, numbered by contiguous ``sequence_number`` from 0 (the stream log's ``seq``).
- :func:`response_from_events` folds a log of those events back into the ``Response`` object, so
  ``GET /v1/responses/{id}`` works wherever the log is (the owner or a broker mirror).

Deliberate differences from OpenAI: fields we cannot honour (tools, reasoning, files, images,
structured output, ...) are refused with a 400 naming the field instead of being ignored; unknown
fields are ignored, as on the chat endpoints. A cancelled response's stream ends with an ``error``
event of code ``response_cancelled`` (the SDKs have no cancel event); its object has status
``cancelled``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from engine_worker import protocol as p
from gateway.errors import APIError
from gateway.openai_api import _PATH, Limits, ParsedRequest, check_json_depth, decode_json_object

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
TERMINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
CANCELLED_CODE = "response_cancelled"

# metadata limits (OpenAI's): at most 16 pairs, keys up to 64 and values up to 512 characters
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class StreamOptions(msgspec.Struct):
    include_obfuscation: bool | None = None  # accepted; no obfuscation field is ever added


class CreateRequest(msgspec.Struct):
    """The body of ``POST /v1/responses`` (and of a WebSocket ``response.create``).

    Fields we support are typed; fields we refuse unless harmless (see :data:`REFUSED`) are ``Any``
    so their presence can be named in the error. Unknown fields are ignored."""

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
    # refused unless harmless:
    tools: Any = None
    tool_choice: Any = None
    reasoning: Any = None
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


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _all_null(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(x is None for x in v.values()))


# field -> (value is harmless, why it is refused)
REFUSED: dict[str, tuple[Any, str]] = {
    "tools": (_empty, "tools / function calling are not supported by this server"),
    "tool_choice": (lambda v: v in (None, "auto", "none"), "tool_choice other than 'auto' or 'none' needs tools"),
    "reasoning": (_all_null, "reasoning options are not supported by this server"),
    "include": (_empty, "include (extra output data) is not supported by this server"),
    "prompt": (_empty, "stored prompt templates are not supported by this server"),
    "conversation": (_empty, "conversations are not supported by this server; use previous_response_id"),
    "context_management": (_empty, "context_management (compaction) is not supported by this server"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported by this server"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls needs tools, which are not supported"),
    "truncation": (lambda v: v in (None, "disabled"),
                   "truncation 'auto' is not supported; a prompt longer than the context fails instead"),
    "image": (_empty, "image options are not supported by this server"),
    "moderation": (_empty, "moderation options are not supported by this server"),
    "access_programs": (_empty, "access_programs are not supported by this server"),
    "background_options": (_empty, "background_options are not supported by this server"),
    "prompt_cache_options": (_empty, "prompt_cache_options are not supported by this server"),
}


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}.", param=param, code="unsupported_parameter")


def invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def previous_response_not_found(response_id: str) -> APIError:
    """The documented error for a ``previous_response_id`` that is unknown, expired or not stored."""
    return APIError(400, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                    code="previous_response_not_found")


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")


def response_expired(response_id: str) -> APIError:
    """A response that existed but is no longer retained (TTL or byte budget), as 410 for streams."""
    return APIError(410, f"Response '{response_id}' is no longer retained.", param="response_id",
                    code="response_expired")


def starting_after(raw: str | None) -> int:
    """``GET /v1/responses/{id}?stream=true&starting_after=N``: the last sequence number the client has
    (events with a larger one are sent); absent = -1, everything from ``response.created``."""
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < -1:
        raise invalid("starting_after", f"starting_after must be an integer >= -1, got {raw!r}.")
    return value


def decode_create(body: bytes | dict[str, Any]) -> CreateRequest:
    """A request body (bytes, or an already decoded object) -> :class:`CreateRequest`, or a 400."""
    try:
        if isinstance(body, dict):
            check_json_depth(body)
        req = msgspec.convert(body if isinstance(body, dict) else decode_json_object(body), CreateRequest)
    except msgspec.ValidationError as exc:
        m = _PATH.search(str(exc))
        param = m.group(1).split("[")[0].split(".")[0] if m and m.group(1) else None
        raise APIError(400, f"Invalid request: {exc}", param=param, code="invalid_type") from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    _refuse_unsupported(req)
    return req


def _refuse_unsupported(req: CreateRequest) -> None:
    for name, (harmless, why) in REFUSED.items():
        if not harmless(getattr(req, name)):
            raise unsupported(name, why)
    text = req.text or {}
    fmt = text.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise unsupported("text.format", f"only plain text output is supported, not {kind!r}")
    if text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", "only the default verbosity 'medium' is supported")
    if req.background and req.store is False:
        raise invalid("store", "background responses must be stored: background=true needs store=true.")


# -- request -> engine submission --------------------------------------------------------------


@dataclass(slots=True)
class ResponsesRequest:
    """A parsed create request: what the engine gets (``chat``) and what the Response echoes."""

    chat: ParsedRequest  # endpoint "chat.completions": the engine path is the chat path
    req: CreateRequest
    max_tokens: int
    temperature: float
    top_p: float
    input_messages: list[p.ChatMessage]  # this turn's input (without instructions)
    history: list[p.ChatMessage] = field(default_factory=list)  # previous_response_id's transcript

    @property
    def stream(self) -> bool:
        return bool(self.req.stream)

    @property
    def background(self) -> bool:
        return bool(self.req.background)

    @property
    def store(self) -> bool:
        return self.req.store is not False

    def transcript(self, output_text: str | None) -> list[p.ChatMessage]:
        """What a later ``previous_response_id`` continues from: prior turns, this input, this output
        (``None``: no output, e.g. a WebSocket warmup). Instructions are not carried over (as on OpenAI)."""
        out = [] if output_text is None else [p.ChatMessage(role="assistant", content=output_text)]
        return [*self.history, *self.input_messages, *out]


def parse_create(body: bytes | dict[str, Any], limits: Limits,
                 history: Sequence[p.ChatMessage] = ()) -> ResponsesRequest:
    """:func:`decode_create` then :func:`build_request` (callers that resolve ``previous_response_id``
    call the two steps themselves, looking the transcript up in between)."""
    return build_request(decode_create(body), limits, history)


def build_request(req: CreateRequest, limits: Limits, history: Sequence[p.ChatMessage] = ()) -> ResponsesRequest:
    """A decoded request + the transcript of its ``previous_response_id`` -> :class:`ResponsesRequest`."""
    max_tokens = req.max_output_tokens
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.max_tokens_cap)
    if max_tokens < 1:
        raise invalid("max_output_tokens", f"max_output_tokens must be at least 1, got {max_tokens}.")
    if max_tokens > limits.max_tokens_cap:
        raise invalid("max_output_tokens",
                      f"max_output_tokens must be at most {limits.max_tokens_cap} on this server, got {max_tokens}.")
    _check_range("temperature", req.temperature, 0.0, 2.0)
    _check_range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    _check_metadata(req.metadata)
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    inputs = input_messages(req.input, allow_empty=bool(req.previous_response_id))
    messages = list(history) + inputs
    if req.instructions:
        messages.insert(0, p.ChatMessage(role="system", content=req.instructions))
    if not messages:
        raise invalid("input", "input must not be empty.")
    sampling = p.Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p)
    chat = ParsedRequest(endpoint="chat.completions", stream=bool(req.stream), include_usage=True,
                         model=req.model, submit_fields={"sampling": sampling, "messages": messages})
    return ResponsesRequest(chat=chat, req=req, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            input_messages=inputs, history=list(history))


def _check_range(name: str, value: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if math.isnan(value) or value < lo or value > hi or (lo_open and value == lo):
        raise invalid(name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}.")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid("metadata", f"metadata allows at most {MAX_METADATA_PAIRS} key-value pairs.")
    for k, v in metadata.items():
        if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise invalid("metadata", f"metadata keys are limited to {MAX_METADATA_KEY} characters and values "
                                      f"to {MAX_METADATA_VALUE}.")


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text"}


def input_messages(value: str | list[dict[str, Any]] | None, *, allow_empty: bool = False) -> list[p.ChatMessage]:
    """``input`` (a string, or a list of message items with string or text-part content) -> messages."""
    if value is None:
        if allow_empty:
            return []
        raise invalid("input", "input is required.")
    if isinstance(value, str):
        return [p.ChatMessage(role="user", content=value)]
    if not value and not allow_empty:
        raise invalid("input", "input must be a string or a non-empty list of messages.")
    return [_input_item(i, item) for i, item in enumerate(value)]


def _input_item(i: int, item: dict[str, Any]) -> p.ChatMessage:
    kind = item.get("type", "message")
    if kind != "message":
        raise unsupported(f"input[{i}]", f"input items of type {kind!r} are not supported; only messages are")
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"input[{i}].role", f"input[{i}].role must be one of {sorted(_ROLES)}, got {role!r}.")
    content = item.get("content")
    if isinstance(content, str):
        return p.ChatMessage(role=_ROLES[role], content=content)
    if not isinstance(content, list):
        raise invalid(f"input[{i}].content", f"input[{i}].content must be a string or a list of content parts.")
    texts = []
    for j, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype not in _TEXT_PARTS:
            raise unsupported(f"input[{i}].content[{j}]",
                              f"content parts of type {ptype!r} are not supported; only input_text is")
        if not isinstance(part.get("text"), str):
            raise invalid(f"input[{i}].content[{j}].text", f"input[{i}].content[{j}].text must be a string.")
        texts.append(part["text"])
    return p.ChatMessage(role=_ROLES[role], content="".join(texts))


def encode_transcript(transcript: list[p.ChatMessage]) -> bytes:
    """A transcript as bytes (to retain with a stored response, or carry through the broker)."""
    return msgspec.msgpack.encode(transcript)


def decode_transcript(data: bytes) -> list[p.ChatMessage]:
    return msgspec.msgpack.decode(data, type=list[p.ChatMessage])


# -- events and the Response object ------------------------------------------------------------


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def new_item_id() -> str:
    return "msg_" + uuid.uuid4().hex


def usage_object(usage: p.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_object(rid: str, model: str, created_at: int, request: ResponsesRequest | None, *,
                    status: Status, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ``Response`` with the request's settings echoed, ``status`` set and no result yet."""
    req = request.req if request is not None else CreateRequest()
    tool_choice = req.tool_choice if req.tool_choice in ("auto", "none") else "auto"
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
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "temperature": request.temperature if request is not None else 1.0,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": tool_choice,
        "tools": [],
        "top_logprobs": 0,
        "top_p": request.top_p if request is not None else 1.0,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": dict(req.metadata or {}),
        "prompt_cache_key": req.prompt_cache_key,
        "safety_identifier": req.safety_identifier,
    }


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


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


class ResponseEvents:
    """The events of one response, in order, each numbered by the next ``sequence_number``.

    ``start()`` (= ``created()`` + ``in_progress()``), then ``delta(text)`` per engine delta, then
    exactly one of ``finish(finish_reason, usage)``, ``fail(error)`` or ``cancel()``. Every method
    returns the payloads to append to the log; ``response()`` is the ``Response`` object now.
    """

    def __init__(self, rid: str, model: str, created_at: int | None = None,
                 request: ResponsesRequest | None = None, item_id: str | None = None) -> None:
        self.id = rid
        self.item_id = item_id or new_item_id()
        self.seq = 0
        self.text_parts: list[str] = []
        self.started = False  # the message item and its text part were added
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
        b.id, b.seq, b.text_parts, b.started = first["id"], 0, [], False
        b.item_id = ""
        b._response = dict(first)
        for ev in events:
            b._apply(ev)
        return b

    def _apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "response.output_item.added":
            self.item_id, self.started = ev["item"]["id"], True
        elif kind == "response.output_text.delta":
            self.text_parts.append(ev["delta"])
        elif "response" in ev:
            self._response = dict(ev["response"])
        elif kind == "error" and ev.get("code") == CANCELLED_CODE:
            self._end("cancelled", "incomplete")
        self.seq = ev["sequence_number"] + 1

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

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

    def response(self) -> dict[str, Any]:
        """The ``Response`` now (for ``GET /v1/responses/{id}``, a non-streaming reply, each lifecycle event)."""
        r = dict(self._response)
        if self.started and not r["output"]:
            r["output"] = [_message(self.item_id, self.text, "in_progress")]
        return r

    def created(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response())]

    def in_progress(self, item: bool = True) -> list[dict[str, Any]]:
        """The response runs (the engine accepted it): ``response.in_progress`` and the message item
        with its text part (``item=False``: no output will follow, e.g. a WebSocket warmup)."""
        self._response["status"] = "in_progress"
        events = [self._event("response.in_progress", response=self.response())]
        if not item:
            return events
        events.append(self._event("response.output_item.added", output_index=0,
                                  item=_message(self.item_id, None, "in_progress")))
        self.started = True
        events.append(self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                                  content_index=0, part=_text_part("")))
        return events

    def start(self) -> list[dict[str, Any]]:
        return self.created() + self.in_progress()

    def delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if not self.started:
            raise RuntimeError("delta before in_progress()")
        self.text_parts.append(text)
        return [self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                            delta=text, logprobs=[])]

    def _close_item(self, item_status: str) -> list[dict[str, Any]]:
        if not self.started:
            return []
        text = self.text
        return [
            self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                        text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                        part=_text_part(text)),
            self._event("response.output_item.done", output_index=0,
                        item=_message(self.item_id, text, item_status)),
        ]

    def _end(self, status: Status, item_status: str, usage: p.Usage | None = None) -> dict[str, Any]:
        r = self._response
        r["status"] = status
        r["output"] = [_message(self.item_id, self.text, item_status)] if self.started else []
        r["usage"] = usage_object(usage) if usage is not None else r["usage"]
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
            events = self._close_item("incomplete")
            self._response["incomplete_details"] = {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self._end("incomplete", "incomplete", usage))]
        events = self._close_item("completed")
        return events + [self._event("response.completed", response=self._end("completed", "completed", usage))]

    def fail(self, err: APIError) -> list[dict[str, Any]]:
        """An engine-side failure after the response started: ``response.failed`` with ``error``."""
        events = self._close_item("incomplete")
        self._response["error"] = failure_object(err)
        return events + [self._event("response.failed", response=self._end("failed", "incomplete"))]

    def cancel(self) -> list[dict[str, Any]]:
        """Cancelled (``POST /v1/responses/{id}/cancel``): close the item, then an ``error`` event with
        code ``response_cancelled``; :meth:`response` has status ``cancelled``."""
        events = self._close_item("incomplete")
        self._end("cancelled", "incomplete")
        err = APIError(400, f"Response '{self.id}' was cancelled.", code=CANCELLED_CODE)
        return events + [self._event("error", code=err.code, message=err.message, param=None)]


def response_from_events(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Fold a response's log (its events, in order) into its ``Response`` object now."""
    return ResponseEvents.from_events(events).response()
