"""A Responses request as the chat-completions body the engine serves (pure, no I/O).

The engine has one model-facing path, the chat one: vLLM's own OpenAI layer renders tools into the chat
template, turns ``response_format`` into structured outputs and runs the configured tool and reasoning
parsers. A Responses request is therefore translated here into the chat body ``vllm serve``'s own
``/v1/responses`` builds internally (``vllm/entrypoints/openai/responses/utils.py``):

- ``input`` items -> chat messages: messages (``developer`` as ``system``, text parts as chat text parts,
  which vLLM's chat layer joins), ``function_call`` -> an assistant message's ``tool_calls`` (merged into the assistant message just
  before it, as vLLM does), ``function_call_output`` -> a ``tool`` message, ``reasoning`` -> the assistant
  message's ``reasoning``;
- function ``tools`` -> chat tools (``{"type": "function", "function": {name, description, parameters,
  strict}}``), ``tool_choice`` likewise, ``text.format`` -> ``response_format``, ``reasoning.effort`` ->
  ``reasoning_effort``; vLLM's own extension fields that mean the same on both APIs
  (:data:`FORWARDED`) pass through, and the engine validates everything with vLLM's chat request model.

A transcript (what ``previous_response_id`` continues) is a list of such chat messages. Deliberate
differences from vLLM: other tool types (built-in, MCP, custom) and content other than text are refused
with a 400 naming the item instead of being ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.api.validation import invalid, text_content, unsupported

Message = dict[str, Any]  # one chat message, as the chat API takes it

# vLLM extension fields of its Responses request that mean the same on its chat request: passed through.
FORWARDED = ("chat_template_kwargs", "structured_outputs", "seed", "top_k", "min_p", "stop", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "include_reasoning")

# a chat field named by the engine's validation error -> the Responses field the client set
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort", "tools": "tools", "tool_choice": "tool_choice"}

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat field the engine named in an error (``messages[3]`` is some
    input item or the history: just ``input``)."""
    if param is None:
        return None
    base, sep, rest = param.partition("[") if "[" in param.split(".")[0] else param.partition(".")
    mapped = _PARAMS.get(base)
    if mapped is None:
        return param
    return "input" if mapped == "input" else mapped + sep + rest


# -- input items -> chat messages ------------------------------------------------------------------


def input_messages(value: str | list[dict[str, Any]] | None, *, allow_empty: bool = False) -> list[Message]:
    """``input`` (a string, or a list of items) -> chat messages."""
    if value is None:
        if allow_empty:
            return []
        raise invalid("input", "input is required.")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value and not allow_empty:
        raise invalid("input", "input must be a string or a non-empty list of messages.")
    out: list[Message] = []
    for i, item in enumerate(value):
        _add_item(out, i, item)
    return out


def _add_item(out: list[Message], i: int, item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    prev = out[-1] if out and out[-1]["role"] == "assistant" else None
    if kind == "message":
        msg = _message(i, item)
        if prev is not None and msg["role"] == "assistant" and prev.get("content") is None:
            prev["content"] = msg["content"]
        else:
            out.append(msg)
    elif kind == "function_call":
        call = _function_call(i, item)
        if prev is not None:
            prev["tool_calls"] = [*prev.get("tool_calls", ()), call]
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        out.append(_function_call_output(i, item))
    elif kind == "reasoning":
        text = _reasoning_text(i, item)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            out.append({"role": "assistant", "content": None, "reasoning": text})
    else:
        raise unsupported(f"input[{i}]", f"input items of type {kind!r} are not supported; only message, "
                                         "function_call, function_call_output and reasoning items are")


def _message(i: int, item: dict[str, Any]) -> Message:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"input[{i}].role", f"input[{i}].role must be one of {sorted(_ROLES)}, got {role!r}.")
    return {"role": _ROLES[role], "content": _chat_content(text_content(f"input[{i}].content", item.get("content"),
                                                                        _TEXT_PARTS))}


