"""OpenAI chat/completions request parsing and chunk building (pure).

Request bytes pass :func:`gateway.api.validation.decode_json_object` first, the one JSON gate of every entry
point; callers that decoded an object themselves pass it to :func:`parse_request` as is (re-encoding it is
what fails), and it is checked for depth. The field checks are :mod:`gateway.api.validation`'s, shared with
the Responses API. The object is then classified: a *plain* body (messages or prompt and the common sampling fields,
:func:`engine_worker.plain_path.is_plain`) is converted into typed structs (msgspec; a type
error is a 400 naming the field) and served by tokenfan's own path, chunks built here. Any other body
(tools, structured outputs, logprobs, ``n`` > 1 …) is forwarded as is: the engine validates and serves it
with vLLM's own OpenAI layer, and the gateway only frames the chunks it returns. Every body also reaches
the engine, which takes vLLM's layer for plain chat bodies too when a tool or reasoning parser is on.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import orjson

from engine_worker import protocol as p
from engine_worker.plain_path import is_plain
from gateway.api.validation import (
    Limits,
    check_json_depth,
    check_max_tokens_cap,
    check_range,
    check_top_k,
    convert,
    decode_json_object,
    invalid,
    max_tokens,
    stop_strings,
    text_content,
)
from gateway.errors import ClientError

Endpoint = Literal["chat.completions", "completions"]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class InMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class _Common(msgspec.Struct):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    n: int | None = None
    user: str | None = None


class ChatRequest(_Common):
    messages: list[InMessage] = []
    max_completion_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[Any] | None = None


@dataclass(slots=True)
class ParsedRequest:
    endpoint: Endpoint
    stream: bool
    include_usage: bool
    model: str | None
    submit_fields: dict[str, Any]  # prompt or messages + sampling + body, ready for protocol.Submit

    def to_submit(self, request_id: str, trace_id: str) -> p.Submit:
        return p.Submit(request_id=request_id, endpoint=self.endpoint, trace_id=trace_id, stream=self.stream,
                        **self.submit_fields)


def parse_request(endpoint: Endpoint, body: bytes | dict[str, Any], limits: Limits) -> ParsedRequest:
    """An OpenAI request body (bytes, or an object already decoded by :func:`decode_json_object`, e.g. a
    ``/v1/ws`` message's ``body``) -> :class:`ParsedRequest`, or :class:`APIError` (400)."""
    kind: type[ChatRequest | CompletionRequest] = ChatRequest if endpoint == "chat.completions" else CompletionRequest
    if isinstance(body, dict):
        obj = body
        check_json_depth(obj, limits.max_json_depth)
        raw = orjson.dumps(obj)
    else:
        obj = decode_json_object(body, limits.max_json_depth)
        raw = body
    if not is_plain(obj):
        return _forwarded(endpoint, obj, raw, limits)
    req = convert(obj, kind)
    sampling = _sampling(req, limits)
    fields: dict[str, Any] = {"sampling": sampling, "body": raw}
    if isinstance(req, ChatRequest):
        fields["messages"] = _messages(req.messages)
    else:
        fields["prompt"] = _prompt(req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and not req.stream:
        raise ClientError(400, "stream_options is only allowed when stream is true.", param="stream_options")
    return ParsedRequest(endpoint=endpoint, stream=req.stream, include_usage=include_usage,
                         model=req.model, submit_fields=fields)


def _forwarded(endpoint: Endpoint, obj: dict[str, Any], raw: bytes, limits: Limits) -> ParsedRequest:
    """A body for vLLM's OpenAI layer in the engine: only what the gateway itself needs is checked here
    (``stream``, ``model``, tokenfan's ``--max-tokens-cap``); the engine validates the rest as vllm serve."""
    stream = obj.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ClientError(400, "stream must be a boolean.", param="stream", code="invalid_type")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError(400, "model must be a string.", param="model", code="invalid_type")
    limit = limits.default_max_tokens
    for param in ("max_tokens", "max_completion_tokens"):
        value = obj.get(param)
        if isinstance(value, int) and not isinstance(value, bool):
            check_max_tokens_cap(value, param, limits)
            limit = max(1, value)
    options = obj.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    sampling = p.Sampling(max_tokens=min(limit, limits.max_tokens_cap))
    return ParsedRequest(endpoint=endpoint, stream=bool(stream), include_usage=include_usage, model=model,
                         submit_fields={"sampling": sampling, "body": raw})


def _sampling(req: ChatRequest | CompletionRequest, limits: Limits) -> p.Sampling:
    limit, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        limit, param = req.max_completion_tokens, "max_completion_tokens"
    limit = max_tokens(limit, param, limits)
    check_range("temperature", req.temperature, 0.0, 2.0)
    check_range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    check_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    check_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    check_top_k(req.top_k)
    return p.Sampling(
        max_tokens=limit,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,  # type: ignore[arg-type]
        seed=req.seed, stop=stop_strings(req.stop, limits),
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        ignore_eos=req.ignore_eos,
    )


_TEXT_PARTS = frozenset({"text"})


def _messages(messages: list[InMessage]) -> list[p.ChatMessage]:
    """The plain path's messages (:func:`is_plain` admits only system, user and assistant turns with text);
    text parts stay unjoined and ``null`` content is no parts, as vLLM's chat layer takes them (the engine
    renders with it)."""
    if not messages:
        raise invalid("messages", "messages must be a non-empty array.")
    return [p.ChatMessage(m.role, text_content(f"messages[{i}].content", [] if m.content is None else m.content,
                                               _TEXT_PARTS)) for i, m in enumerate(messages)]


def _prompt(req: CompletionRequest) -> str:
    """The plain path's prompt (:func:`is_plain` admits a string or a list of one string). A missing or empty
    string is refused as vLLM's ``CompletionRequest`` refuses it (a list holding ``""`` is not, as there)."""
    prompt = req.prompt
    if prompt is None or prompt == "":
        raise invalid("prompt", "Either prompt or prompt_embeds must be provided and non-empty.")
    return prompt[0] if isinstance(prompt, list) else prompt


# -- responses -------------------------------------------------------------------------------


def new_id(endpoint: Endpoint) -> str:
    return ("chatcmpl-" if endpoint == "chat.completions" else "cmpl-") + uuid.uuid4().hex


class ChunkBuilder:
    """Builds the OpenAI chunk objects of one generation, in order.

    Chat: a first chunk with ``delta.role``, then one chunk per engine step (empty content while the
    detokenizer holds text back), the last content
    chunk carrying ``finish_reason``; completions: one chunk per delta. With ``include_usage`` every
    chunk has ``usage: null`` and :meth:`usage_chunk` gives the final ``choices: []`` chunk.
    """

    def __init__(self, endpoint: Endpoint, request_id: str, model: str, include_usage: bool,
                 created: int | None = None) -> None:
        self.endpoint = endpoint
        self.chat = endpoint == "chat.completions"
        self.include_usage = include_usage
        self._base: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()) if created is None else created,
            "model": model,
            "system_fingerprint": None,
        }

    @property
    def model(self) -> str:
        return str(self._base["model"])

    @property
    def request_id(self) -> str:
        return str(self._base["id"])

    @property
    def created(self) -> int:
        return int(self._base["created"])

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._base, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role_chunk(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason})
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})

    def usage_chunk(self, usage: p.Usage) -> dict[str, Any]:
        return {**self._base, "choices": [], "usage": usage_dict(usage)}

    def full_response(self, text: str, finish_reason: str | None, usage: p.Usage) -> dict[str, Any]:
        base = {**self._base, "object": "chat.completion" if self.chat else "text_completion"}
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**base, "choices": [choice], "usage": usage_dict(usage)}


def usage_dict(usage: p.Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)
