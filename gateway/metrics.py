"""Prometheus metrics of one gateway (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

# every limit's error code, exported at 0 from the start (docs/limits.md)
REFUSAL_REASONS = ("client_connection_limit", "client_generation_limit", "client_subscription_limit",
                   "connection_queue_limit", "fair_share_limit", "too_many_requests", "overloaded",
                   "too_many_subscribers", "too_many_streams", "engine_overloaded")
_LAT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total etc.: the bench reads CPU per token here
        self.requests = Counter("tokenfan_requests_total", "HTTP/WS requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.active_streams = Gauge("tokenfan_active_streams", "Open client streams by transport",
                                    ["transport"], registry=r)
        self.subscribers = Gauge("tokenfan_subscribers", "Subscribers of fan-out streams by transport",
                                 ["transport"], registry=r)
        self.aborted = Counter("tokenfan_requests_aborted_total", "Generations aborted (client left or cancelled)",
                               registry=r)
        self.errors = Counter("tokenfan_errors_total", "Errors by class: network, engine, client, content",
                              ["class"], registry=r)
        self.chunks = Counter("tokenfan_chunks_sent_total", "Chunks written to clients by transport",
                              ["transport"], registry=r)
        self.tokens = Counter("tokenfan_tokens_generated_total", "Completion tokens received from the engine",
                              registry=r)
        self.ttft = Histogram("tokenfan_time_to_first_token_seconds", "Request arrival to first content chunk sent",
                              ["transport"], buckets=_LAT_BUCKETS, registry=r)
        self.delivery = Histogram("tokenfan_delivery_latency_seconds", "Engine emit to gateway write, per chunk",
                                  ["transport"], buckets=_LAT_BUCKETS, registry=r)
        self.itl = Histogram("tokenfan_inter_token_latency_seconds", "Gap between consecutive content writes "
                             "to one client", ["transport"], buckets=_LAT_BUCKETS, registry=r)
        self.engine_up = Gauge("tokenfan_engine_up", "1 while the engine answers heartbeats", registry=r)
        self.engine_queue = Gauge("tokenfan_engine_queue_depth", "Requests waiting in the engine", registry=r)
        self.engine_running = Gauge("tokenfan_engine_running", "Requests generating in the engine", registry=r)
        self.bad_frames = Gauge("tokenfan_bad_frames", "Malformed frames the gateway dropped from the engine link",
                                registry=r)
        self.engine_bad_frames = Gauge("tokenfan_engine_bad_frames", "Malformed frames the engine dropped "
                                       "(from any peer), as of its last heartbeat", registry=r)
        for c in ("network", "engine", "client", "content"):
            self.errors.labels(c)
        for t in ("sse", "ws"):  # export both transports from the start, at 0
            self.active_streams.labels(t)
            self.subscribers.labels(t)
            self.chunks.labels(t)
        self.loop_lag = Gauge("tokenfan_event_loop_lag_seconds", "How late the gateway's event loop runs "
                              "(worst of the last second); new work gets 503 above --max-loop-lag", registry=r)
        self.refusals = Counter("tokenfan_refusals_total", "Requests, connections and subscriptions refused by a "
                                "limit, by reason (the error code; docs/limits.md)", ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)
        self.retained = Gauge("tokenfan_retained_stream_bytes", "Bytes held by retained fan-out streams", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
