"""OpenAI request parsing and chunk building (pure).

Request bytes pass :func:`decode_json_object` first, the one JSON gate of every entry point (POST
bodies, ``/v1/streams``, ``/v1/ws`` messages): invalid UTF-8, malformed JSON and nesting deeper than
``Limits.max_json_depth`` are a 400 ``invalid_json``, never a 500 (msgspec would raise
``UnicodeDecodeError`` or ``RecursionError``, and ``orjson.dumps`` refuses depth 255+). Callers that
decoded an object themselves pass it to :func:`parse_request` as is (re-encoding it is what fails). The object is then
classified: a *plain* body (messages or prompt and the common sampling fields,
:func:`engine_worker.backends.vllm_openai.is_plain`) is converted into typed structs (msgspec; a type
error is a 400 naming the field) and served by tokenfan's own path, chunks built here. Any other body
(tools, structured outputs, logprobs, ``n`` > 1 …) is forwarded as is: the engine validates and serves it
with vLLM's own OpenAI layer, and the gateway only frames the chunks it returns. Every body also reaches
the engine, which takes vLLM's layer for plain chat bodies too when a tool or reasoning parser is on.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal

import msgspec
import orjson

from engine_worker import protocol as p
from engine_worker.backends.vllm_openai import is_plain
from gateway.errors import APIError

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
class Limits:
    """Request limits enforced at parse time (see gateway.config)."""

    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    max_stop: int = 16
    max_json_depth: int = 64  # OpenAI bodies nest ~6 deep (tools' JSON schemas more); orjson stops at 1024


MAX_JSON_DEPTH = Limits().max_json_depth

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a string literal (unrolled: linear time)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def decode_json_object(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH, what: str = "Request body") -> dict[str, Any]:
    """``raw`` as a JSON object, or :class:`APIError` 400: ``invalid_json`` if empty, nested deeper than
    ``max_depth``, not UTF-8 or not JSON; ``invalid_value`` if not an object (``what`` names the input).

    The depth is checked on the bytes before parsing, and only when they hold more than ``max_depth``
    brackets (ordinary bodies pay two ``count`` calls); orjson then validates UTF-8 and the grammar."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if not data.strip():
        raise APIError(400, f"{what} is empty; expected a JSON object.", code="invalid_json")
    if _nests_deeper(data, max_depth):
        raise APIError(400, _too_deep(what, max_depth), code="invalid_json")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"{what} is not valid JSON: {_json_problem(data, exc)}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"{what} must be a JSON object, got {_json_type(obj)}.", code="invalid_value")
    return obj


