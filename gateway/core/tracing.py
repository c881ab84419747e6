"""The delivery core's tracing port: what a generation and its readers tell a trace, never how it is exported.

The core calls these protocols at the few points where something happens *to a stream* (the engine accepted it,
its first token, its engine was lost and it continued elsewhere, another gateway adopted it, a reader resumed or
was cut, it was cancelled, it ended); :mod:`gateway.telemetry` implements them with OpenTelemetry. With tracing
off there is no trace object at all: every hook in the core is one ``is not None`` test, and the token path makes
no span, event or attribute (docs/observability.md has the measurement).

Hooks and where the core calls them:

- :class:`GenerationTrace`, one per generation (``RequestHandle.trace``, ``Stream.trace``):
  ``delta`` (``RequestHandle.push``: the first token, the finish reason and usage), ``failed``
  (``RequestHandle.fail``), ``engine_lost`` / ``migration_refused`` / ``migrated`` (the
  :class:`~gateway.core.engine_pool.Migrator`), ``cancelled`` (``Generation.cancel``), ``reader``
  (``delivery.read``), ``end`` (when its request is closed).
- :class:`ReaderTrace`, one per reader: ``cut`` (a slow reader cut off) and ``end``.
"""

from __future__ import annotations

import contextvars
import logging
import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine_worker import protocol as p
    from gateway.errors import TokenfanError


class ReaderTrace(Protocol):
    """One reader of a generation's stream (its own span for a listed stream's reader)."""

    def cut(self, send_timeout: float) -> None:
        """The reader was cut off: a write was blocked for more than ``send_timeout`` seconds."""

    def end(self, last_seq: int) -> None:
        """The reader ended (its last event written was ``last_seq``)."""


class GenerationTrace(Protocol):
    """One generation's span (or, on a gateway that mirrors another's stream, that span's context)."""

    trace_id: str  # 32 hex digits, as in the access log and the warnings
    span_id: str  # 16 hex digits

    def carrier(self) -> dict[str, str]:
        """The W3C trace context (``traceparent``) that makes a span a child of this generation's: sent to
        the engine in ``Submit.trace_headers`` and to other gateways in a listed stream's header."""

    def accepted(self, prompt_tokens: int, engine: str) -> None:
        """The engine at ``engine`` accepted the request (``prompt_tokens`` after tokenization)."""

    def delta(self, d: p.Delta) -> None:
        """One delta from the engine (the first token, the finish reason, the usage)."""

    def failed(self, err: TokenfanError) -> None:
        """The request failed (an engine error, the gateway's shutdown)."""

    def engine_lost(self, engine: str, reason: str) -> None:
        """The engine at ``engine`` was lost with this request in flight (``reason``: the error code)."""

    def migration_refused(self, reason: str) -> None:
        """The lost request cannot be continued exactly (a ``tokenfan_migration_refusals_total`` reason), or no
        engine took it in time (``timeout``) or the new engine refused it (``failed``)."""

    def migrated(self, engine: str, gap: float, tokens: int) -> None:
        """The request continued on the engine at ``engine``: its first delta there came ``gap`` seconds after
        the loss, after ``tokens`` output tokens."""

    def cancelled(self) -> None:
        """The generation was cancelled: its client left, its last reader went, or a ``DELETE``."""

    def reader(self, transport: str, after: int, listed: bool,
               headers: list[tuple[bytes, bytes]] | None) -> ReaderTrace | None:
        """A reader starts (``after`` ≥ 0: it resumes after that ``seq``: ``Last-Event-ID``, ``?after=``);
        ``headers``: its request's, whose ``traceparent`` (if any) its span joins. None: nothing to trace."""

    def end(self) -> None:
        """The generation's request is closed (finished, failed or cancelled): the span ends."""


class Tracer(Protocol):
    """Starts generation traces (:mod:`gateway.telemetry`'s OpenTelemetry tracer)."""

    def generation(self, headers: list[tuple[bytes, bytes]] | None, *, request_id: str, endpoint: str,
                   model: str, max_tokens: int, listed: bool) -> GenerationTrace:
        """A generation's span, a child of the ``traceparent`` in ``headers`` (a request's) if there is one."""

    def joined(self, carrier: dict[str, str], *, stream_id: str, endpoint: str, model: str,
               adopted_from: str | None = None, adopted_by: str = "", events: int = 0) -> GenerationTrace:
        """The generation another gateway started (its ``carrier``: the ``trace_headers`` of the engine request in
        the stream's header): a mirror's readers join its trace. ``adopted_from``: this gateway (``adopted_by``)
        adopted it from that lost owner after ``events`` events, and its own span (a child of the owner's
        generation, with an ``adoption`` event) traces the rest."""


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def traceparent_ids(value: str) -> tuple[str, str] | None:
    """(trace id, parent span id) of a W3C ``traceparent`` header, or None if it is not a valid one."""
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m[1] == "0" * 32 or m[2] == "0" * 16:
        return None
    return m[1], m[2]


# The generation the current task serves (set where a request starts one, :func:`gateway.api.generations.open_request`):
# what :class:`gateway.telemetry.TraceIds` puts in a log line that does not name its trace (``extra={"trace": …}``).
CURRENT: contextvars.ContextVar[GenerationTrace | None] = contextvars.ContextVar("tokenfan_trace", default=None)


class TraceIds(logging.Filter):
    """Adds ``%(trace)s`` to every record: `` trace_id=<32 hex> span_id=<16 hex>`` of the generation the record
    is about (``extra={"trace": …}`` of the log call, else the task's :data:`CURRENT`), or ``""``. Installed on
    the handlers by the CLI's logging set-up, with a format that ends in ``%(trace)s``."""

    def filter(self, record: logging.LogRecord) -> bool:
        t = record.__dict__.get("trace")
        if isinstance(t, str):  # formatted already (the record passed another handler), or "" on purpose
            return True
        if t is None:
            t = CURRENT.get()
        record.trace = f" trace_id={t.trace_id} span_id={t.span_id}" if t is not None else ""
        return True
