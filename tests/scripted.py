"""The scripted engine the suite shares: ``tokenfan serve --engine synthetic --synthetic-script`` with the tiny
model's tokenizer and chat template (no weights) behind vLLM's ``hermes`` tool parser and ``qwen3`` reasoning
parser. One script serves tests/e2e/test_scripted_parsers.py (the rules first) and the tool examples of the docs
(tests/e2e/test_docs_examples.py: a weather question gets a call of ``get_weather``, its result an answer)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.procs import spawn
from tokenfan_bench.servers.processes import Proc, free_port, wait_healthy

THINK = "<think>The user wants the weather.</think>"
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
SPLITS = (1, 2, 3, 5, 7, 11, 64)  # characters per engine step


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


PARSER_SCRIPT = [
    *({"match": f"split {k}\\b", "reply": pieces(THINK + CALLS, k)} for k in SPLITS),
    {"match": "tool says", "reply": pieces(THINK + "It is 18 C in Paris.", 4)},
    {"match": "just think", "reply": ["<thi", "nk>hm", "m</th", "ink>Bon", "jour"]},
]
DOCS_SCRIPT = [
    # an answer ends its thinking first: vLLM's qwen3 parser reads a reply without </think> as all reasoning
    {"match": "18 C|celsius", "reply": ["<think>The tool answered.</think>", "It is 18 C", " in Paris."]},
    {"match": "[Ww]eather", "reply": ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
                                      "\n</tool_call>"]},
    {"match": "Paris in France", "reply": ['{"answer": "yes"}']},
    {"match": "haiku about rivers", "reply": ["<think>Five, seven, five.</think>", "Water finds its way\n",
                                              "around the stone, through the years\n", "the valley listens"]},
]


def start_scripted(tiny_model: Path, folder: Path) -> tuple[Proc, str]:
    script = folder / "script.json"
    script.write_text(json.dumps([*PARSER_SCRIPT, *DOCS_SCRIPT]))
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", "--engine", "synthetic", "--synthetic-script", str(script),
                  "--model", str(tiny_model), "--served-model-name", "tiny", "--port", str(port),
                  "--synthetic-tokens-per-s", "2000", "--enable-auto-tool-choice", "--tool-call-parser",
                  "hermes", "--reasoning-parser", "qwen3"], "scripted-serve")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=300)
    except BaseException:
        proc.stop(timeout=30)
        raise
    return proc, url
