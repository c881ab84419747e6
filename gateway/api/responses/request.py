"""The Responses API's request: ``POST /v1/responses`` (or a WebSocket ``response.create``) read into a typed
:class:`CreateRequest` (:func:`decode_create`) and turned, with the transcript of ``previous_response_id``,
into a chat-completions submission (:func:`build_request`: endpoint ``chat.completions``, the chat body of
:mod:`gateway.api.responses.chat`), which the engine serves as a chat request, with vLLM's own tool and
reasoning parsers and structured outputs when it runs them (pure, no I/O).

Deliberate differences from OpenAI: fields we cannot honour (built-in tools, files, images, logprobs,
reasoning summaries, ...) are refused with a 400 naming the field instead of being ignored; unknown
fields are ignored, as on the chat endpoints.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from gateway.api.chat_request import ParsedRequest, parse_request
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
from gateway.errors import APIError, ClientError

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
    return ClientError(400, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                    code="previous_response_not_found")


def response_not_found(response_id: str) -> APIError:
    """OpenAI's 404 for an unknown or deleted response (its message; tokenfan names the code and param)."""
    return ClientError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def response_expired(response_id: str) -> APIError:
    """A response that existed but is no longer retained (TTL or byte budget), as 410 for streams."""
    return ClientError(410, f"Response '{response_id}' is no longer retained.", param="response_id",
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


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex
