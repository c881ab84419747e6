"""Which chat and completions bodies tokenfan's plain path serves (pure; shared by both processes).

The gateway validates and submits such a body as typed fields; the engine renders and tokenizes it. Any
other body (tools, ``response_format``, logprobs, ``n`` > 1, …) is forwarded whole and served by vLLM's own
OpenAI layer (:mod:`engine_worker.backends.vllm_openai`).
"""

from __future__ import annotations

from typing import Any

# Top-level fields the plain path serves exactly as vllm serve does (anything else takes vLLM's layer).
PLAIN_FIELDS = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "ignore_eos",
    "user", "n",
})
_PLAIN_MESSAGE_FIELDS = frozenset({"role", "content"})
_PLAIN_ROLES = frozenset({"system", "user", "assistant"})


def is_plain(body: dict[str, Any]) -> bool:
    """Whether a chat/completions body needs nothing beyond tokenfan's plain path (pure, cheap)."""
    if not body.keys() <= PLAIN_FIELDS or body.get("n", 1) not in (1, None):
        return False
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not options.keys() <= {"include_usage"}):
        return False
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str) and not (
            isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)):
        return False  # token ids and batches: vLLM's layer
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict) or not m.keys() <= _PLAIN_MESSAGE_FIELDS or m.get("role") not in _PLAIN_ROLES:
                return False
            content = m.get("content")
            if isinstance(content, list) and not all(
                    isinstance(part, dict) and part.get("type") == "text" and part.keys() <= {"type", "text"}
                    for part in content):
                return False
    return True
