"""Gateway settings: one dataclass, parsed once from CLI flags with ``TOKENFAN_*`` environment fallbacks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from engine_worker.config import default_engine_address, env
from gateway.openai_api import Limits
from gateway.streams import Retention, SlowConsumerPolicy


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engine_address: str = field(default_factory=default_engine_address)
    served_model_name: str | None = None  # default: what the engine reports
    heartbeat_interval: float = 0.25
    heartbeat_timeout: float = 1.0
    accept_timeout: float = 30.0
    keepalive_interval: float = 15.0
    max_body_bytes: int = 1 << 20
    ws_max_message_bytes: int = 1 << 20
    ws_per_message_deflate: bool = False
    ws_send_queue: int = 1024
    limits: Limits = field(default_factory=Limits)
    retention: Retention = field(default_factory=Retention)
    policy: SlowConsumerPolicy = field(default_factory=SlowConsumerPolicy)
    sse_retry_ms: int = 1000
    inject_delay: dict[str, float] = field(default_factory=dict)  # transport -> seconds (diagnostic)
    shutdown_grace: float = 10.0
    max_concurrent: int = 4096
    max_concurrent_per_key: int = 0
    max_prompt_tokens: int = 0
    api_keys: tuple[str, ...] = ()
    token_secret: str | None = None
    stream_token_ttl: float = 3600.0
    allowed_origins: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    curve_dir: Path | None = None
    broker_url: str | None = None
    broker_idle_timeout: float = 60.0
    log_level: str = "INFO"


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    g = parser.add_argument_group("gateway")
    g.add_argument("--host", default=env("host", d.host), help="bind address [TOKENFAN_HOST]")
    g.add_argument("--port", type=int, default=env("port", d.port, int), help="HTTP port [TOKENFAN_PORT]")
    g.add_argument("--served-model-name", default=env("served_model_name", None),
                   help="model id shown in /v1/models and accepted in requests (default: the engine's) "
                        "[TOKENFAN_SERVED_MODEL_NAME]")
    g.add_argument("--heartbeat-interval", type=float, default=env("heartbeat_interval", d.heartbeat_interval, float),
                   help="seconds between engine pings [TOKENFAN_HEARTBEAT_INTERVAL]")
    g.add_argument("--heartbeat-timeout", type=float, default=env("heartbeat_timeout", d.heartbeat_timeout, float),
                   help="engine presumed down after this many seconds without a heartbeat [TOKENFAN_HEARTBEAT_TIMEOUT]")
    g.add_argument("--accept-timeout", type=float, default=env("accept_timeout", d.accept_timeout, float),
                   help="max seconds for the engine to accept a request [TOKENFAN_ACCEPT_TIMEOUT]")
    g.add_argument("--keepalive-interval", type=float, default=env("keepalive_interval", d.keepalive_interval, float),
                   help="SSE comment / WebSocket ping interval on idle streams [TOKENFAN_KEEPALIVE_INTERVAL]")
    g.add_argument("--max-body-bytes", type=int, default=env("max_body_bytes", d.max_body_bytes, int),
                   help="request body size limit (413 above) [TOKENFAN_MAX_BODY_BYTES]")
    g.add_argument("--ws-max-message-bytes", type=int,
                   default=env("ws_max_message_bytes", d.ws_max_message_bytes, int),
                   help="WebSocket incoming message size limit (close 1009 above) [TOKENFAN_WS_MAX_MESSAGE_BYTES]")
    g.add_argument("--ws-per-message-deflate", action="store_true",
                   default=env("ws_per_message_deflate", False, bool),
                   help="enable WebSocket permessage-deflate (off: it biases latency comparisons) "
                        "[TOKENFAN_WS_PER_MESSAGE_DEFLATE]")
    g.add_argument("--default-max-tokens", type=int, default=env("default_max_tokens", d.limits.default_max_tokens, int),
                   help="max_tokens when a request gives none [TOKENFAN_DEFAULT_MAX_TOKENS]")
    g.add_argument("--max-tokens-cap", type=int, default=env("max_tokens_cap", d.limits.max_tokens_cap, int),
                   help="largest max_tokens a request may ask for [TOKENFAN_MAX_TOKENS_CAP]")
    r, pol = d.retention, d.policy
    g.add_argument("--stream-ttl", type=float, default=env("stream_ttl", r.finished_ttl, float),
                   help="seconds a finished fan-out stream stays resumable [TOKENFAN_STREAM_TTL]")
    g.add_argument("--stream-max-bytes", type=int, default=env("stream_max_bytes", r.max_bytes, int),
                   help="bytes all retained streams may hold; oldest finished go first [TOKENFAN_STREAM_MAX_BYTES]")
    g.add_argument("--max-streams", type=int, default=env("max_streams", r.max_streams, int),
                   help="running + retained fan-out streams (429 above) [TOKENFAN_MAX_STREAMS]")
    g.add_argument("--max-subscribers", type=int, default=env("max_subscribers", r.max_subscribers, int),
                   help="subscribers per stream (429 above) [TOKENFAN_MAX_SUBSCRIBERS]")
    g.add_argument("--coalesce-after", type=int, default=env("coalesce_after", pol.coalesce_after, int),
                   help="pending events beyond which a lagging subscriber gets them merged [TOKENFAN_COALESCE_AFTER]")
    g.add_argument("--send-timeout", type=float, default=env("send_timeout", pol.send_timeout, float),
                   help="a write blocked this long closes the subscriber as too slow [TOKENFAN_SEND_TIMEOUT]")
    g.add_argument("--sse-retry-ms", type=int, default=env("sse_retry_ms", d.sse_retry_ms, int),
                   help="SSE retry: hint sent to EventSource [TOKENFAN_SSE_RETRY_MS]")
    g.add_argument("--shutdown-grace", type=float, default=env("shutdown_grace", d.shutdown_grace, float),
                   help="seconds in-flight streams get to finish on SIGTERM [TOKENFAN_SHUTDOWN_GRACE]")
    g.add_argument("--inject-delay", action="append", default=[], metavar="TRANSPORT:MS",
                   help="DIAGNOSTIC: delay every write of a transport (sse|ws) by MS ms, for bench "
                        "calibration; off by default [TOKENFAN_INJECT_DELAY]")
    g.add_argument("--max-concurrent", type=int, default=env("max_concurrent", d.max_concurrent, int),
                   help="generations in flight in this gateway (429 above) [TOKENFAN_MAX_CONCURRENT]")
    g.add_argument("--max-concurrent-per-key", type=int,
                   default=env("max_concurrent_per_key", d.max_concurrent_per_key, int),
                   help="generations in flight per API key, 0 = no per-key limit [TOKENFAN_MAX_CONCURRENT_PER_KEY]")
    g.add_argument("--max-prompt-tokens", type=int, default=env("max_prompt_tokens", d.max_prompt_tokens, int),
                   help="prompt length limit in tokens, 0 = only the model's context [TOKENFAN_MAX_PROMPT_TOKENS]")
    g.add_argument("--api-key", dest="api_keys", action="append", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (repeatable; env: comma-separated) "
                        "[TOKENFAN_API_KEYS]")
    g.add_argument("--token-secret", default=env("token_secret", None),
                   help="HMAC secret for stream tokens (default: random per process; set it when several "
                        "gateway replicas must accept each other's tokens) [TOKENFAN_TOKEN_SECRET]")
    g.add_argument("--stream-token-ttl", type=float, default=env("stream_token_ttl", d.stream_token_ttl, float),
                   help="lifetime in seconds of the stream tokens in events_url/ws_url [TOKENFAN_STREAM_TOKEN_TTL]")
    g.add_argument("--allowed-origins", default=env("allowed_origins", ""),
                   help="comma-separated Origins allowed to open WebSockets besides the gateway's own host; "
                        "* allows any [TOKENFAN_ALLOWED_ORIGINS]")
    g.add_argument("--cors-origins", default=env("cors_origins", ""),
                   help="comma-separated Origins allowed by CORS on HTTP routes; * allows any "
                        "[TOKENFAN_CORS_ORIGINS]")
    g.add_argument("--broker", dest="broker_url", default=env("broker", None),
                   help="Redis URL (redis://host:6379/0): share fan-out streams across gateway replicas "
                        "through Redis Streams [TOKENFAN_BROKER]")
    g.add_argument("--broker-idle-timeout", type=float, default=env("broker_idle_timeout", 60.0, float),
                   help="a mirrored stream with no new entry for this long ends with owner_lost "
                        "[TOKENFAN_BROKER_IDLE_TIMEOUT]")
    g.add_argument("--curve-dir", type=Path, default=env("curve_dir", None, Path),
                   help="CURVE keys (from `tokenfan keys DIR`) for tcp:// engine links: encrypted, and the "
                        "engine admits only authorized gateways [TOKENFAN_CURVE_DIR]")
    g.add_argument("--log-level", default=env("log_level", d.log_level), help="[TOKENFAN_LOG_LEVEL]")


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in raw.split(",") if x.strip())


def parse_inject_delay(items: list[str]) -> dict[str, float]:
    """``["sse:1", "ws:0.5"]`` -> ``{"sse": 0.001, "ws": 0.0005}`` (seconds)."""
    out: dict[str, float] = {}
    for item in items:
        transport, _, ms = item.partition(":")
        if transport not in ("sse", "ws") or not ms:
            raise ValueError(f"--inject-delay wants sse:MS or ws:MS, got {item!r}")
        out[transport] = float(ms) / 1000.0
    return out


def gateway_config_from_args(ns: argparse.Namespace, engine_address: str) -> GatewayConfig:
    return GatewayConfig(
        host=ns.host, port=ns.port, engine_address=engine_address, served_model_name=ns.served_model_name,
        heartbeat_interval=ns.heartbeat_interval, heartbeat_timeout=ns.heartbeat_timeout,
        accept_timeout=ns.accept_timeout, keepalive_interval=ns.keepalive_interval,
        max_body_bytes=ns.max_body_bytes, ws_max_message_bytes=ns.ws_max_message_bytes,
        ws_per_message_deflate=ns.ws_per_message_deflate,
        limits=Limits(default_max_tokens=ns.default_max_tokens, max_tokens_cap=ns.max_tokens_cap),
        retention=Retention(finished_ttl=ns.stream_ttl, max_bytes=ns.stream_max_bytes, max_streams=ns.max_streams,
                            max_subscribers=ns.max_subscribers),
        policy=SlowConsumerPolicy(coalesce_after=ns.coalesce_after, send_timeout=ns.send_timeout),
        sse_retry_ms=ns.sse_retry_ms, shutdown_grace=ns.shutdown_grace,
        inject_delay=parse_inject_delay(ns.inject_delay or [x for x in [env("inject_delay", "")] if x]),
        max_concurrent=ns.max_concurrent, max_concurrent_per_key=ns.max_concurrent_per_key,
        max_prompt_tokens=ns.max_prompt_tokens,
        api_keys=tuple(ns.api_keys) if ns.api_keys else _csv(env("api_keys", "")),
        token_secret=ns.token_secret, stream_token_ttl=ns.stream_token_ttl,
        allowed_origins=_csv(ns.allowed_origins), cors_origins=_csv(ns.cors_origins), curve_dir=ns.curve_dir,
        broker_url=ns.broker_url, broker_idle_timeout=ns.broker_idle_timeout,
        log_level=ns.log_level,
    )