def _nests_deeper(data: bytes, limit: int) -> bool:
    """Whether arrays/objects in JSON text nest more than ``limit`` levels: the brackets outside string
    literals, summed in C (a 1 MB body of brackets: ~50 ms on 2 loaded cores; orjson alone takes longer)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    steps = _JSON_STRING.sub(b"", data).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return any(depth > limit for depth in accumulate(memoryview(steps).cast("b")))


def check_json_depth(obj: object, max_depth: int = MAX_JSON_DEPTH, what: str = "Request body") -> None:
    """:class:`APIError` 400 ``invalid_json`` if an already decoded value (e.g. from ``orjson.loads``, which
    allows 1024 levels) nests deeper than ``max_depth``: check before ``msgspec.convert`` or ``orjson.dumps``."""
    if _deeper_than(obj, max_depth):
        raise APIError(400, _too_deep(what, max_depth), code="invalid_json")


def _deeper_than(obj: object, limit: int) -> bool:
    """Whether an already decoded value nests more than ``limit`` levels (level by level: no recursion)."""
    level = [obj] if isinstance(obj, (dict, list)) else []
    for _ in range(limit):
        level = [c for node in level for c in (node.values() if isinstance(node, dict) else node)
                 if isinstance(c, (dict, list))]
        if not level:
            return False
    return bool(level)


def _json_problem(data: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        data.decode()
    except UnicodeDecodeError as bad:
        return f"invalid UTF-8 at byte {bad.start}"
    return str(exc)


def _too_deep(what: str, max_depth: int) -> str:
    return f"{what} nests arrays/objects more than {max_depth} levels deep."


def _json_type(obj: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")


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


_PATH = re.compile(r"at `\$\.?([^`]*)`")


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
    try:
        req = msgspec.convert(obj, type=kind)
    except msgspec.ValidationError as exc:
        m = _PATH.search(str(exc))
        param = m.group(1).split("[")[0].split(".")[0] if m and m.group(1) else None
        raise APIError(400, f"Invalid request: {exc}", param=param, code="invalid_type") from exc
    sampling = _sampling(req, limits)
    fields: dict[str, Any] = {"sampling": sampling, "body": raw}
    if isinstance(req, ChatRequest):
        fields["messages"] = _messages(req.messages)
    else:
        fields["prompt"] = _prompt(req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true.", param="stream_options")
    return ParsedRequest(endpoint=endpoint, stream=req.stream, include_usage=include_usage,
                         model=req.model, submit_fields=fields)


def _forwarded(endpoint: Endpoint, obj: dict[str, Any], raw: bytes, limits: Limits) -> ParsedRequest:
    """A body for vLLM's OpenAI layer in the engine: only what the gateway itself needs is checked here
    (``stream``, ``model``, tokenfan's ``--max-tokens-cap``); the engine validates the rest as vllm serve."""
    stream = obj.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean.", param="stream", code="invalid_type")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "model must be a string.", param="model", code="invalid_type")
    max_tokens = limits.default_max_tokens
    for param in ("max_tokens", "max_completion_tokens"):
        value = obj.get(param)
        if isinstance(value, int) and not isinstance(value, bool):
            if value > limits.max_tokens_cap:
                raise APIError(400, f"{param} must be at most {limits.max_tokens_cap} on this server, got {value}.",
                               param=param, code="invalid_value")
            max_tokens = max(1, value)
    options = obj.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    sampling = p.Sampling(max_tokens=min(max_tokens, limits.max_tokens_cap))
    return ParsedRequest(endpoint=endpoint, stream=bool(stream), include_usage=include_usage, model=model,
                         submit_fields={"sampling": sampling, "body": raw})


def _check_range(name: str, value: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if math.isnan(value) or value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise APIError(400, f"{name} must be in {bracket}{lo}, {hi}], got {value}.", param=name,
                       code="invalid_value")


def _sampling(req: ChatRequest | CompletionRequest, limits: Limits) -> p.Sampling:
    max_tokens = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, limits.max_tokens_cap)
    if max_tokens < 1:
        raise APIError(400, f"{param} must be at least 1, got {max_tokens}.", param=param, code="invalid_value")
    if max_tokens > limits.max_tokens_cap:
        raise APIError(400, f"{param} must be at most {limits.max_tokens_cap} on this server, got {max_tokens}.",
                       param=param, code="invalid_value")
    _check_range("temperature", req.temperature, 0.0, 2.0)
    _check_range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    _check_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    top_k = req.top_k
    if top_k is not None and top_k < -1:
        raise APIError(400, f"top_k must be -1 (disabled) or positive, got {top_k}.", param="top_k",
                       code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop:
        raise APIError(400, f"stop allows at most {limits.max_stop} strings.", param="stop", code="invalid_value")
    if any(s == "" for s in stop):
        raise APIError(400, "stop strings must not be empty.", param="stop", code="invalid_value")
    return p.Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if top_k in (None, 0) else top_k,  # type: ignore[arg-type]
        seed=req.seed, stop=stop,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        ignore_eos=req.ignore_eos,
    )


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _messages(messages: list[InMessage]) -> list[p.ChatMessage]:
    if not messages:
        raise APIError(400, "messages must be a non-empty array.", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {sorted(_ROLES)}, got {m.role!r}.",
                           param=f"messages[{i}].role", code="invalid_value")
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported.",
                                   param=f"messages[{i}].content", code="unsupported_parameter")
                texts.append(part["text"])
            content = "".join(texts)
        else:
            content = m.content or ""
        out.append(p.ChatMessage(role="system" if m.role == "developer" else m.role, content=content))
    return out


def _prompt(req: CompletionRequest) -> str:
    prompt = req.prompt
    if prompt is None:
        raise APIError(400, "prompt is required.", param="prompt", code="invalid_value")
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        raise APIError(400, "prompt must be a single string (batched and token-id prompts are not supported).",
                       param="prompt", code="unsupported_parameter")
    return prompt


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

    def __init__(self, endpoint: Endpoint, request_id: str, model: str, include_usage: bool) -> None:
        self.endpoint = endpoint
        self.chat = endpoint == "chat.completions"
        self.include_usage = include_usage
        self._base: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
        }

    @property
    def model(self) -> str:
        return str(self._base["model"])

    @property
    def request_id(self) -> str:
        return str(self._base["id"])

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
