"""OpenTelemetry traces of the gateway (``--otlp-traces-endpoint``): the implementation of the core's tracing port
(:mod:`gateway.core.tracing`), the trace and span ids of the access log, and the OTLP/HTTP exporter.

Off by default: without an endpoint no tracer exists, the core's hooks see ``None`` and OpenTelemetry is never
imported on the token path. On, each generation is one span, exported over OTLP/HTTP (protobuf) by a batch
processor, so no span costs a network write in the engine step's pass:

- ``chat tiny`` (``{gen_ai.operation.name} {gen_ai.request.model}``, kind SERVER): a child of the request's W3C
  ``traceparent`` if it sent one, on every route and transport (the ASGI scope's headers: HTTP/1.1, HTTP/2,
  HTTP/3, WebSocket handshakes, WebTransport streams). GenAI semantic-convention attributes
  (``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` / ``output_tokens``,
  ``gen_ai.response.finish_reasons``, …) and tokenfan's (``tokenfan.stream.id``, ``tokenfan.engine.address``,
  ``tokenfan.migrations``). Events: ``first_token``, ``engine_lost``, ``migration`` (from, to, gap),
  ``migration_refused``, ``resume`` (a reader's ``Last-Event-ID``), ``reader_cut``, ``cancel``, ``adoption``
  (old and new owner). Its context travels to the engine (``Submit.trace_headers``), where vLLM's
  ``llm_request`` span becomes its child, and to other gateways in a listed stream's header.
- ``stream.read`` (kind SERVER): one per reader of a listed stream (fan-out, background responses), linked to
  the generation's span; its parent is the reader's own ``traceparent`` if it sent one, else the generation's.
- ``stream.adopt``: on a replica that adopted a listed stream, a child of the lost owner's generation span.

The standard environment applies: ``OTEL_SERVICE_NAME`` (default ``tokenfan-gateway``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` (default parent-based always-on),
``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` / ``_TIMEOUT`` / ``_COMPRESSION``, ``OTEL_BSP_*`` (the batch's delay and
sizes). docs/observability.md lists every span, event and attribute.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from engine_worker import protocol as p
    from gateway.core.tracing import GenerationTrace
    from gateway.errors import TokenfanError

log = logging.getLogger(__name__)

SERVICE_NAME = "tokenfan-gateway"
_PROPAGATOR = TraceContextTextMapPropagator()
_OPERATION = {"chat.completions": "chat", "completions": "text_completion"}



def carrier_of(headers: Iterable[tuple[bytes, bytes]] | None) -> dict[str, str]:
    """The W3C trace-context headers among an ASGI scope's (``traceparent``, ``tracestate``)."""
    out: dict[str, str] = {}
    for name, value in headers or ():
        if name in (b"traceparent", b"tracestate"):
            out[name.decode()] = value.decode("latin-1")
    return out


