"""The Responses API's objects (pure): the ``Response`` with the request's settings echoed, its output items
and parts, usage, the ``error`` event and a failed response's ``error``. A cancelled response's stream ends
with an ``error`` event of code ``response_cancelled`` (the SDKs have no cancel event); its object has status
``cancelled``."""

from __future__ import annotations

import uuid
from typing import Any

from engine_worker import protocol as p
from gateway.api.responses.request import CreateRequest, ResponsesRequest, Status
from gateway.errors import APIError


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


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


_FAILED_CODES = {429: "rate_limit_exceeded"}


def failure_object(err: APIError) -> dict[str, Any]:
    """``Response.error`` for a failed response. The SDKs type its ``code`` as a closed set, so
    tokenfan's code travels in ``type`` and the message."""
    code = _FAILED_CODES.get(err.status, "invalid_prompt" if 400 <= err.status < 500 else "server_error")
    return {"code": code, "message": err.message, "param": err.param, "type": err.code or err.type}
