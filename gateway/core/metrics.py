"""Prometheus metrics of one gateway (own registry, so several apps can live in one process).

The token path's metrics (chunks written, tokens generated, TTFT, inter-token gap, delivery latency) are
observed per event, so they are plain integers and bucket arrays (:class:`HotCounter`,
:class:`HotHistogram`: an add and a bisect, no lock, no label lookup) that :class:`DeliveryCollector`
folds into Prometheus families when ``/metrics`` is scraped. prometheus_client's own ``Histogram.observe``
costs about 1.5 µs here (a lock and a label-child lookup); these cost about 0.2 µs. Everything else uses
prometheus_client's types directly.

``--inject-delay`` (bench calibration) adds :data:`INJECTED_DELAY`: each injected sleep as the gateway
timed it, so ``tokenfan bench report`` compares its calibration with the delay really applied in that
run (a sleep overshoots more on a loaded gateway than in an idle process). Only with the flag set.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_worker.protocol import MAGIC
from tokenfan_settings import release

# every limit's error code, exported at 0 from the start (docs/limits.md)
REFUSAL_REASONS = ("client_connection_limit", "client_generation_limit", "client_subscription_limit",
                   "connection_queue_limit", "fair_share_limit", "too_many_requests", "overloaded",
                   "too_many_subscribers", "too_many_streams", "engine_overloaded")
_LAT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TRANSPORTS = ("sse", "ws")
INJECTED_DELAY = "tokenfan_injected_delay_seconds"


def injected_delay_bounds(delay: float) -> tuple[float, ...]:
    """Buckets for the sleeps of ``--inject-delay`` ``delay`` s: 20 µs wide from 1 ms short of it (uvloop's
    timers tick in whole milliseconds, so a sleep can end early) to 1 ms past it, then coarser up to 100 ms
    past it: the median is read to ±10 µs."""
    fine = (delay + k * 20e-6 for k in range(-50, 51))
    coarse = (delay + ms / 1e3 for ms in (1.5, 2, 3, 5, 10, 20, 50, 100))
    return tuple(sorted({round(b, 9) for b in (*fine, *coarse) if b >= 0}))


class HotCounter:
    """A counter the token path adds to; read by :class:`DeliveryCollector` at scrape time."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


class HotHistogram:
    """A histogram the token path observes into: one count per bucket (``le`` semantics: a value equal
    to a bound falls in that bound's bucket) and the sum; cumulative counts are built at scrape time."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = _LAT_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, as Prometheus exposes them."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*map(repr, map(float, self.bounds)), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, float(total)))
        return out


class TransportMetrics:
    """The hot metrics of one transport (``sse`` or ``ws``)."""

    __slots__ = ("chunks", "delivery", "itl", "ttft")

    def __init__(self) -> None:
        self.chunks = HotCounter()  # chunks written to clients
        self.ttft = HotHistogram()  # request arrival -> first content chunk written
        self.itl = HotHistogram()  # gap between consecutive content writes to one client
        self.delivery = HotHistogram()  # engine emit -> gateway write, per chunk


class DeliveryCollector(Collector):
    """Folds the token path's plain counters into Prometheus families at scrape time."""

    def __init__(self) -> None:
        self.transports = {t: TransportMetrics() for t in TRANSPORTS}
        self.tokens = HotCounter()  # completion tokens received from the engine
        self.injected: dict[str, HotHistogram] = {}  # --inject-delay: transport -> the sleeps as timed

    def transport(self, name: str) -> TransportMetrics:
        """The metrics of connections labelled ``name`` (:data:`TRANSPORTS` from the start; another label,
        a connection's own such as ``sse-h3``, from its first reader on)."""
        m = self.transports.get(name)
        if m is None:
            m = self.transports[name] = TransportMetrics()
        return m

    def inject(self, delays: dict[str, float]) -> None:
        """Time the sleeps of ``--inject-delay`` (transport -> seconds) into :data:`INJECTED_DELAY`."""
        self.injected = {t: HotHistogram(injected_delay_bounds(d)) for t, d in delays.items()}

    def collect(self) -> Iterator[Metric]:
        chunks = CounterMetricFamily("tokenfan_chunks_sent_total", "Chunks written to clients by transport",
                                     labels=["transport"])
        for t, m in self.transports.items():
            chunks.add_metric([t], float(m.chunks.value))
        yield chunks
        yield CounterMetricFamily("tokenfan_tokens_generated_total", "Completion tokens received from the engine",
                                  value=float(self.tokens.value))
        for name, doc, attr in (
                ("tokenfan_time_to_first_token_seconds", "Request arrival to first content chunk sent", "ttft"),
                ("tokenfan_delivery_latency_seconds", "Engine emit to gateway write, per chunk", "delivery"),
                ("tokenfan_inter_token_latency_seconds", "Gap between consecutive content writes to one client",
                 "itl")):
            family = HistogramMetricFamily(name, doc, labels=["transport"])
            for t, m in self.transports.items():
                h: HotHistogram = getattr(m, attr)
                family.add_metric([t], h.buckets(), h.sum)
            yield family
        if self.injected:
            family = HistogramMetricFamily(INJECTED_DELAY, "DIAGNOSTIC --inject-delay: each injected sleep as the "
                                           "gateway timed it (monotonic clock around the sleep)", labels=["transport"])
            for t, h in self.injected.items():
                family.add_metric([t], h.buckets(), h.sum)
            yield family


