"""One engine request as the gateway holds it: its events, and what a continuation on another engine needs.

A :class:`RequestHandle` is what :class:`gateway.core.engine_link.EngineLink` routes a request's messages
into. Its consumer either attaches a :class:`Sink` (a streamed generation: each delta is handed to it in the
engine step's pass) or reads :meth:`RequestHandle.deltas` (a request read whole). The link that carries it
is its :class:`Owner`; closing the handle tells that owner (which aborts it in the engine if unfinished).
No sockets here, and no event loop needed until a consumer awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from engine_worker import protocol as p
from gateway.errors import APIError, EngineError, TokenfanError, to_api_error

if TYPE_CHECKING:
    from gateway.core.step import Step
    from gateway.core.tracing import GenerationTrace

# What a request can fail with: an EngineError from the engine link, or whatever the gateway passes to
# ``fail_all`` (e.g. its shutdown error), delivered unchanged.
Failure = TokenfanError


class Sink(Protocol):
    """Where a streamed request's deltas go, in the engine step's pass (a
    :class:`gateway.core.generation.Generation`)."""

    def on_delta(self, d: p.Delta, step: Step | None) -> None: ...

    def on_failure(self, err: APIError) -> None: ...


class Owner(Protocol):
    """The engine link a request is on: closing the handle forgets it there."""

    address: str

    def close_request(self, handle: RequestHandle) -> None: ...


class RequestHandle:
    """Events of one request: an acceptance first (:meth:`accept`), then deltas (:meth:`push`), or a failure
    (:meth:`fail`).

    Deltas go to the attached :class:`Sink` (:meth:`attach`) in the engine step's pass, or, until one is
    attached, to a queue read by :meth:`deltas`.

    What a continuation on another engine needs is kept here: the ``submit`` as sent, the output token ids,
    the engine steps of vLLM's OpenAI layer (``steps``: each ``[choice_index, *token_ids]``) and the number of
    text characters received so far. ``engine_rid`` is the id the current engine knows it by (``request_id``,
    then ``request_id.m<n>`` after the n-th migration, so a late delta of a lost engine can never mix in)."""

    __slots__ = ("_accepted", "_error", "_queue", "closed", "done", "engine_rid", "lost_at", "migrations",
                 "on_close", "openai", "output_chars", "output_ids", "owner", "prompt_tokens", "rejoined",
                 "request_id", "send_seq", "sink", "steps", "submit", "trace", "trace_id")

    def __init__(self, owner: Owner, submit: p.Submit, send_seq: int = 0) -> None:
        self.owner = owner  # the link the request is on now (another one after a migration)
        self.submit = submit
        self.request_id = submit.request_id
        self.engine_rid = submit.request_id
        self.trace_id = submit.trace_id
        self.send_seq = send_seq  # position of its Submit among its link's submits (vs. the pings)
        self.output_ids: list[int] = []
        self.steps: p.EngineSteps = []  # Delta.steps received so far (vLLM's OpenAI layer)
        self.output_chars = 0
        self.migrations = 0
        self.lost_at = 0.0  # monotonic time its engine was lost (0: not migrating)
        self.rejoined = False  # continued on another engine: its next payload is marked (Event.migrated)
        self.closed = False
        self.openai = False  # the engine serves it with vLLM's OpenAI layer: deltas carry whole chunks
        self.done = False
        self.prompt_tokens: int | None = None  # set when the engine accepted it
        self.on_close: list[Callable[[], None]] = []
        self.sink: Sink | None = None
        self.trace: GenerationTrace | None = None  # its generation's span (None: tracing is off)
        self._queue: asyncio.Queue[p.Delta | Failure] = asyncio.Queue()
        self._error: Failure | None = None  # the failure that came before an acceptance
        self._accepted: asyncio.Future[int] | None = None  # created by the first wait_accepted

    # -- the link's side ----------------------------------------------------------------------------

    def accept(self, prompt_tokens: int, openai: bool) -> None:
        """The engine accepted the request (the first acceptance counts)."""
        if self.prompt_tokens is not None or self._error is not None:
            return
        self.prompt_tokens, self.openai = prompt_tokens, openai
        if self._accepted is not None and not self._accepted.done():
            self._accepted.set_result(prompt_tokens)

    def push(self, d: p.Delta, step: Step | None) -> None:
        """One delta: kept for a continuation, then handed to the sink (or queued)."""
        if d.token_ids:
            self.output_ids += d.token_ids
        if d.steps:
            self.steps += d.steps
        self.output_chars += len(d.text)
        if self.trace is not None:
            self.trace.delta(d)
        if self.sink is not None:
            self.sink.on_delta(d, step)
        else:
            self._queue.put_nowait(d)

    def fail(self, err: Failure) -> None:
        """The request failed: the acceptance (if still awaited) and the sink (or the queue) get ``err``.
        (The link marks it ``done`` when it also forgot it in the engine.)"""
        if self.prompt_tokens is None and self._error is None:
            self._error = err
            if self._accepted is not None and not self._accepted.done():
                self._accepted.set_exception(err)
                self._accepted.exception()  # mark retrieved: the consumer may be gone
        if self.trace is not None:
            self.trace.failed(err)
        if self.sink is not None:
            self.sink.on_failure(to_api_error(err))
        else:
            self._queue.put_nowait(err)

    # -- the consumer's side ------------------------------------------------------------------------

    def attach(self, sink: Sink) -> None:
        """Hand every delta from now on to ``sink``, in the engine step's pass (what had queued first, in
        order)."""
        self.sink = sink
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, TokenfanError):
                sink.on_failure(to_api_error(item))
            else:
                sink.on_delta(item, None)

    async def wait_accepted(self, timeout: float) -> int:
        """Prompt token count once the engine accepted the request; raises EngineError."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        if self._error is not None:
            raise self._error
        if self._accepted is None:
            self._accepted = asyncio.get_running_loop().create_future()
        try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands as the accept does
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self._accepted)
        except TimeoutError as exc:
            raise EngineError.unavailable(f"the engine did not accept the request within {timeout:.0f}s") from exc

    async def deltas(self, idle: float | None = None) -> AsyncIterator[p.Delta | None]:
        """Deltas until the one with a finish reason; ``None`` after each ``idle`` seconds without one
        (a keep-alive tick); raises EngineError on failure."""
        while True:
            if idle is None:
                item = await self._queue.get()
            else:
                try:
                    async with asyncio.timeout(idle):
                        item = await self._queue.get()
                except TimeoutError:
                    yield None
                    continue
            if isinstance(item, TokenfanError):
                self.done = True
                raise item
            yield item
            if item.finish_reason is not None:
                self.done = True
                return

    def close(self) -> None:
        """Forget the request; abort it in the engine if it had not finished (sync: safe in ``finally``)."""
        self.closed = True
        callbacks, self.on_close = self.on_close, []
        for cb in callbacks:
            cb()
        self.owner.close_request(self)
        if self.trace is not None:
            self.trace.end()
