"""OpenTelemetry in the engine worker (``--otlp-traces-endpoint``; off by default).

Two kinds of span, both in the trace of the gateway's generation (its W3C context arrives in
``Submit.trace_headers``):

- vLLM's own ``llm_request`` span (kind SERVER, with vLLM's ``gen_ai.*`` latencies: queue, prefill, decode): the
  endpoint is passed to vLLM (``otlp_traces_endpoint`` of its engine args) and each request's trace context to
  ``AsyncLLM`` (``trace_headers=``), which extracts it with the W3C propagator (``vllm/tracing/otel.py``
  ``extract_trace_context``). vLLM makes that span when the request *finishes* (``OutputProcessor.do_tracing``):
  an aborted request, or one whose engine was killed, has none.
- ``engine.accept`` (this module): from the ``Submit`` to the engine's ``Accepted``, ended at once, so an engine
  killed later in the request has already queued it for export (``OTEL_BSP_SCHEDULE_DELAY``, default 5 s, bounds
  how long it waits in the batch). It names the engine (``tokenfan.engine.id``, its address) and the continuation
  (``tokenfan.resume.tokens``), so a migrated request shows both engines even when the first one died.

Both export over OTLP/HTTP (protobuf): ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` defaults to ``http/protobuf`` here
(vLLM's own default is gRPC), and ``OTEL_SERVICE_NAME`` to ``tokenfan-engine``. OpenTelemetry is imported only
when tracing is on.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from tokenfan_settings import traces_endpoint

if TYPE_CHECKING:
    from engine_worker import protocol as p
    from engine_worker.config import EngineConfig

SERVICE_NAME = "tokenfan-engine"


def enabled(config: EngineConfig) -> bool:
    return traces_endpoint(config.otlp_traces_endpoint) is not None


def trace_headers(config: EngineConfig, submit: p.Submit) -> dict[str, str] | None:
    """What to hand vLLM as ``trace_headers`` for ``submit``: its gateway's trace context while tracing is on
    (vLLM warns about, and drops, trace headers it cannot export)."""
    return submit.trace_headers or None if enabled(config) else None


def prepare_environment(endpoint: str) -> None:
    """Before vLLM starts: its exporter speaks OTLP/HTTP to ``endpoint`` unless the environment chose otherwise,
    and its spans name this service."""
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    if "service.name" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        os.environ.setdefault("OTEL_SERVICE_NAME", SERVICE_NAME)


class EngineTracer:
    """The engine worker's own spans (its own provider, beside the global one vLLM sets up)."""

    def __init__(self, exporter: Any, attributes: dict[str, Any]) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tokenfan.engine")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, config: EngineConfig) -> EngineTracer | None:
        """The tracer of ``config`` (None: tracing is off), its environment prepared for vLLM."""
        endpoint = traces_endpoint(config.otlp_traces_endpoint)
        if endpoint is None:
            return None
        prepare_environment(endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint), {"tokenfan.engine.address": config.engine_address,
                                                          "tokenfan.engine.backend": config.backend,
                                                          "process.pid": os.getpid()})  # vLLM's: vllm.process_id

    def accepted(self, submit: p.Submit, received_ns: int, prompt_tokens: int, engine_id: str) -> None:
        """One ``engine.accept`` span: ``submit`` arrived at ``received_ns`` and was accepted now."""
        if not submit.trace_headers:
            return
        from opentelemetry.trace import SpanKind

        resumed = len(submit.resume) or sum(len(out) - 2 for step in submit.resume_steps for out in step)
        span = self.tracer.start_span("engine.accept", context=self.propagator.extract(submit.trace_headers),
                                      kind=SpanKind.SERVER, start_time=received_ns, attributes={
                                          "tokenfan.engine.id": engine_id, "gen_ai.response.id": submit.request_id,
                                          "gen_ai.usage.input_tokens": prompt_tokens,
                                          "tokenfan.resume.tokens": resumed})
        span.end(time.time_ns())

    def shutdown(self) -> None:
        self.provider.shutdown()
