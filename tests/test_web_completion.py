"""The chat page's chunk accumulator (``web/js/completion.js``) folds chat completion chunks exactly as the
``openai`` npm package's ``ChatCompletionStream`` does: both run in Node on the same chunks
(``tests/node/chat_accumulate.mjs``) and must agree on every choice's content, tool calls and finish reason."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

SCRIPT = "chat_accumulate.mjs"  # in tests/node: the session's ``node_dir`` fixture installs its packages


def chunk(*choices: dict[str, Any], usage: dict[str, int] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
                         "choices": list(choices)}
    if usage:
        c["usage"] = usage
    return c


def delta(index: int, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": fields, "logprobs": None, "finish_reason": finish}


def call(index: int, arguments: str | None = None, **head: Any) -> dict[str, Any]:
    """One tool-call delta; ``head`` (id, type, name) only on a call's first delta, as vLLM sends it."""
    fn: dict[str, Any] = {}
    if "name" in head:
        fn["name"] = head.pop("name")
    if arguments is not None:
        fn["arguments"] = arguments
    return {"index": index, **head, "function": fn}


def fold(node_dir: Path, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    proc = subprocess.run(["node", str(node_dir / SCRIPT)], input=json.dumps(chunks), capture_output=True,
                          text=True, timeout=60, env={**os.environ, "NODE_NO_WARNINGS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_interleaved_tool_calls_of_two_choices_fold_as_in_the_openai_sdk(node_dir: Path) -> None:
    weather = {"id": "call_a", "type": "function", "name": "get_weather"}
    chunks = [
        chunk(delta(0, role="assistant", content=""), delta(1, role="assistant", content="")),
        chunk(delta(0, content=None, tool_calls=[call(0, **weather)])),
        chunk(delta(1, content="Let me check. ")),
        chunk(delta(0, tool_calls=[call(0, '{"ci')])),
        # a second call starts before the first one's arguments are complete; one chunk carries both
        chunk(delta(0, tool_calls=[call(1, "", id="call_b", type="function", name="get_time"),
                                   call(0, 'ty": "Par')])),
        chunk(delta(1, tool_calls=[call(0, '{"city":', id="call_c", type="function", name="get_weather")])),
        chunk(delta(0, tool_calls=[call(0, 'is"}'), call(1, '{"zone": "CET"}')])),
        chunk(delta(1, tool_calls=[call(0, ' "Oslo"}')], content="")),
        chunk(delta(0, "tool_calls"), delta(1, "tool_calls", tool_calls=[call(0, "")])),
        chunk(usage={"prompt_tokens": 9, "completion_tokens": 30, "total_tokens": 39}),
    ]
    out = fold(node_dir, chunks)
    assert out["page"] == out["sdk"]
    assert out["page"] == [
        {"index": 0, "content": "", "finish_reason": "tool_calls", "tool_calls": [
            {"index": 0, "id": "call_a", "type": "function", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"index": 1, "id": "call_b", "type": "function", "name": "get_time", "arguments": '{"zone": "CET"}'}]},
        {"index": 1, "content": "Let me check. ", "finish_reason": "tool_calls", "tool_calls": [
            {"index": 0, "id": "call_c", "type": "function", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]},
    ]


def test_text_split_anywhere_and_a_cut_call_fold_as_in_the_openai_sdk(node_dir: Path) -> None:
    text = '{"forecast": "sunny", "temperature_c": 21} — é 日本'
    chunks = [chunk(delta(0, role="assistant", content=""))]
    chunks += [chunk(delta(0, content=text[i:i + 3])) for i in range(0, len(text), 3)]
    chunks += [chunk(delta(0, tool_calls=[call(0, '{"city": "Ber', id="call_x", type="function",
                                               name="get_weather")])),
               chunk(delta(0, "length"))]  # cut by max_tokens mid-arguments
    out = fold(node_dir, chunks)
    assert out["page"] == out["sdk"]
    assert out["page"][0]["content"] == text
    assert out["page"][0]["tool_calls"][0]["arguments"] == '{"city": "Ber'
    assert out["page"][0]["finish_reason"] == "length"
