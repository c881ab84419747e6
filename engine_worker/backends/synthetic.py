"""Synthetic backend: a deterministic, paced token source for transport tests and benchmarks.

It is *not* a model. Tokens are words (with their leading space) drawn from a built-in
corpus, starting at an offset derived from the request's seed (or its prompt), so the same
request always yields the same text. Time to first token and tokens/s are configurable; a
request produces exactly ``max_tokens`` tokens unless a stop string ends it earlier.
Tokens are scheduled on an absolute clock, so a late wake-up emits every token that is due
in one step (as a real engine step would) instead of drifting.

With ``--synthetic-script`` it also plays a model for vLLM's OpenAI layer (tools, reasoning): see
:mod:`engine_worker.backends.scripted`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from engine_worker.backends import vllm_fields, vllm_openai
from engine_worker.backends.base import BackendInfo, Prepared, RequestRejected, Step
from engine_worker.backends.vllm_openai import PLAIN_FIELDS, decode_body, is_plain
from engine_worker.config import EngineConfig
from engine_worker.protocol import ChatMessage, Submit

log = logging.getLogger(__name__)

CORPUS = (
    "The gateway receives token deltas from the engine and writes them to every subscriber. "
    "A stream may be read by a browser through EventSource or by a WebSocket client, and both "
    "see the same tokens in the same order. When a connection drops, the client resumes from the "
    "last event it saw, and nothing is lost or repeated. Latency is measured from the moment the "
    "engine emits a delta to the moment the client receives it. Good systems stay fast under load, "
    "tell every client what happened when something fails, and never let one slow reader delay "
    "the others. Rivers run to the sea, mountains hold the snow, and the night is full of quiet "
    "stars. Every request is isolated, every limit is documented, and every error has a clear "
    "message. A small model on a small machine can still teach us how the whole path behaves."
)
_WORDS = re.findall(r"\s*\S+", CORPUS)
_WORD = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """The synthetic tokenizer: words and punctuation marks."""
    return len(_WORD.findall(text))


class SyntheticBackend:
    """Paced corpus text. See the module docstring."""

    MODEL_ID = "synthetic"

    def __init__(self, config: EngineConfig) -> None:
        if config.synthetic_tokens_per_s <= 0:
            raise ValueError("--synthetic-tokens-per-s must be > 0")
        self._config = config
        self._info = BackendInfo(kind="synthetic", model=self.MODEL_ID, max_model_len=config.max_model_len)
        self._waiting = 0
        self._running = 0
        self._openai: vllm_openai.OpenAILayer | None = None

    @property
    def info(self) -> BackendInfo:
        return self._info

    async def start(self) -> None:
        if self._config.synthetic_script is not None:
            self._start_scripted()
        log.warning(
            "synthetic engine: NOT a model; paced corpus text (ttft=%.1f ms, %.1f tokens/s per stream)",
            self._config.synthetic_ttft_ms, self._config.synthetic_tokens_per_s,
        )

    def _start_scripted(self) -> None:
        from engine_worker.backends.scripted import ScriptedEngine, load_script
        from engine_worker.models import resolve_model

        config = self._config
        if config.model is None:
            raise ValueError("--synthetic-script needs --model DIR: the tokenizer and chat template it renders with")
        vllm_openai.check_parser_flags(config)
        script = load_script(config.synthetic_script or "")
        model_dir = resolve_model(config)
        name = config.served_model_name or model_dir.name
        chat_template = Path(config.chat_template).read_text(encoding="utf-8") if config.chat_template else None
        fallback = tuple(_WORDS[:64])
        engine = ScriptedEngine(config, model_dir, name, script, fallback)
        self._openai = vllm_openai.OpenAILayer(config, engine, name, str(model_dir), chat_template)  # type: ignore[arg-type]
        self._info = BackendInfo(kind="synthetic", model=name, max_model_len=engine.model_config.max_model_len)
        log.warning("synthetic engine: scripted replies from %s (%d entries) under vLLM's OpenAI layer, %s's "
                    "tokenizer", config.synthetic_script, len(script), model_dir)

    async def prepare(self, submit: Submit) -> Prepared:
        if submit.body:
            body = decode_body(submit.body)
            if self._openai is not None and (prepared := await self._openai.prepare(submit, body)) is not None:
                return prepared  # --synthetic-script: the scripted model under vLLM's layer
            _refuse_model_fields(submit.endpoint, body)
            if submit.messages is None and submit.prompt is None:  # forwarded whole: only ignored fields added
                submit = _plain_submit(submit, body)
        if submit.messages is not None:
            text = "".join(f"<{m.role}>{m.content}\n" for m in submit.messages)
        else:
            text = submit.prompt or ""
        prompt_tokens = count_tokens(text)
        max_tokens = submit.sampling.max_tokens
        if prompt_tokens + max_tokens > self._info.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self._info.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
                code="context_length_exceeded",
                param="messages" if submit.messages is not None else "prompt",
            )
        seed = submit.sampling.seed if submit.sampling.seed is not None else zlib.crc32(text.encode())
        return Prepared(submit=submit, prompt_tokens=prompt_tokens, payload=seed % len(_WORDS))

    async def generate(self, prepared: Prepared) -> AsyncIterator[Step]:
        if prepared.openai:
            assert self._openai is not None
            self._running += 1
            try:
                async for step in self._openai.steps(prepared.payload):  # type: ignore[arg-type]
                    yield step
            finally:
                self._running -= 1
            return
        sampling = prepared.submit.sampling
        offset = int(prepared.payload)  # type: ignore[call-overload]
        interval = 1.0 / self._config.synthetic_tokens_per_s
        start = time.monotonic() + self._config.synthetic_ttft_ms / 1000.0
        emitted = 0
        text_so_far = ""
        self._waiting += 1
        started = False
        try:
            while emitted < sampling.max_tokens:
                due = start + emitted * interval
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not started:
                    started = True
                    self._waiting -= 1
                    self._running += 1
                # Every token due by now goes out in this step.
                now = time.monotonic()
                n = min(sampling.max_tokens - emitted, 1 + max(0, int((now - due) / interval)))
                piece = "".join(self._token(offset + emitted + i) for i in range(n))
                emitted += n
                stop_at = _find_stop(text_so_far, piece, sampling.stop)
                if stop_at is not None:
                    yield Step(text=piece[:stop_at], token_count=n, finish_reason="stop")
                    return
                text_so_far += piece
                yield Step(text=piece, token_count=n, finish_reason="length" if emitted >= sampling.max_tokens else None)
            if sampling.max_tokens == 0:
                yield Step(text="", token_count=0, finish_reason="length")
        finally:
            if started:
                self._running -= 1
            else:
                self._waiting -= 1

    def _token(self, i: int) -> str:
        word = _WORDS[i % len(_WORDS)]
        pad = self._config.synthetic_token_chars
        if pad and len(word) < pad:  # payload-size knob: stretch the word, keep it deterministic
            core = word.lstrip()
            word = word[: len(word) - len(core)] + (core * (pad // max(1, len(core)) + 1))[:pad]
        return word

    async def abort(self, request_id: str) -> None:
        # Generation is a plain async generator: the server closing it is the abort.
        return None

    def load(self) -> tuple[int, int]:
        return self._running, self._waiting

    async def shutdown(self) -> None:
        return None


def _refuse_model_fields(endpoint: str, body: dict[str, Any]) -> None:
    """A 400 naming the first field only a model can honour (tools, logprobs, structured outputs …): a
    field vllm serve knows, set to something else than its default. Fields vllm serve ignores are ignored."""
    if is_plain(body):
        return
    defaults = vllm_fields.DEFAULTS[endpoint]
    for name in sorted(body):
        if name in PLAIN_FIELDS or name not in defaults or body[name] == defaults[name]:
            continue
        _refuse(name)
    if body.get("n", 1) not in (1, None):
        _refuse("n")
    if not is_plain({k: v for k, v in body.items() if k in PLAIN_FIELDS}):
        _refuse("messages" if endpoint == "chat.completions" else "prompt")


def _plain_submit(submit: Submit, body: dict[str, Any]) -> Submit:
    """The plain request inside a forwarded body whose other fields vllm serve ignores too."""
    stop = body.get("stop") or []
    sampling = msgspec.structs.replace(
        submit.sampling, seed=body.get("seed"), stop=[stop] if isinstance(stop, str) else list(stop))
    if submit.endpoint == "chat.completions":
        messages = [ChatMessage(role=str(m.get("role")), content=_text(m.get("content")))
                    for m in body.get("messages") or []]
        return msgspec.structs.replace(submit, sampling=sampling, messages=messages)
    prompt = body.get("prompt")
    return msgspec.structs.replace(submit, sampling=sampling, prompt=prompt[0] if isinstance(prompt, list) else prompt)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _refuse(param: str) -> None:
    raise RequestRejected(
        f"`{param}` is not supported by the synthetic engine (paced corpus text, not a model): serve a model "
        "with --engine vllm for tools, structured outputs, logprobs, n > 1 and the other fields of vllm serve",
        code="invalid_request", param=param)


def _find_stop(before: str, piece: str, stops: list[str]) -> int | None:
    """Index in ``piece`` where the earliest stop string begins, if any completes in it."""
    if not stops:
        return None
    window_start = max(0, len(before) - max(len(s) for s in stops))
    haystack = before[window_start:] + piece
    base = len(before) - window_start
    best: int | None = None
    for s in stops:
        i = haystack.find(s)
        while i != -1 and i + len(s) <= base:  # match lies wholly in earlier text: not new
            i = haystack.find(s, i + 1)
        if i != -1:
            cut = max(0, i - base)
            best = cut if best is None else min(best, cut)
    return best
