"""Gateway settings: the :class:`GatewayConfig` dataclass, filled from the table in
:mod:`tokenfan_settings` (flags, ``TOKENFAN_*`` environment fallbacks and defaults are declared there)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.core.backpressure import SlowConsumerPolicy
from gateway.core.engine_pool import MigrationPolicy
from gateway.core.streams import Retention
from tokenfan_settings import build, declared

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(slots=True)
class Limits:
    """Request limits enforced at parse time (see gateway.config)."""

    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    max_stop: int = 16
    max_json_depth: int = 64  # OpenAI bodies nest ~6 deep (tools' JSON schemas more); orjson stops at 1024


@dataclass(frozen=True, slots=True)
class BrokerTimings:
    """The broker's own clocks (seconds). ``idle_timeout`` is ``--broker-idle-timeout``."""

    op_timeout: float = 2.0  # connect and reply timeout of an ordinary command
    block: float = 2.0  # longest XREAD BLOCK / BLPOP; their socket timeout is block + op_timeout
    backoff_max: float = 1.0  # reconnect delays double from 50 ms up to this (jittered)
    lease_interval: float = 0.5  # how often a gateway refreshes its lease
    lease_ttl: float = 2.0  # a lease not refreshed for this long means the gateway is gone
    presence_check: float = 0.15  # a mirror quiet this long asks whether its owner's connection is open (0: never)
    cancel_timeout: float = 3.0  # how long cancel_remote waits for the owner's answer
    max_pending: int = 65_536  # entries queued for the next pipeline; beyond, streams are repaired later
    replicas: int | None = None  # replicas that must acknowledge each pipeline (None: every online one)
    replica_timeout: float = 0.5  # how long one WAIT for them blocks

    def __post_init__(self) -> None:
        if min(self.op_timeout, self.block, self.backoff_max, self.lease_interval, self.cancel_timeout) <= 0:
            raise ValueError("the broker's timeouts and intervals must be positive")
        if self.lease_interval >= self.lease_ttl:
            raise ValueError(f"--broker-lease-interval ({self.lease_interval}) must be shorter than "
                             f"--broker-lease-ttl ({self.lease_ttl}), or every lease expires between refreshes")
        if self.lease_interval >= self.lease_ttl * 0.75 and self.lease_interval >= self.lease_ttl - 0.5:
            raise ValueError(f"--broker-lease-interval ({self.lease_interval}) must be shorter than the time a "
                             f"gateway waits for a confirmed refresh before it fences itself (--broker-lease-ttl "
                             f"minus min(0.5 s, a quarter of it)), or it fences itself between refreshes")
        if self.presence_check < 0:
            raise ValueError("--broker-presence-check must be 0 (off) or positive")
        if self.max_pending < 1:
            raise ValueError("--broker-max-pending must be at least 1")
        if self.replicas is not None and self.replicas < 0:
            raise ValueError("--broker-replicas must be auto or a count >= 0")
        if self.replica_timeout <= 0:
            raise ValueError("--broker-replica-timeout must be positive")


class TrustedProxies:
    """The ``--trusted-proxies`` networks; ``forwarded_for`` reads ``X-Forwarded-For`` only from them."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self.networks: tuple[IpNetwork, ...] = tuple(ipaddress.ip_network(e.strip(), strict=False)
                                                      for e in entries if e.strip())

    def __contains__(self, host: str) -> bool:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)

    def client_address(self, peer: str, forwarded_for: str | None) -> str:
        """The client's address: ``peer`` unless it is a trusted proxy that named the client."""
        if not forwarded_for or peer not in self:
            return peer
        hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
        for hop in reversed(hops):
            if hop not in self:
                return hop
        return hops[0] if hops else peer