class OtelTracer:
    """The gateway's :class:`gateway.core.tracing.Tracer`: its own provider (never the global one), one batch
    processor, one exporter."""

    def __init__(self, exporter: SpanExporter, *, service_name: str = SERVICE_NAME,
                 attributes: Mapping[str, str] | None = None) -> None:
        named = os.environ.get("OTEL_SERVICE_NAME") or "service.name" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        resource = Resource.create({**({} if named else {"service.name": service_name}),
                                    "service.instance.id": uuid.uuid4().hex, **(attributes or {})})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tokenfan.gateway")

    @classmethod
    def otlp(cls, endpoint: str, **kw: Any) -> OtelTracer:
        """Export over OTLP/HTTP (protobuf) to ``endpoint`` (the full URL, e.g. ``…:4318/v1/traces``)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint), **kw)

    def shutdown(self) -> None:
        """Export what is queued and stop."""
        self.provider.shutdown()

    def generation(self, headers: list[tuple[bytes, bytes]] | None, *, request_id: str, endpoint: str,
                   model: str, max_tokens: int, listed: bool) -> GenerationSpan:
        parent = _PROPAGATOR.extract(carrier_of(headers))
        operation = _OPERATION.get(endpoint, endpoint)
        span = self.tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.SERVER, attributes={
            "gen_ai.operation.name": operation, "gen_ai.system": "vllm", "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens, "gen_ai.response.id": request_id,
            "tokenfan.stream.id": request_id, "tokenfan.stream.listed": listed, "tokenfan.endpoint": endpoint})
        return GenerationSpan(self, span, request_id)

    def joined(self, carrier: dict[str, str], *, stream_id: str, endpoint: str, model: str,
               adopted_from: str | None = None, adopted_by: str = "", events: int = 0) -> GenerationTrace:
        parent = _PROPAGATOR.extract(carrier)
        if adopted_from is None:
            return RemoteGeneration(self, parent, stream_id)
        span = self.tracer.start_span("stream.adopt", context=parent, kind=SpanKind.INTERNAL, attributes={
            "gen_ai.request.model": model, "gen_ai.response.id": stream_id, "tokenfan.stream.id": stream_id,
            "tokenfan.stream.listed": True, "tokenfan.endpoint": endpoint, "tokenfan.adoption.old_owner": adopted_from})
        span.add_event("adoption", {"tokenfan.adoption.old_owner": adopted_from, "tokenfan.adoption.new_owner": adopted_by,
                                    "tokenfan.adoption.events": events})
        return GenerationSpan(self, span, stream_id)

    def reader_span(self, generation: trace.SpanContext, transport: str, after: int, stream_id: str,
                    headers: list[tuple[bytes, bytes]] | None) -> ReaderSpan:
        own = carrier_of(headers)
        parent = _PROPAGATOR.extract(own) if own else trace.set_span_in_context(trace.NonRecordingSpan(generation))
        span = self.tracer.start_span("stream.read", context=parent, kind=SpanKind.SERVER, links=[Link(generation)],
                                      attributes={"tokenfan.stream.id": stream_id, "tokenfan.reader.transport": transport,
                                                  "tokenfan.reader.after": after})
        if after >= 0:
            span.add_event("resume", {"tokenfan.reader.after": after})
        return ReaderSpan(span)


class GenerationSpan:
    """One generation's span (:class:`gateway.core.tracing.GenerationTrace`)."""

    __slots__ = ("_ended", "_first", "_from", "_t0", "finish", "migrations", "output_tokens", "span", "span_id",
                 "stream_id", "trace_id", "tracer")

    def __init__(self, tracer: OtelTracer, span: trace.Span, stream_id: str) -> None:
        self.tracer = tracer
        self.span = span
        self.stream_id = stream_id
        ctx = span.get_span_context()
        self.trace_id = trace.format_trace_id(ctx.trace_id)
        self.span_id = trace.format_span_id(ctx.span_id)
        self._t0 = time.monotonic()
        self._first = False
        self._ended = False
        self._from = ""  # the engine it was lost with
        self.finish: str | None = None
        self.migrations = 0
        self.output_tokens = 0

    def carrier(self) -> dict[str, str]:
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, trace.set_span_in_context(self.span))
        return out

    def accepted(self, prompt_tokens: int, engine: str) -> None:
        self.span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens, "tokenfan.engine.address": engine})

    def delta(self, d: p.Delta) -> None:
        self.output_tokens += d.token_count
        if not self._first and d.token_count:
            self._first = True
            self.span.add_event("first_token", {"tokenfan.ttft_s": time.monotonic() - self._t0})
        if d.finish_reason is not None:
            self.finish = d.finish_reason
            if d.usage is not None:
                self.output_tokens = d.usage.completion_tokens
                self.span.set_attribute("gen_ai.usage.input_tokens", d.usage.prompt_tokens)

    def failed(self, err: TokenfanError) -> None:
        self.span.set_attribute("error.type", err.code or type(err).__name__)
        self.span.set_status(Status(StatusCode.ERROR, err.message))

    def engine_lost(self, engine: str, reason: str) -> None:
        self._from = engine
        self.span.add_event("engine_lost", {"tokenfan.engine.address": engine, "error.type": reason})

    def migration_refused(self, reason: str) -> None:
        self.span.add_event("migration_refused", {"tokenfan.migration.reason": reason})

    def migrated(self, engine: str, gap: float, tokens: int) -> None:
        self.migrations += 1
        self.span.add_event("migration", {"tokenfan.migration.from": self._from, "tokenfan.migration.to": engine,
                                          "tokenfan.migration.gap_s": gap, "tokenfan.migration.tokens": tokens,
                                          "tokenfan.migration.number": self.migrations})
        self.span.set_attribute("tokenfan.engine.address", engine)

    def cancelled(self) -> None:
        self.span.add_event("cancel")
        self.finish = self.finish or "cancelled"

    def reader(self, transport: str, after: int, listed: bool,
               headers: list[tuple[bytes, bytes]] | None) -> ReaderSpan | InlineReader | None:
        if after >= 0 and self.span.is_recording():
            self.span.add_event("resume", {"tokenfan.reader.transport": transport, "tokenfan.reader.after": after})
        if not listed:  # the request's own reader: its cut is an event of the generation's span
            return InlineReader(self.span, transport)
        return self.tracer.reader_span(self.span.get_span_context(), transport, after, self.stream_id, headers)

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        attrs: dict[str, Any] = {"gen_ai.usage.output_tokens": self.output_tokens, "tokenfan.migrations": self.migrations}
        if self.finish is not None:
            attrs["gen_ai.response.finish_reasons"] = [self.finish]
        self.span.set_attributes(attrs)
        self.span.end()


