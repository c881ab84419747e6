"""Gateway settings: the :class:`GatewayConfig` dataclass, filled from the table in
:mod:`engine_worker.settings` (flags, ``TOKENFAN_*`` environment fallbacks and defaults are declared there)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_worker.settings import add_arguments, build, declared
from gateway.api.validation import Limits
from gateway.core.streams import Retention, SlowConsumerPolicy
from gateway.scaleout.broker_codec import BrokerTimings


@dataclass(slots=True)
class GatewayConfig:
    host: str = declared("host")
    port: int = declared("port")
    workers: int = declared("workers")
    ssl_certfile: Path | None = declared("ssl_certfile")
    ssl_keyfile: Path | None = declared("ssl_keyfile")
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
    token_secret: str | None = declared("token_secret")
    stream_token_ttl: float = declared("stream_token_ttl")
    allowed_origins: tuple[str, ...] = declared("allowed_origins")
    cors_origins: tuple[str, ...] = declared("cors_origins")
    curve_dir: Path | None = declared("curve_dir")
    broker_url: str | None = declared("broker_url")
    broker_idle_timeout: float = declared("broker_idle_timeout")
    broker: BrokerTimings = field(default_factory=BrokerTimings)  # filled through dotted fields
    max_loop_lag: float = declared("max_loop_lag")
    direct_write: bool = declared("direct_write")
    gc_gen0_threshold: int = declared("gc_gen0_threshold")
    responses_ws_max_active: int = declared("responses_ws_max_active")
    responses_ws_max_lanes: int = declared("responses_ws_max_lanes")
    responses_ws_max_pending: int = declared("responses_ws_max_pending")
    responses_ws_cache_entries: int = declared("responses_ws_cache_entries")
    responses_ws_cache_chars: int = declared("responses_ws_cache_chars")
    log_level: str = declared("log_level")

    def __post_init__(self) -> None:
        from gateway.http.clients import TrustedProxies

        try:
            TrustedProxies(self.trusted_proxies)
        except ValueError as exc:
            raise ValueError(f"--trusted-proxies: {exc}") from None


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tokenfan gateway``."""
    add_arguments(parser, "gateway")


def gateway_config(values: Mapping[str, Any]) -> GatewayConfig:
    """A GatewayConfig from :func:`engine_worker.settings.resolve` values (of ``gateway`` or ``serve``)."""
    return build(GatewayConfig, values, "gateway")
