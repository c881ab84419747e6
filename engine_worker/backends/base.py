"""The contract every engine backend fulfils.

A backend turns one validated request into calls of a :class:`StepSink`, one per engine step (new text
since the last step), made synchronously from the backend's own per-step pass over all its requests:
no task wake-up, generator or object per token. The engine server owns the sink (sequencing,
timestamps, batching and sockets); the backend only generates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine_worker.protocol import EngineSteps, FinishReason, Submit


class RequestRejected(Exception):
    """The request cannot be served (bad parameters, prompt too long...)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None,
                 status: int = 0, type: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.status = status  # the HTTP status, when it is not the one the gateway derives from ``code``
        self.type = type  # the OpenAI error type, likewise


@dataclass(frozen=True, slots=True)
class BackendInfo:
    kind: str  # "vllm" | "synthetic"
    model: str  # the id shown in /v1/models
    max_model_len: int


@dataclass(slots=True)
class Prepared:
    """A request after validation: what :meth:`Backend.generate` consumes."""

    submit: Submit
    prompt_tokens: int
    payload: object = None  # backend-specific (token ids, prompt text...)
    openai: bool = False  # served by vLLM's OpenAI layer: steps carry whole chunks (``Step.chunk``)
    held: str = ""  # a continuation: text of the resumed tokens the client does not have yet (sent first)
    echo: str = ""  # a continuation: text its detokenizer repeats once (see VllmBackend._continuation)


@dataclass(frozen=True, slots=True)
class Step:
    text: str
    token_count: int
    finish_reason: FinishReason | None = None
    chunk: bytes = b""  # a whole OpenAI chunk (vLLM's OpenAI layer, engine_worker.backends.vllm_openai)
    token_ids: Sequence[int] = ()
    steps: EngineSteps = field(default_factory=list)  # vLLM's OpenAI layer: protocol.Delta.steps


class StepSink(Protocol):
    """Where a request's steps go (the engine server's per-request emitter). Called once per engine step,
    synchronously; the step carrying a ``finish_reason`` is the last. ``token_ids``: the step's output
    token ids, where the backend has them (the plain path: what a continuation resumes from); ``steps``: the
    engine steps behind a chunk of vLLM's OpenAI layer (:attr:`engine_worker.protocol.Delta.steps`)."""

    def __call__(self, text: str, token_count: int, finish_reason: FinishReason | None = None,
                 chunk: bytes = b"", token_ids: Sequence[int] = (), steps: EngineSteps | None = None
                 ) -> None: ...


async def feed(steps: AsyncIterator[Step], sink: StepSink) -> None:
    """Pass an async stream of steps to ``sink``, up to the finishing one (the path of requests served by
    vLLM's OpenAI layer, whose chunks come from its own generator)."""
    try:
        async for step in steps:
            sink(step.text, step.token_count, step.finish_reason, step.chunk, steps=step.steps)
            if step.finish_reason is not None:
                return
    finally:
        aclose = getattr(steps, "aclose", None)
        if aclose is not None:  # an async generator: its own cleanup (vLLM's abort of an unfinished request) now
            await aclose()


class Backend(Protocol):
    """An LLM engine. All methods are called from the engine server's event loop."""

    @property
    def info(self) -> BackendInfo: ...

    async def start(self) -> None:
        """Load the model; returns when requests can be served."""

    async def prepare(self, submit: Submit) -> Prepared:
        """Validate and tokenize; raises :class:`RequestRejected`."""

    async def stream(self, prepared: Prepared, sink: StepSink) -> None:
        """Generate, calling ``sink`` once per engine step; returns after the step with a ``finish_reason``.
        Raises :class:`RequestRejected` or the engine's error; cancelling it stops the request (the server
        then calls :meth:`abort`)."""

    async def abort(self, request_id: str) -> None:
        """Stop a request now (idempotent)."""

    def load(self) -> tuple[int, int]:
        """``(running, waiting)`` request counts, for heartbeats and routing."""

    async def shutdown(self) -> None:
        """Release the model and any child processes."""