MIGRATION_OUTCOMES = ("continued", "refused", "timeout", "failed")
# why a refused request was not continued (docs/failures.md): --migration-limit, --migration-max-tokens, deltas
# without token ids, a plain request whose budget was spent
MIGRATION_REFUSALS = ("limit", "max_tokens", "no_token_ids", "budget_spent")


class Migrations:
    """What migration did: counts by outcome and the gap each continued request saw, from the loss to its
    next delta (``tokenfan_migrations_total``, ``tokenfan_migration_refusals_total``,
    ``tokenfan_migration_gap_seconds``)."""

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys(MIGRATION_OUTCOMES, 0)
        self.refusals = dict.fromkeys(MIGRATION_REFUSALS, 0)
        self.gap = HotHistogram()


class MigrationCollector(Collector):
    """Requests continued on another engine after theirs was lost (:class:`gateway.core.engine_pool.Migrations`),
    folded into Prometheus at scrape time."""

    def __init__(self, migrations: Migrations) -> None:
        self.migrations = migrations

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("tokenfan_migrations_total", "Requests whose engine was lost, by outcome: "
                                     "continued on another engine, refused (cannot be continued exactly), timeout "
                                     "(no healthy engine in time), failed (the continuation was refused)",
                                     labels=["outcome"])
        for outcome, n in self.migrations.outcomes.items():
            family.add_metric([outcome], float(n))
        yield family
        refused = CounterMetricFamily("tokenfan_migration_refusals_total", "Requests whose engine was lost that "
                                      "were not continued, by reason: limit (--migration-limit), max_tokens "
                                      "(--migration-max-tokens), no_token_ids, budget_spent", labels=["reason"])
        for reason, n in self.migrations.refusals.items():
            refused.add_metric([reason], float(n))
        yield refused
        gap: HotHistogram = self.migrations.gap
        hist = HistogramMetricFamily("tokenfan_migration_gap_seconds", "Loss of a request's engine to its next "
                                     "delta from the engine it continues on")
        hist.add_metric([], gap.buckets(), gap.sum)
        yield hist


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total etc.: the bench reads CPU per token here
        Gauge("tokenfan_build_info", "Always 1: what this gateway is (its release, wire protocol and Python)",
              ["version", "protocol", "python"], registry=r).labels(release.__version__, MAGIC.decode(),
                                                                   release.python()).set(1)
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
        self.hot = DeliveryCollector()  # chunks, tokens, TTFT, delivery latency, inter-token gap
        r.register(self.hot)
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
        self.loop_lag = Gauge("tokenfan_event_loop_lag_seconds", "How late the gateway's event loop runs "
                              "(worst of the last second); new work gets 503 above --max-loop-lag", registry=r)
        self.refusals = Counter("tokenfan_refusals_total", "Requests, connections and subscriptions refused by a "
                                "limit, by reason (the error code; docs/limits.md)", ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)
        self.retained = Gauge("tokenfan_retained_stream_bytes", "Bytes held by retained fan-out streams", registry=r)
        self.adoptions = Counter("tokenfan_adoptions_total", "Listed streams whose owner gateway was lost, as this "
                                 "gateway saw them: adopted (continued here), elsewhere (another replica claimed "
                                 "it), refused (cannot be continued exactly), failed (no engine took it)",
                                 ["outcome"], registry=r)
        for outcome in ("adopted", "elsewhere", "refused", "failed"):
            self.adoptions.labels(outcome)
        self.given_up = Counter("tokenfan_streams_fenced_total", "Listed streams whose readers this gateway sent "
                                "to resume on a replica because another gateway may own them (--broker): fenced "
                                "(Redis refused its epoch: a replica adopted it; given up here) or lease (its lease "
                                "went unconfirmed; the stream waits here until it is confirmed again)", ["reason"],
                                registry=r)
        for reason in ("fenced", "lease"):
            self.given_up.labels(reason)
        self.broker_serving = Gauge("tokenfan_broker_serving", "1 while this gateway can run listed streams "
                                    "(--broker: Redis reachable and its lease confirmed), else 0", registry=r)
        self.readers_cut = Counter("tokenfan_readers_cut_total", "Readers cut off as too slow: a write was blocked "
                                   "for more than --send-timeout (SSE event: error slow_consumer, WebSocket close "
                                   "1013), by transport", ["transport"], registry=r)
        self.resumes = Counter("tokenfan_resumes_total", "Readers that resumed a stream after an event they had "
                               "(Last-Event-ID, ?after=, starting_after), by transport", ["transport"], registry=r)
        for t in ("sse", "ws"):
            self.readers_cut.labels(t)
            self.resumes.labels(t)
        self.engine_link_up = Gauge("tokenfan_engine_link_up", "1 while this engine (by its address) answers "
                                    "heartbeats: one series per --engine-address", ["engine"], registry=r)
        self.reloads = Counter("tokenfan_reloads_total", "SIGHUP reloads by part (api_keys, token_secrets, tls, "
                               "http3_tls) and result: ok (swapped in), error (the old material kept; the log says "
                               "why)", ["part", "result"], registry=r)
        self.adoption_gap = Histogram("tokenfan_adoption_gap_seconds", "The lost owner's last event to this "
                                      "gateway's first of a stream it adopted (wall clocks of both gateways)",
                                      buckets=_LAT_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