class RemoteGeneration:
    """A generation another gateway runs (a mirror's): its readers' spans join the owner's trace."""

    __slots__ = ("context", "span_id", "stream_id", "trace_id", "tracer")

    def __init__(self, tracer: OtelTracer, parent: Context, stream_id: str) -> None:
        self.tracer = tracer
        self.context = trace.get_current_span(parent).get_span_context()
        self.trace_id = trace.format_trace_id(self.context.trace_id)
        self.span_id = trace.format_span_id(self.context.span_id)
        self.stream_id = stream_id

    def carrier(self) -> dict[str, str]:
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, trace.set_span_in_context(trace.NonRecordingSpan(self.context)))
        return out

    def accepted(self, prompt_tokens: int, engine: str) -> None: ...
    def delta(self, d: p.Delta) -> None: ...
    def failed(self, err: TokenfanError) -> None: ...
    def engine_lost(self, engine: str, reason: str) -> None: ...
    def migration_refused(self, reason: str) -> None: ...
    def migrated(self, engine: str, gap: float, tokens: int) -> None: ...
    def cancelled(self) -> None: ...
    def end(self) -> None: ...

    def reader(self, transport: str, after: int, listed: bool,
               headers: list[tuple[bytes, bytes]] | None) -> ReaderSpan | None:
        if not self.context.is_valid:
            return None
        return self.tracer.reader_span(self.context, transport, after, self.stream_id, headers)


class ReaderSpan:
    """A listed stream's reader (:class:`gateway.core.tracing.ReaderTrace`): its own span."""

    __slots__ = ("span",)

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def cut(self, send_timeout: float) -> None:
        self.span.add_event("reader_cut", {"tokenfan.send_timeout_s": send_timeout})
        self.span.set_status(Status(StatusCode.ERROR, "slow_consumer"))

    def end(self, last_seq: int) -> None:
        self.span.set_attribute("tokenfan.reader.last_seq", last_seq)
        self.span.end()


class InlineReader:
    """The reader of an unlisted stream (the request's own response): its cut is an event of the generation."""

    __slots__ = ("span", "transport")

    def __init__(self, span: trace.Span, transport: str) -> None:
        self.span, self.transport = span, transport

    def cut(self, send_timeout: float) -> None:
        if self.span.is_recording():
            self.span.add_event("reader_cut", {"tokenfan.reader.transport": self.transport,
                                               "tokenfan.send_timeout_s": send_timeout})

    def end(self, last_seq: int) -> None: ...
