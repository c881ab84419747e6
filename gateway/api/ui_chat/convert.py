"""The AI SDK chat transport's POST body -> a chat completions body (pure, no I/O).

``DefaultChatTransport`` (``ai`` 7.0.173, ``src/ui/http-chat-transport.ts``) posts
``{...body, id, messages, trigger, messageId}``: the chat's id, its UI messages (``src/ui/ui-messages.ts``),
``submit-message`` or ``regenerate-message``, and the id of the message being edited. Everything else in the
body is the app's (the transport's ``body`` option): here, chat completions settings under their chat
completions names (``max_tokens``, ``temperature``, ``tools``, ``tool_choice``, vLLM's extra fields …), plus
``system``, a system prompt put first. The result is validated by :func:`gateway.api.chat_request.parse_request`
exactly as a ``POST /v1/chat/completions`` body.

UI messages become chat messages as the SDK's ``convertToModelMessages`` splits them: an assistant message is
one chat turn per step (``step-start`` parts divide them): its text as ``content``, its reasoning as
``reasoning`` (vLLM's field for earlier thinking), its tool parts as ``tool_calls``, each followed by a
``tool`` message with the call's output (or its ``errorText``). ``source-*`` and ``data-*`` parts carry no
model input and are skipped, as ``convertToModelMessages`` skips them. Refused (400 naming the part): file
parts, tool calls without an output, tool approval states, and part types this version does not know.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.api.validation import invalid, unsupported
from gateway.errors import APIError

TRIGGERS = ("submit-message", "regenerate-message")
TRANSPORT_FIELDS = ("id", "messages", "trigger", "messageId", "system")
MAX_CHAT_ID = 256
SKIPPED_PARTS = ("source-url", "source-document", "step-start")  # step-start splits steps, see below
DONE_TOOL_STATES = ("output-available", "output-error")


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One POST: the chat's id, the id the answer's UI message gets, and the chat completions body."""

    chat_id: str
    message_id: str
    body: dict[str, Any]


def chat_id_of(value: object, param: str = "id") -> str:
    """A chat id as the transport sends it (any non-empty string up to 256 characters, no control codes)."""
    if not isinstance(value, str) or not value:
        raise invalid(param, f"{param} must be a non-empty string (the chat's id).")
    if len(value) > MAX_CHAT_ID or any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise invalid(param, f"{param} must be at most {MAX_CHAT_ID} printable characters.")
    return value


def chat_turn(obj: dict[str, Any]) -> ChatTurn:
    """The transport's decoded body -> :class:`ChatTurn`, or :class:`APIError` 400 naming the field."""
    chat_id = chat_id_of(obj.get("id"))
    trigger = obj.get("trigger", "submit-message")
    if trigger not in TRIGGERS:
        raise invalid("trigger", f"trigger must be one of {', '.join(TRIGGERS)}, got {trigger!r}.")
    ui_messages = obj.get("messages")
    if not isinstance(ui_messages, list) or not ui_messages:
        raise invalid("messages", "messages must be a non-empty array of UI messages.")
    messages: list[dict[str, Any]] = []
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise invalid("system", "system must be a string.")
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(ui_messages):
        messages.extend(chat_messages(m, f"messages[{i}]"))
    if obj.get("n", 1) not in (1, None):
        raise unsupported("n", "a chat answer is one message; n must be 1")
    body = {k: v for k, v in obj.items() if k not in TRANSPORT_FIELDS}
    body.update(messages=messages, stream=True)
    return ChatTurn(chat_id, response_message_id(ui_messages), body)


def response_message_id(ui_messages: list[Any]) -> str:
    """The answer's message id, as the SDK's ``getResponseUIMessageId`` picks it: the last message's when that
    is an assistant message being continued (a tool loop's next step), else a new one."""
    last = ui_messages[-1]
    if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("id"), str) and last["id"]:
        return str(last["id"])
    return "msg-" + uuid.uuid4().hex


