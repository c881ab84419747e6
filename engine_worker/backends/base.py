"""The contract every engine backend fulfils.

A backend turns one validated request into an async stream of :class:`Step`s
(new text since the last step). The engine server owns sequencing, timestamps,
batching and sockets; the backend only generates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from engine_worker.protocol import FinishReason, Submit


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


@dataclass(frozen=True, slots=True)
class Step:
    text: str
    token_count: int
    finish_reason: FinishReason | None = None
    chunk: bytes = b""  # a whole OpenAI chunk (vLLM's OpenAI layer, engine_worker.backends.vllm_openai)


class Backend(Protocol):
    """An LLM engine. All methods are called from the engine server's event loop."""

    @property
    def info(self) -> BackendInfo: ...

    async def start(self) -> None:
        """Load the model; returns when requests can be served."""

    async def prepare(self, submit: Submit) -> Prepared:
        """Validate and tokenize; raises :class:`RequestRejected`."""

    def generate(self, prepared: Prepared) -> AsyncIterator[Step]:
        """Yield steps until one carries a ``finish_reason``. Closing the iterator aborts."""

    async def abort(self, request_id: str) -> None:
        """Stop a request now (idempotent)."""

    def load(self) -> tuple[int, int]:
        """``(running, waiting)`` request counts, for heartbeats and routing."""

    async def shutdown(self) -> None:
        """Release the model and any child processes."""