@dataclass(slots=True)
class GatewayConfig:
    host: str = declared("host")
    port: int = declared("port")
    workers: int = declared("workers")
    ssl_certfile: Path | None = declared("ssl_certfile")
    ssl_keyfile: Path | None = declared("ssl_keyfile")
    http3_port: int = declared("http3_port")
    http3_certfile: Path | None = declared("http3_certfile")
    http3_keyfile: Path | None = declared("http3_keyfile")
    http_header_timeout: float = declared("http_header_timeout")
    http_body_timeout: float = declared("http_body_timeout")
    engine_address: str = declared("engine_address")  # comma-separated: several engines
    served_model_name: str | None = declared("served_model_name")  # default: what the engine reports
    heartbeat_interval: float = declared("heartbeat_interval")
    heartbeat_timeout: float = declared("heartbeat_timeout")
    accept_timeout: float = declared("accept_timeout")
    keepalive_interval: float = declared("keepalive_interval")
    max_body_bytes: int = declared("max_body_bytes")
    ws_max_message_bytes: int = declared("ws_max_message_bytes")
    ws_per_message_deflate: bool = declared("ws_per_message_deflate")
    # the table fills these three through dotted fields (limits.max_tokens_cap, ...)
    limits: Limits = field(default_factory=Limits)
    retention: Retention = field(default_factory=Retention)
    policy: SlowConsumerPolicy = field(default_factory=SlowConsumerPolicy)
    sse_retry_ms: int = declared("sse_retry_ms")
    inject_delay: dict[str, float] = declared("inject_delay")  # transport -> seconds (diagnostic)
    shutdown_grace: float = declared("shutdown_grace")
    handover: bool = declared("handover")
    max_concurrent: int = declared("max_concurrent")
    max_concurrent_per_key: int = declared("max_concurrent_per_key")
    max_generations_per_client: int = declared("max_generations_per_client")
    max_connections_per_client: int = declared("max_connections_per_client")
    max_subscriptions_per_client: int = declared("max_subscriptions_per_client")
    ws_max_in_flight: int = declared("ws_max_in_flight")
    ws_max_queued: int = declared("ws_max_queued")
    fair_share_at: float = declared("fair_share_at")
    trusted_proxies: tuple[str, ...] = declared("trusted_proxies")
    max_prompt_tokens: int = declared("max_prompt_tokens")
    api_keys: tuple[str, ...] = declared("api_keys")
    api_key_file: Path | None = declared("api_key_file")
    token_secret: str | None = declared("token_secret")
    token_secret_file: Path | None = declared("token_secret_file")
    stream_token_ttl: float = declared("stream_token_ttl")
    allowed_origins: tuple[str, ...] = declared("allowed_origins")
    cors_origins: tuple[str, ...] = declared("cors_origins")
    curve_dir: Path | None = declared("curve_dir")
    broker_url: str | None = declared("broker_url")
    broker_password: str | None = declared("broker_password")
    broker_sentinel_password: str | None = declared("broker_sentinel_password")
    broker_idle_timeout: float = declared("broker_idle_timeout")
    standby_timeout: float = declared("standby_timeout")  # --workers: the hold on events the standby lacks
    relay_delay: float = declared("relay_delay")  # diagnostic: the standby relay's writes delayed
    broker: BrokerTimings = field(default_factory=BrokerTimings)  # filled through dotted fields
    migration: MigrationPolicy = field(default_factory=MigrationPolicy)  # likewise
    max_loop_lag: float = declared("max_loop_lag")
    direct_write: bool = declared("direct_write")
    detach_subscribers: bool = declared("detach_subscribers")
    gc_gen0_threshold: int = declared("gc_gen0_threshold")
    responses_ws_max_active: int = declared("responses_ws_max_active")
    responses_ws_max_lanes: int = declared("responses_ws_max_lanes")
    responses_ws_max_pending: int = declared("responses_ws_max_pending")
    responses_ws_cache_entries: int = declared("responses_ws_cache_entries")
    responses_ws_cache_chars: int = declared("responses_ws_cache_chars")
    log_level: str = declared("log_level")
    otlp_traces_endpoint: str | None = declared("otlp_traces_endpoint")  # OpenTelemetry traces (OTLP/HTTP)

    def __post_init__(self) -> None:
        try:
            TrustedProxies(self.trusted_proxies)
        except ValueError as exc:
            raise ValueError(f"--trusted-proxies: {exc}") from None



def gateway_config(values: Mapping[str, Any]) -> GatewayConfig:
    """A GatewayConfig from :func:`tokenfan_settings.resolve` values (of ``gateway`` or ``serve``)."""
    return build(GatewayConfig, values, "gateway")