def chat_messages(m: Any, where: str) -> list[dict[str, Any]]:
    """One UI message -> its chat messages (an assistant message may give several, see the module doc)."""
    if not isinstance(m, dict):
        raise invalid(where, f"{where} must be a UI message object.")
    role = m.get("role")
    parts = m.get("parts")
    if role not in ("system", "user", "assistant"):
        raise invalid(f"{where}.role", f"{where}.role must be system, user or assistant, got {role!r}.")
    if not isinstance(parts, list):
        raise invalid(f"{where}.parts", f"{where}.parts must be an array.")
    if role == "assistant":
        return _assistant(parts, where)
    texts = []
    for j, part in enumerate(parts):
        kind = _kind(part, f"{where}.parts[{j}]")
        if kind == "text":
            texts.append(_text(part, f"{where}.parts[{j}]"))
        elif not _skipped(kind):
            raise _refused(kind, f"{where}.parts[{j}]", role)
    return [{"role": role, "content": "".join(texts)}]


class _Step:
    """An assistant step being collected: its text, reasoning, calls and their results."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []

    def messages(self) -> list[dict[str, Any]]:
        if not (self.text or self.reasoning or self.calls):
            return []
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) or None}
        if self.reasoning:
            turn["reasoning"] = "".join(self.reasoning)
        if self.calls:
            turn["tool_calls"] = self.calls
        elif turn["content"] is None:
            turn["content"] = ""
        return [turn, *self.results]


def _assistant(parts: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    step = _Step()
    for j, part in enumerate(parts):
        here = f"{where}.parts[{j}]"
        kind = _kind(part, here)
        if kind == "step-start":
            out.extend(step.messages())
            step = _Step()
        elif kind == "text":
            step.text.append(_text(part, here))
        elif kind == "reasoning":
            step.reasoning.append(_text(part, here))
        elif kind == "dynamic-tool" or kind.startswith("tool-"):
            call, result = _tool(part, kind, here)
            step.calls.append(call)
            step.results.append(result)
        elif not _skipped(kind):
            raise _refused(kind, here, "assistant")
    out.extend(step.messages())
    return out


def _tool(part: dict[str, Any], kind: str, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tool part -> (the assistant's ``tool_calls`` entry, the ``tool`` message with its result)."""
    name = part.get("toolName") if kind == "dynamic-tool" else kind[len("tool-"):]
    call_id = part.get("toolCallId")
    state = part.get("state")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.toolName", f"{where} needs the tool's name.")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.toolCallId", f"{where}.toolCallId must be a non-empty string.")
    if state not in DONE_TOOL_STATES:
        if isinstance(state, str) and state.startswith("approval") or state == "output-denied":
            raise unsupported(f"{where}.state", f"tool approval ({state!r}) is not supported by this server")
        raise invalid(f"{where}.state", f"{where} is a tool call without a result (state {state!r}); send it "
                                        "once it has an output (addToolResult) or an error.")
    arguments = orjson.dumps(part.get("input") if part.get("input") is not None else {}).decode()
    if state == "output-error":
        content = part.get("errorText")
        if not isinstance(content, str):
            raise invalid(f"{where}.errorText", f"{where}.errorText must be a string.")
    else:
        output = part.get("output")
        content = output if isinstance(output, str) else orjson.dumps(output).decode()
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return call, {"role": "tool", "tool_call_id": call_id, "content": content}


def _kind(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str):
        raise invalid(where, f"{where} must be a UI message part with a string type.")
    return kind


def _text(part: dict[str, Any], where: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", f"{where}.text must be a string.")
    return text


def _skipped(kind: str) -> bool:
    return kind in SKIPPED_PARTS or kind.startswith("data-")


def _refused(kind: str, where: str, role: str) -> APIError:
    if kind == "file":
        return unsupported(where, "file parts (images, documents) are not supported by this server; send text")
    return unsupported(where, f"{role} message parts of type {kind!r} are not supported by this server")