def _chat_content(content: str | list[str]) -> str | list[dict[str, str]]:
    """Text parts as chat text parts (vLLM's chat layer joins them as the template wants)."""
    return content if isinstance(content, str) else [{"type": "text", "text": t} for t in content]


def _string(item: dict[str, Any], i: int, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"input[{i}].{key}", f"input[{i}].{key} must be a string.")
    return value


def _function_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"id": _string(item, i, "call_id"), "type": "function",
            "function": {"name": _string(item, i, "name"), "arguments": _string(item, i, "arguments")}}


def _function_call_output(i: int, item: dict[str, Any]) -> Message:
    output = text_content(f"input[{i}].output", item.get("output"), _TEXT_PARTS)
    return {"role": "tool", "tool_call_id": _string(item, i, "call_id"), "content": _chat_content(output)}


def _reasoning_text(i: int, item: dict[str, Any]) -> str:
    if item.get("encrypted_content"):
        raise unsupported(f"input[{i}].encrypted_content", "encrypted reasoning is not supported by this server")
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
            return str(parts[0]["text"])
    return ""


# -- tools, tool_choice, text.format --------------------------------------------------------------


def function_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` (Responses function tools) -> the same tools as the Response echoes them."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools", "tools must be an array.")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(f"tools[{i}]", f"tools of type {kind!r} are not supported; only function tools are")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid(f"tools[{i}].name", f"tools[{i}].name must be a non-empty string.")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise invalid(f"tools[{i}].parameters", f"tools[{i}].parameters must be a JSON schema object.")
        out.append({"type": "function", "name": tool["name"], "description": tool.get("description"),
                    "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return out


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}}
            for t in tools]


def tool_choice(value: Any) -> str | dict[str, Any] | None:
    """``tool_choice`` checked: ``none``, ``auto``, ``required`` or a named function (Responses form)."""
    if value is None or value in ("none", "auto", "required"):
        return value  # type: ignore[no-any-return]
    if isinstance(value, dict) and value.get("type") == "function":
        if not isinstance(value.get("name"), str):
            raise invalid("tool_choice", "tool_choice.name must be a string.")
        return {"type": "function", "name": value["name"]}
    kind = value.get("type") if isinstance(value, dict) else value
    raise unsupported("tool_choice", f"tool_choice {kind!r} is not supported; use 'none', 'auto', 'required' or "
                                     "{'type': 'function', 'name': ...}")


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` checked (None: plain text), in the form the Response echoes."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise unsupported("text.format", f"output format {kind!r} is not supported; use text, json_schema or "
                                         "json_object")
    assert isinstance(fmt, dict)
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise invalid("text.format", "text.format of type json_schema needs a string name and a schema object.")
    return {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"],
            "description": fmt.get("description"), "strict": fmt.get("strict")}


def response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: v for k, v in fmt.items() if k != "type" and v is not None}
    return {"type": "json_schema", "json_schema": schema}


# -- transcripts ----------------------------------------------------------------------------------


def encode_transcript(transcript: list[Message]) -> bytes:
    """A transcript as bytes (to retain with a stored response, or carry through the broker)."""
    return msgspec.msgpack.encode(transcript)


def transcript_chars(transcript: list[Message]) -> int:
    """The text a transcript holds: contents, reasoning, tool-call names and arguments."""
    n = 0
    for m in transcript:
        n += sum(len(m[k]) for k in ("content", "reasoning") if isinstance(m.get(k), str))
        if isinstance(m.get("content"), list):
            n += sum(len(part.get("text") or "") for part in m["content"] if isinstance(part, dict))
        for call in m.get("tool_calls") or ():
            n += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return n


def decode_transcript(data: bytes) -> list[Message]:
    """Bytes from :func:`encode_transcript` (or from an older gateway: ``[role, content]`` pairs)."""
    items = msgspec.msgpack.decode(data)
    return [{"role": m[0], "content": m[1]} if isinstance(m, list) else m for m in items]
