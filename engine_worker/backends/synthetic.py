"""Synthetic backend: a deterministic, paced token source for transport tests and benchmarks.

It is *not* a model. Tokens are words (with their leading space) drawn from a built-in
corpus, starting at an offset derived from the request's seed (or its prompt), so the same
request always yields the same text. Time to first token and tokens/s are configurable; a
request produces exactly ``max_tokens`` tokens unless a stop string ends it earlier.
Tokens are scheduled on an absolute clock, so a late wake-up emits every token that is due
in one step (as a real engine step would) instead of drifting.

One timer drives every request, like an engine's step loop: :meth:`SyntheticBackend._tick` runs when
the earliest token is due and emits every token due by then, for all requests, in one synchronous pass
(a heap of next-due times; no task, sleep or generator per request and token). With
``--synthetic-steps shared`` every request's tokens fall on one step clock (multiples of the token
interval), so a step carries a token of every running request, as continuous batching on a GPU does;
by default each request keeps its own phase and a step usually carries one token.

With ``--synthetic-script`` it also plays a model for vLLM's OpenAI layer (tools, reasoning): see
:mod:`engine_worker.backends.scripted`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from engine_worker.backends import vllm_fields, vllm_openai
from engine_worker.backends.base import BackendInfo, Prepared, RequestRejected, StepSink, feed
from engine_worker.backends.vllm_openai import decode_body
from engine_worker.config import EngineConfig
from engine_worker.plain_path import PLAIN_FIELDS, is_plain
from engine_worker.protocol import ChatMessage, FinishReason, Submit

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
TIMER_RESOLUTION = 0.001  # seconds: uvloop's clock (libuv's uv_now) moves in whole milliseconds
_WORD = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """The synthetic tokenizer: words and punctuation marks."""
    return len(_WORD.findall(text))


@dataclass(frozen=True, slots=True)
class _Start:
    """Where a request starts: its first corpus word, its token budget and, for a continuation, the text
    before it (a stop string may span the join)."""

    offset: int
    max_tokens: int
    tail: str = ""


@dataclass(eq=False, slots=True)
class _Paced:
    """One request on the pacing heap."""

    sink: StepSink
    done: asyncio.Future[None]
    offset: int  # corpus word of the first token
    max_tokens: int
    stops: list[str]
    start: float  # loop time of the first token
    emitted: int = 0
    tail: str = ""  # the last text, as long as the longest stop string (a stop may span steps)
    started: bool = False
    gone: bool = False  # finished or cancelled: dropped when its heap entry comes up


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
        self._interval = 1.0 / config.synthetic_tokens_per_s
        self._shared_steps = config.synthetic_steps == "shared"
        self._due: list[tuple[float, int, _Paced]] = []  # (loop time of the next token, tie-breaker, request)
        self._tie = itertools.count()
        self._timer: asyncio.Handle | None = None  # the pending tick (uvloop's handles have no when())
        self._timer_at = 0.0

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
            text = "".join(f"<{m.role}>{m.text}\n" for m in submit.messages)
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
        start = _Start(seed % len(_WORDS), max_tokens)
        if submit.resume:  # a continuation: the corpus word after the last one delivered
            resume = submit.resume
            if len(resume) >= max_tokens or any(not 0 <= i < len(_WORDS) for i in resume):
                raise RequestRejected("resume: not output tokens of this engine, or the whole budget", param="resume")
            stops = submit.sampling.stop
            tail = "".join(self._token(i) for i in resume[-16:])[-max(map(len, stops)):] if stops else ""
            start = _Start((resume[-1] + 1) % len(_WORDS), max_tokens - len(resume), tail)
        return Prepared(submit=submit, prompt_tokens=prompt_tokens, payload=start)

    async def stream(self, prepared: Prepared, sink: StepSink) -> None:
        if prepared.openai:
            assert self._openai is not None
            self._running += 1
            try:
                await feed(self._openai.steps(prepared.payload), sink)  # type: ignore[arg-type]
            finally:
                self._running -= 1
            return
        sampling = prepared.submit.sampling
        begin: _Start = prepared.payload  # type: ignore[assignment]
        if begin.max_tokens == 0:
            sink("", 0, "length")
            return
        loop = asyncio.get_running_loop()
        start = loop.time() + self._config.synthetic_ttft_ms / 1000.0
        if self._shared_steps:  # join the step clock at its next step
            start = math.ceil(start / self._interval) * self._interval
        req = _Paced(sink=sink, done=loop.create_future(), offset=begin.offset, max_tokens=begin.max_tokens,
                     stops=list(sampling.stop), start=start, tail=begin.tail)
        self._waiting += 1
        self._push(req, req.start)
        try:
            await req.done
        finally:
            req.gone = True
            if req.started:
                self._running -= 1
            else:
                self._waiting -= 1

    def _push(self, req: _Paced, due: float) -> None:
        heapq.heappush(self._due, (due, next(self._tie), req))
        if self._timer is None or due < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._schedule(due)

    def _schedule(self, due: float) -> None:
        self._timer = asyncio.get_running_loop().call_at(due, self._tick)
        self._timer_at = due

    def _tick(self) -> None:
        """The step: every token due by now, for every request, in one pass."""
        self._timer = None
        # Tokens due within the timer resolution go now: uvloop's clock moves in whole milliseconds, so a
        # timer for a later instant of the same millisecond would fire again at once, and again (a spin).
        now = asyncio.get_running_loop().time() + TIMER_RESOLUTION
        due = self._due
        while due and due[0][0] <= now:
            at, _, req = heapq.heappop(due)
            if not req.gone:
                self._step(req, at, now)
        if due and self._timer is None:
            self._schedule(due[0][0])

    def _step(self, req: _Paced, at: float, now: float) -> None:
        if not req.started:
            req.started = True
            self._waiting -= 1
            self._running += 1
        n = min(req.max_tokens - req.emitted, 1 + max(0, int((now - at) / self._interval)))
        first = req.offset + req.emitted
        piece = self._token(first) if n == 1 else "".join(self._token(first + i) for i in range(n))
        ids = [(first + i) % len(_WORDS) for i in range(n)]  # a token's id: its corpus word
        req.emitted += n
        finish: FinishReason | None = "length" if req.emitted >= req.max_tokens else None
        if req.stops:
            stop_at = _find_stop(req.tail, piece, req.stops)
            if stop_at is not None:
                piece, finish = piece[:stop_at], "stop"
            req.tail = (req.tail + piece)[-max(len(s) for s in req.stops):]
        try:
            req.sink(piece, n, finish, b"", ids)
        except Exception as exc:  # noqa: BLE001 - the request fails, the other requests of the step go on
            req.gone = True
            req.done.set_exception(exc)
            return
        if finish is not None:
            req.gone = True
            req.done.set_result(None)
        else:  # the tick that runs this schedules the next one (no timer per request)
            heapq.heappush(self._due, (req.start + req.emitted * self._interval, next(self._tie), req))

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
    stop, seed = body.get("stop") or [], body.get("seed")
    if not isinstance(stop, str) and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        _invalid("stop", "`stop` must be a string or a list of strings")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        _invalid("seed", "`seed` must be an integer")  # ([] reached the corpus offset as a 500 once)
    sampling = msgspec.structs.replace(
        submit.sampling, seed=seed, stop=[stop] if isinstance(stop, str) else list(stop))
    if submit.endpoint == "chat.completions":
        raw = body.get("messages") or []
        if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
            _invalid("messages", "`messages` must be a list of message objects")  # ({"": null} was a 500 once)
        messages = [ChatMessage(role=str(m.get("role")), content=_text(m.get("content"))) for m in raw]
        return msgspec.structs.replace(submit, sampling=sampling, messages=messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if not prompt or not isinstance(prompt[0], str):
            _invalid("prompt", "`prompt` must be a string or a non-empty list of strings")
        prompt = prompt[0]
    elif not isinstance(prompt, str):
        _invalid("prompt", "`prompt` must be a string or a non-empty list of strings")
    return msgspec.structs.replace(submit, sampling=sampling, prompt=prompt)


def _text(content: Any) -> str | list[str]:
    """A forwarded message's content as :class:`ChatMessage` takes it: a string, or its text parts' texts."""
    if isinstance(content, list):
        return [str(part.get("text", "")) for part in content if isinstance(part, dict)]
    return content if isinstance(content, str) else ""


def _invalid(param: str, message: str) -> None:
    raise RequestRejected(message, code="invalid_request", param=param)


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
