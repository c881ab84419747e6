"""Every tokenfan setting, declared once: :data:`SETTINGS`.

One row gives a setting's name, kind, default, help, flag, environment variable (``TOKENFAN_<NAME>``) and
the commands that take it (``serve``, ``gateway``, ``engine``). From the table come the argparse
arguments (:func:`add_arguments`), the values of a command line with environment fallbacks
(:func:`resolve`: the flag wins, then the environment, then the default), the config dataclasses
(:func:`build`, and the defaults of their fields via :func:`declared`), the argv that reproduces a
config (:func:`to_argv`, what ``tokenfan serve`` passes to its engine) and the reference table in
docs/settings.md (``python -m tokenfan_settings --write docs/settings.md``).

``--help`` shows the settings a user sets, in the groups of :data:`HELP_GROUPS`; every other one is
*advanced*: it works the same (flag and environment), ``--help-all`` shows it, and docs/settings.md lists it.

It is the foundation both processes stand on: it imports nothing of tokenfan's, and the gateway, the
engine worker and the umbrella CLI (:mod:`tokenfan.cli`) import it; the engine reads only its own rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

COMMANDS = ("serve", "gateway", "engine")
T = TypeVar("T")


class SettingError(ValueError):
    """A flag or environment value that does not parse or is out of range (the message names it)."""


# -- defaults that depend on the machine -------------------------------------------------------

def default_runtime_dir() -> Path:
    """A per-user directory for IPC sockets: ``$XDG_RUNTIME_DIR/tokenfan`` or ``/tmp/tokenfan-<uid>``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "tokenfan" if base else Path(f"/tmp/tokenfan-{os.getuid()}")


def default_engine_address() -> str:
    return f"ipc://{default_runtime_dir() / 'engine.sock'}"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenfan"


def traces_endpoint(configured: str | None) -> str | None:
    """Where OpenTelemetry spans go (OTLP/HTTP): ``--otlp-traces-endpoint``, else the standard
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; None: tracing is off (docs/observability.md)."""
    return configured or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None


# -- kinds -------------------------------------------------------------------------------------

def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(raw)


def parse_transport_delay(raw: str) -> tuple[str, float]:
    """``"sse:1"`` -> ``("sse", 0.001)``: a transport and a delay in seconds."""
    transport, _, ms = raw.partition(":")
    if transport not in ("sse", "ws", "sse-h3", "wt") or not ms:
        raise ValueError(raw)
    return transport, float(ms) / 1000.0


@dataclass(frozen=True, slots=True)
class Kind:
    """How one raw string (a flag value, an environment value, one list item) becomes a value and back."""

    name: str  # shown in docs/settings.md
    metavar: str  # shown in --help
    parse: Callable[[str], Any]
    format: Callable[[Any], str] = str


STR = Kind("str", "TEXT", str)
INT = Kind("int", "N", int)
FLOAT = Kind("float", "X", float)
PATH = Kind("path", "PATH", Path)
BOOL = Kind("bool", "BOOL", parse_bool, lambda v: "true" if v else "false")
def parse_replicas(raw: str) -> int | None:
    """``"auto"`` -> None (as many as the primary has online); else a count >= 0."""
    if raw.strip().lower() == "auto":
        return None
    n = int(raw)
    if n < 0:
        raise ValueError(raw)
    return n


REPLICAS = Kind("auto|N", "auto|N", parse_replicas, lambda v: "auto" if v is None else str(v))
TRANSPORT_DELAY = Kind("TRANSPORT:MS", "TRANSPORT:MS", parse_transport_delay, lambda kv: f"{kv[0]}:{kv[1] * 1000:g}")


# -- the declaration ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Setting:
    name: str  # the config field, the argparse dest, and TOKENFAN_<NAME>
    kind: Kind
    help: str
    commands: frozenset[str]
    default: Any = None
    default_factory: Callable[[], Any] | None = None  # a default that depends on the machine
    doc_default: str = ""  # how docs/settings.md shows a machine-dependent default
    flag: str = ""  # default: --<name-with-dashes>
    env: str = ""  # default: TOKENFAN_<NAME>
    aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # command -> flags
    deprecated: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # ditto, warned
    field: str = ""  # dotted path in the config dataclass, default: name
    repeat: bool = False  # a list: repeatable flag, every value comma-separated; collect() makes the value
    collect: Callable[[Iterable[Any]], Any] = tuple
    choices: tuple[str, ...] = ()
    minimum: float | None = None

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return self.env or "TOKENFAN_" + self.name.upper()

    @property
    def path(self) -> str:
        return self.field or self.name

    def default_value(self) -> Any:
        return self.default_factory() if self.default_factory else self.default

    def parse(self, raws: list[str], source: str) -> Any:
        """The value of one or more raw strings (several only for a repeatable setting)."""
        try:
            if self.repeat:
                return self.collect(self.kind.parse(x.strip()) for raw in raws for x in raw.split(",")
                                    if x.strip())
            value = self.kind.parse(raws[-1])
        except ValueError:
            raise SettingError(f"{source}: invalid {self.kind.name} value {','.join(raws)!r}") from None
        if self.choices and value not in self.choices:
            raise SettingError(f"{source}: {value!r} is not one of {', '.join(self.choices)}")
        if self.minimum is not None and value < self.minimum:
            raise SettingError(f"{source}: {value} is below the minimum {self.minimum:g}")
        return value

    def raw(self, value: Any) -> list[str]:
        """The flag values that parse back to ``value`` ([] for none)."""
        if value is None:
            return []
        if not self.repeat:
            return [self.kind.format(value)]
        items = value.items() if isinstance(value, dict) else [value] if isinstance(value, str) else value
        return [self.kind.format(x) for x in items if x != ""]


SERVE_GATEWAY = frozenset({"serve", "gateway"})
SERVE_ENGINE = frozenset({"serve", "engine"})
EVERY = frozenset(COMMANDS)


def _gw(name: str, kind: Kind, default: Any, help: str, **kw: Any) -> Setting:
    return Setting(name, kind, help, SERVE_GATEWAY, default, **kw)


def _en(name: str, kind: Kind, default: Any, help: str, **kw: Any) -> Setting:
    return Setting(name, kind, help, SERVE_ENGINE, default, **kw)


SETTINGS: tuple[Setting, ...] = (
    # both sides of the engine link
    Setting("engine_address", STR, "ZeroMQ address of the engine, ipc://PATH or tcp://HOST:PORT: `engine` binds "
            "it, `gateway` connects to it (several engines: comma-separated or repeated, new requests go to the "
            "least-loaded healthy one), `serve` does both", EVERY,
            default_factory=default_engine_address, repeat=True, collect=",".join,
            doc_default="`ipc://$XDG_RUNTIME_DIR/tokenfan/engine.sock` (without XDG_RUNTIME_DIR: "
                        "`ipc:///tmp/tokenfan-<uid>/engine.sock`); serve: a private socket per port",
            aliases={"engine": ("--address",)}, deprecated={"gateway": ("--engine",)}),
    Setting("curve_dir", PATH, "CURVE keys (from `tokenfan keys DIR`) for tcp:// engine links: encrypted, and "
            "the engine admits only authorized gateways", EVERY),
    Setting("log_level", STR, "logging level (debug, info, warning, error)", EVERY, "INFO"),
    Setting("otlp_traces_endpoint", STR, "OpenTelemetry traces: the OTLP/HTTP URL spans are sent to (e.g. "
            "http://127.0.0.1:4318/v1/traces); off when unset (then OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, if set, "
            "turns them on). The gateway traces each generation (W3C traceparent accepted on every route); the engine "
            "passes it to vLLM, whose request spans join the gateway's trace (docs/observability.md)", EVERY),
    # gateway
    _gw("host", STR, "127.0.0.1", "bind address"),
    _gw("port", INT, 8000, "HTTP port", minimum=0),
    _gw("workers", INT, 1, "gateway processes sharing the port", minimum=1),
    _gw("ssl_certfile", PATH, None, "TLS certificate chain (PEM); with --ssl-keyfile the gateway serves HTTPS"),
    _gw("ssl_keyfile", PATH, None, "TLS private key (PEM) for --ssl-certfile"),
    _gw("http3_port", INT, 0, "UDP port for HTTP/3 and WebTransport (QUIC, on --host), 0 = off: SSE over "
        "HTTP/3 on the same routes, WebTransport sessions at `/v1/wt` (docs/api.md); needs a certificate "
        "(--http3-certfile, else --ssl-certfile)", minimum=0),
    _gw("http3_certfile", PATH, None, "TLS certificate chain (PEM) for --http3-port (default: --ssl-certfile); "
        "browsers accept a self-signed one for WebTransport by its hash if it is valid for at most 14 days "
        "(`tokenfan certs --days 13 DIR`)"),
    _gw("http3_keyfile", PATH, None, "TLS private key (PEM) for --http3-certfile (default: --ssl-keyfile)"),
    _gw("http_header_timeout", FLOAT, 10.0, "seconds a client may take to send its request headers"),
    _gw("http_body_timeout", FLOAT, 30.0, "seconds a client may take to send a request body"),
    Setting("served_model_name", STR, "model id shown in /v1/models, accepted in requests and written in "
            "responses (default: the engine's: its model directory's name)", EVERY),
    _gw("heartbeat_interval", FLOAT, 0.25, "seconds between engine pings"),
    _gw("heartbeat_timeout", FLOAT, 5.0, "engine presumed down after this many seconds without a heartbeat (a crash or restart "
        "is noticed at once from the dropped connection; this catches a hung or unreachable engine)"),
    _gw("accept_timeout", FLOAT, 30.0, "max seconds for the engine to accept a request"),
    _gw("keepalive_interval", FLOAT, 15.0, "SSE comment / WebSocket ping interval on idle streams"),
    _gw("max_body_bytes", INT, 1 << 20, "request body size limit (413 above)"),
    _gw("ws_max_message_bytes", INT, 1 << 20, "WebSocket incoming message size limit (close 1009 above)"),
    _gw("ws_per_message_deflate", BOOL, False,
        "enable WebSocket permessage-deflate (off: it biases latency comparisons)"),
    _gw("default_max_tokens", INT, 256, "max_tokens when a request gives none", field="limits.default_max_tokens"),
    _gw("max_tokens_cap", INT, 4096, "largest max_tokens a request may ask for", field="limits.max_tokens_cap"),
    _gw("stream_ttl", FLOAT, 300.0, "seconds a finished fan-out stream stays resumable",
        field="retention.finished_ttl"),
    _gw("stream_max_bytes", INT, 256 << 20, "bytes all retained streams may hold; oldest finished go first",
        field="retention.max_bytes"),
    _gw("max_streams", INT, 10_000, "running + retained fan-out streams (429 above)",
        field="retention.max_streams"),
    _gw("max_subscribers", INT, 10_000, "subscribers per stream (429 above)", field="retention.max_subscribers"),
    _gw("coalesce_after", INT, 8, "pending events beyond which a lagging subscriber gets them merged",
        field="policy.coalesce_after"),
    _gw("send_timeout", FLOAT, 10.0, "a write blocked this long cuts the reader as too slow (every path: "
        "SSE `event: error` slow_consumer, WebSocket close 1013); its generation is aborted if it was the "
        "only reader", field="policy.send_timeout"),
    _gw("max_json_depth", INT, 64, "deepest JSON nesting of a request body or WebSocket message "
        "(400 invalid_json above)", field="limits.max_json_depth"),
    _gw("cut_linger", FLOAT, 10.0, "seconds a cut connection may still flush its ending to a peer that "
        "reads again before it is reset", field="policy.linger"),
    _gw("max_loop_lag", FLOAT, 0.5, "new work gets 503 `overloaded` while the gateway's event loop runs "
        "this many seconds late on the median tick of the last second (one stall is not overload; 0 = off)"),
    _gw("direct_write", BOOL, True, "the publisher writes each event straight to every caught-up reader "
        "(uvicorn, HTTP/1.1); off = every reader writes from its own task (for A/B measurement)"),
    _gw("detach_subscribers", BOOL, True, "fan-out subscribers (`/v1/streams/{id}/events` and `/ws`) leave "
        "their ASGI call once their response started: the gateway holds the socket itself, without the "
        "server's and the framework's per-request objects (uvicorn, HTTP/1.1: SSE responses then say "
        "`Connection: close`; off on a uvicorn the shim was not written for, docs/tls.md); off = they stay in it "
        "(for A/B measurement)"),
    _gw("gc_gen0_threshold", INT, 700, "the gateway's garbage collector runs a young collection every this many "
        "allocations (Python's default 700; see the GC figures in docs/vs-vllm.md)"),
    _gw("sse_retry_ms", INT, 1000, "SSE retry: hint sent to EventSource"),
    _gw("responses_ws_max_active", INT, 16, "Responses WebSocket mode: `stream_id` lanes generating at once "
        "per connection (more wait their turn)"),
    _gw("responses_ws_max_lanes", INT, 32, "Responses WebSocket mode: distinct `stream_id`s per connection "
        "(`websocket_stream_limit_reached` above)"),
    _gw("responses_ws_max_pending", INT, 256, "Responses WebSocket mode: `response.create`s waiting per "
        "connection (429 `error` event above)"),
    _gw("responses_ws_cache_entries", INT, 64, "Responses WebSocket mode: recent transcripts a connection keeps "
        "for `previous_response_id`"),
    _gw("responses_ws_cache_chars", INT, 4_000_000, "Responses WebSocket mode: total text of those transcripts "
        "(oldest dropped first)"),
    _gw("shutdown_grace", FLOAT, 10.0, "seconds in-flight streams get to finish on SIGTERM"),
    _gw("inject_delay", TRANSPORT_DELAY, None, "DIAGNOSTIC: delay every write of a transport (sse|ws|sse-h3|wt) by MS ms, "
        "for bench calibration (it also turns the one-pass write off, so both arms take the same path); off by "
        "default", default_factory=dict, repeat=True, collect=dict),
    _gw("max_concurrent", INT, 4096, "generations in flight in this gateway (429 above)"),
    _gw("max_concurrent_per_key", INT, 0, "generations in flight per API key, 0 = no per-key limit"),
    # per-client and per-connection limits (docs/limits.md: each one's error); 0 = no limit
    _gw("max_generations_per_client", INT, 64, "generations in flight per client (its API key with keys on, "
        "else its address) across every route; 429 `client_generation_limit` above", minimum=0),
    _gw("max_connections_per_client", INT, 256, "open connections per client: WebSockets and HTTP requests in "
        "progress (streams included); 429 `client_connection_limit` above", minimum=0),
    _gw("max_subscriptions_per_client", INT, 128, "fan-out subscriptions (`/v1/streams/{id}/events` and `/ws`) "
        "open per client; 429 `client_subscription_limit` above", minimum=0),
    _gw("ws_max_in_flight", INT, 32, "`/v1/ws`: generations running at once per connection (more wait in its "
        "queue)", minimum=1),
    _gw("ws_max_queued", INT, 64, "`/v1/ws`: requests waiting per connection; an error `connection_queue_limit` "
        "for each request above, the socket stays open", minimum=0),
    _gw("fair_share_at", FLOAT, 0.75, "fair admission: once the gateway holds this fraction of --max-concurrent "
        "generations, a client holding at least the average per client is refused (429 `fair_share_limit`), "
        "so one holding nothing still gets in; while the engines queue requests, one holding more than the "
        "average is", minimum=0),
    _gw("trusted_proxies", STR, (), "addresses or CIDR networks of reverse proxies whose `X-Forwarded-For` names "
        "the client for per-client limits (repeatable or comma-separated); from anyone else it is ignored",
        repeat=True),
    _gw("max_prompt_tokens", INT, 0, "prompt length limit in tokens, 0 = only the model's context"),
    _gw("api_keys", STR, (), "require `Authorization: Bearer KEY` on /v1/* (repeatable or comma-separated)",
        flag="--api-key", repeat=True),
    _gw("api_key_file", PATH, None, "a file of API keys, one per line (`#` comments and blank lines ignored), "
        "accepted besides --api-key; read again on SIGHUP, so keys are added and removed without a restart. "
        "With it set, keys are required even while the file lists none (docs/deploy.md)"),
    _gw("token_secret", STR, None, "HMAC secret for stream tokens (default: random per server: with --workers, "
        "one the supervisor makes and hands every worker; set it when several gateway replicas must accept each "
        "other's tokens)"),
    _gw("token_secret_file", PATH, None, "a file of stream-token secrets, one per line: the first signs, the "
        "others are still accepted (the previous ones, until the tokens they signed expire); read again on "
        "SIGHUP (instead of --token-secret; docs/deploy.md)"),
    _gw("stream_token_ttl", FLOAT, 3600.0, "lifetime in seconds of the stream tokens in events_url/ws_url"),
    _gw("allowed_origins", STR, (), "Origins allowed to open WebSockets besides the gateway's own host "
        "(repeatable or comma-separated); * allows any", repeat=True),
    _gw("cors_origins", STR, (), "Origins allowed by CORS on HTTP routes (repeatable or comma-separated); "
        "* allows any", repeat=True),
    _gw("broker_url", STR, None, "Redis URL: share fan-out streams across gateway replicas through Redis Streams; "
        "redis://[user:password@]host:6379/0 (rediss:// TLS, unix://), "
        "redis+sentinel://host:26379[,host:26379...]/<service>[/<db>], redis+cluster://host:port[,host:port...] "
        "(docs/deploy.md, Redis topologies)", flag="--broker", env="TOKENFAN_BROKER"),
    _gw("broker_password", STR, None, "password of the Redis servers behind --broker when its URL has none "
        "(keep it out of the command line: set TOKENFAN_BROKER_PASSWORD)"),
    _gw("broker_sentinel_password", STR, None, "password of the sentinels of a redis+sentinel:// --broker, when "
        "they require one (TOKENFAN_BROKER_SENTINEL_PASSWORD)"),
    _gw("broker_idle_timeout", FLOAT, 60.0,
        "a mirrored stream (--broker or --workers) with no new entry for this long checks its owner: owner_lost "
        "if that gateway is gone (its lease expired, or its worker's socket refuses), broker_unavailable if Redis "
        "was unreachable all that time"),
    _gw("standby_timeout", FLOAT, 2.0, "--workers without --broker: how long a worker holds a listed stream's new "
        "events from its readers while its standby (the next worker) has not confirmed them; past it the standby "
        "is given up: the events are released and the stream can no longer be adopted (docs/failures.md)",
        minimum=0.05),
    _gw("relay_delay", FLOAT, 0.0, "DIAGNOSTIC (tests): every write of a worker to a standby's relay waits this "
        "many seconds first, so the standby lags behind the worker's readers; off by default", minimum=0.0),
    _gw("broker_op_timeout", FLOAT, 2.0, "connect and reply timeout of an ordinary Redis command",
        field="broker.op_timeout"),
    _gw("broker_block", FLOAT, 2.0, "longest blocking Redis read (XREAD BLOCK / BLPOP); its socket timeout is this "
        "plus --broker-op-timeout", field="broker.block"),
    _gw("broker_backoff_max", FLOAT, 1.0, "Redis reconnect delays double from 50 ms up to this (jittered)",
        field="broker.backoff_max"),
    _gw("broker_lease_interval", FLOAT, 0.5, "how often a gateway refreshes its owner lease in Redis (and, with "
        "--workers, how often a quiet mirror asks its owner worker)",
        field="broker.lease_interval"),
    _gw("broker_lease_ttl", FLOAT, 2.0, "a lease not refreshed for this long means its gateway is gone; a gateway "
        "whose refresh Redis has not confirmed for this long minus min(0.5 s, a quarter of it) fences itself: the "
        "readers of its listed streams resume on a replica and /health says not ready (docs/failures.md)",
        field="broker.lease_ttl"),
    _gw("broker_presence_check", FLOAT, 0.15, "a mirrored stream quiet this long asks Redis whether its owner's "
        "presence subscription is open; closed twice, 0.1 s apart, the owner was killed and a replica adopts "
        "the stream at once (0: wait for the lease)", field="broker.presence_check"),
    _gw("broker_cancel_timeout", FLOAT, 3.0, "how long a cross-replica DELETE waits for the owner's answer",
        field="broker.cancel_timeout"),
    _gw("broker_max_pending", INT, 65_536, "stream entries queued for the next Redis pipeline; beyond, the "
        "streams are repaired from the owner's log later", field="broker.max_pending"),
    _gw("broker_replicas", REPLICAS, None, "with --broker, a listed stream's event reaches readers once this many "
        "Redis replicas acknowledged it (WAIT after each pipeline), so a promoted replica holds whatever a reader "
        "saw; auto: every replica the primary has online (INFO replication, checked every second; none: no "
        "wait); 0: never wait (docs/failures.md)", field="broker.replicas", doc_default="`auto`"),
    _gw("broker_replica_timeout", FLOAT, 0.5, "how long one WAIT for --broker-replicas blocks; replicas that do not "
        "answer in time hold delivery (nothing unreplicated reaches a reader) and the wait is retried; at most "
        "half of --broker-op-timeout", field="broker.replica_timeout"),
    _gw("handover", BOOL, True, "on SIGTERM with --broker, hand the listed streams (fan-out, background) to the "
        "other replicas, which continue them from the log, instead of draining them for --shutdown-grace"),
    _gw("migration_limit", INT, 3, "continuations of one request on another engine when its engine is lost "
        "(killed, restarted, unreachable): the client's stream goes on with the next token (docs/failures.md); "
        "0: never, the request fails with engine_unavailable", field="migration.limit", minimum=0),
    _gw("migration_wait", FLOAT, 60.0, "seconds a request whose engine was lost waits for a healthy engine to "
        "continue on (one engine: its restart) before it fails", field="migration.wait"),
    _gw("migration_max_tokens", INT, 0, "a lost request with more prompt + output tokens than this is not "
        "continued (re-reading a long sequence costs a prefill); 0: no limit", field="migration.max_tokens",
        minimum=0),
    # engine
    _en("backend", STR, "vllm", "engine backend", flag="--engine", env="TOKENFAN_ENGINE",
        aliases={"serve": ("--backend",), "engine": ("--backend",)}, choices=("vllm", "synthetic")),
    _en("model", STR, None, "local Hugging Face model directory (default: Gemma 3 270M, prepared once)"),
    _en("cache_dir", PATH, None, "where the default model is prepared", default_factory=default_cache_dir,
        doc_default="`$XDG_CACHE_HOME/tokenfan` (else `~/.cache/tokenfan`)"),
    _en("max_model_len", INT, 2048, "context length (prompt + output tokens)"),
    _en("dtype", STR, "auto", "vLLM dtype"),
    _en("kv_cache_gib", INT, 1, "CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)"),
    _en("tensor_parallel_size", INT, 1, "vLLM tensor parallelism (GPUs per engine)", minimum=1),
    _en("pipeline_parallel_size", INT, 1, "vLLM pipeline parallelism", minimum=1),
    _en("enforce_eager", BOOL, True, "disable CUDA graphs / torch.compile"),
    _en("gpu_memory_utilization", FLOAT, 0.9, "vLLM GPU memory fraction"),
    _en("chat_template", STR, None, "Jinja chat template file overriding the tokenizer's"),
    _en("enable_auto_tool_choice", BOOL, False, "vLLM's flag: `tool_choice: auto` lets the model call tools "
        "(needs --tool-call-parser)"),
    _en("tool_call_parser", STR, None, "vLLM's flag: the tool parser for the model's tool-call format (e.g. "
        "hermes, llama3_json, mistral); vllm.tool_parsers"),
    _en("tool_parser_plugin", STR, None, "vLLM's flag: a Python file that registers a tool parser"),
    _en("reasoning_parser", STR, None, "vLLM's flag: the reasoning parser (e.g. deepseek_r1, qwen3); reasoning "
        "text goes to the chunk field `reasoning`"),
    _en("structured_outputs_config", STR, None, "vLLM's flag: structured-output backend settings as JSON, e.g. "
        "'{\"backend\": \"xgrammar\", \"disable_any_whitespace\": true}'"),
    _en("stream_interval", INT, 1, "deliver every N tokens per event (like vLLM's --stream-interval)",
        minimum=1),
    _en("cpu_placement", STR, "auto", "vLLM on CPU hosts: where the engine runs. `auto`: `split` on hosts with up "
        "to 8 CPUs for models under 256 MiB of weights, else `vllm`; `split`: engine core + model worker on all "
        "CPUs but the last; `vllm`: vLLM's own auto binding; `all`: every CPU in the OpenMP pool; or a VLLM_CPU_OMP_THREADS_BIND CPU list. "
        "VLLM_CPU_OMP_THREADS_BIND in the environment wins"),
    _en("synthetic_ttft_ms", FLOAT, 20.0, "synthetic engine: time to first token"),
    _en("synthetic_tokens_per_s", FLOAT, 50.0, "synthetic engine: tokens per second per stream"),
    _en("synthetic_steps", STR, "per-stream", "synthetic engine: `shared`: every running request's token comes "
        "out on one step clock (one step every 1/tokens-per-s, a request joins at the first step after its TTFT), "
        "as a GPU engine's continuous batching does; `per-stream`: each request on its own phase (a step per "
        "token at worst)", choices=("per-stream", "shared")),
    _en("synthetic_token_chars", INT, 0, "synthetic engine: stretch every token to this many characters "
        "(payload-size knob); 0 = natural words"),
    _en("synthetic_script", PATH, None, "synthetic engine: a JSON script of replies ({\"match\": regex, "
        "\"reply\": [piece, ...]}) written by a scripted model under vLLM's OpenAI layer, with the --model "
        "directory's tokenizer and chat template (no weights): tool calls and reasoning through vLLM's parsers "
        "without a model (docs/models.md)"),
    _en("max_queue", INT, 1024, "requests in the engine (running + waiting) beyond which new ones get 503 "
        "engine_overloaded"),
    _en("gateway_grace", FLOAT, 10.0, "seconds the engine keeps generating the requests of a `tcp://` gateway "
        "that stopped pinging while its connection stays up (cut off) before it aborts them; a gateway whose "
        "connection drops (killed) has them aborted within a second, and an `ipc://` gateway that is silent but "
        "connected is stalled, not dead: its requests run on. A gateway that adopts such a stream continues it "
        "from its log, so this only bounds the capacity an orphan holds (docs/failures.md)", minimum=1.0),
    _en("allow_remote_engine", BOOL, False, "allow binding tcp:// to a non-loopback address"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

# What `--help` shows, in these groups: the settings a user sets. Every other setting is advanced (`--help-all`).
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "server": ("host", "port", "ssl_certfile", "ssl_keyfile", "log_level"),
    "engine": ("engine_address", "curve_dir", "backend", "model", "served_model_name", "max_model_len",
               "tensor_parallel_size"),
    "access": ("api_keys", "allowed_origins", "cors_origins"),
    "limits": ("max_concurrent", "max_tokens_cap", "default_max_tokens", "send_timeout", "stream_ttl"),
    "scale-out": ("workers", "broker_url"),
}
ADVANCED = "advanced"
GROUP_OF: dict[str, str] = {name: title for title, names in HELP_GROUPS.items() for name in names}
_RANK: dict[str, int] = {name: i for i, name in enumerate(GROUP_OF)}


def group_of(s: Setting) -> str:
    return GROUP_OF.get(s.name, ADVANCED)


def grouped(settings: Iterable[Setting]) -> list[tuple[str, list[Setting]]]:
    """``settings`` by help group, in the order of :data:`HELP_GROUPS` then advanced; empty groups left out."""
    by_group: dict[str, list[Setting]] = {title: [] for title in [*HELP_GROUPS, ADVANCED]}
    for s in settings:
        by_group[group_of(s)].append(s)
    return [(title, sorted(members, key=lambda s: _RANK.get(s.name, 0)))  # stable: advanced in table order
            for title, members in by_group.items() if members]


def for_command(command: str) -> Iterator[Setting]:
    return (s for s in SETTINGS if command in s.commands)


def declared(name: str) -> Any:
    """A dataclass field whose default is the table's: ``port: int = declared("port")``."""
    s = BY_NAME[name]
    if s.default_factory is not None:
        return dataclasses.field(default_factory=s.default_factory)
    if isinstance(s.default, list | dict | set):
        raise TypeError(f"{name}: a mutable default needs a default_factory")
    return dataclasses.field(default=s.default)


# -- argparse ----------------------------------------------------------------------------------

def _deprecated_dest(s: Setting, flag: str) -> str:
    return f"deprecated_{s.name}_{flag.lstrip('-').replace('-', '_')}"


def _shown_default(s: Setting) -> str:
    if s.doc_default:
        return s.doc_default
    return ",".join(s.raw(s.default_value()))


class _HelpAll(argparse.Action):
    """``--help-all``: ``--help`` with the advanced settings' help restored."""

    def __init__(self, option_strings: list[str], dest: str, hidden: list[tuple[argparse.Action, str]],
                 **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)
        self.hidden = hidden

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        for action, help_ in self.hidden:
            action.help = help_
        parser.print_help()
        parser.exit()


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of ``command``, by help group. Values stay raw strings (None when absent) until :func:`resolve`.

    The advanced group's flags parse like the others; ``--help`` only names how many there are.
    """
    hidden: list[tuple[argparse.Action, str]] = []
    for title, members in grouped(for_command(command)):
        advanced = title == ADVANCED
        description = (f"{len(members)} more settings (timeouts, buffers, tuning, diagnostics): `--help-all` "
                       "shows them; docs/settings.md explains every setting") if advanced else None
        group = parser.add_argument_group(title, description)
        for s in members:
            default = _shown_default(s).replace("`", "")
            help_ = (s.help + (f" (default: {default})" if default else "")).replace("%", "%%")
            kw: dict[str, Any] = {"default": None, "metavar": s.kind.metavar}
            if s.repeat:
                kw["action"] = "append"
            elif s.kind is BOOL:
                kw.update(nargs="?", const="true")
            if s.choices:
                kw.update(choices=s.choices, metavar=None)
            text = f"{help_} [{s.env_var}]"
            action = group.add_argument(s.option, *s.aliases.get(command, ()), dest=s.name,
                                        help=argparse.SUPPRESS if advanced else text, **kw)
            if advanced:
                hidden.append((action, text))
            for flag in s.deprecated.get(command, ()):
                group.add_argument(flag, dest=_deprecated_dest(s, flag), help=argparse.SUPPRESS, **kw)
    parser.add_argument("--help-all", action=_HelpAll, hidden=hidden,
                        help="show the help of every setting, the advanced ones too, and exit")


def given(ns: argparse.Namespace, command: str, environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Names of the settings of ``command`` set by a flag or the environment (not left to the default)."""
    environ = os.environ if environ is None else environ
    return frozenset(s.name for s in for_command(command) if _flag_raws(ns, s, command) or s.env_var in environ)


def _flag_raws(ns: argparse.Namespace, s: Setting, command: str) -> list[str]:
    raw = getattr(ns, s.name, None)
    raws = [] if raw is None else list(raw) if isinstance(raw, list) else [raw]
    for flag in s.deprecated.get(command, ()):
        old = getattr(ns, _deprecated_dest(s, flag), None)
        if old is not None:
            raws += old if isinstance(old, list) else [old]
    return raws


def resolve(ns: argparse.Namespace, command: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The value of every setting of ``command``: its flag, else ``TOKENFAN_<NAME>``, else the default.

    Raises :class:`SettingError` for a value that does not parse or is out of range.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in for_command(command):
        for flag in s.deprecated.get(command, ()):
            if getattr(ns, _deprecated_dest(s, flag), None) is not None:
                log.warning("`tokenfan %s %s` is deprecated: use %s", command, flag, s.option)
        raws = _flag_raws(ns, s, command)
        if raws:
            values[s.name] = s.parse(raws, s.option)
        elif s.env_var in environ:
            values[s.name] = s.parse([environ[s.env_var]], s.env_var)
        else:
            values[s.name] = s.default_value()
    return values


# -- configs -----------------------------------------------------------------------------------

def build(cls: type[T], values: Mapping[str, Any], command: str) -> T:
    """A ``cls()`` (a config dataclass) with every setting of ``command`` found in ``values`` at its field.

    A dotted field (``limits.max_tokens_cap``) replaces that attribute of the nested dataclass.
    """
    base = cls()
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for s in for_command(command):
        if s.name in values:
            head, _, rest = s.path.partition(".")
            if rest:
                nested.setdefault(head, {})[rest] = values[s.name]
            else:
                top[head] = values[s.name]
    for head, sub in nested.items():
        top[head] = dataclasses.replace(getattr(base, head), **sub)
    return dataclasses.replace(base, **top)  # type: ignore[type-var]


def read(config: Any, s: Setting) -> Any:
    for part in s.path.split("."):
        config = getattr(config, part)
    return config


def to_argv(config: Any, command: str) -> list[str]:
    """The flags that make ``command`` rebuild ``config`` (for ``tokenfan serve``'s engine child)."""
    argv: list[str] = []
    for s in for_command(command):
        for raw in s.raw(read(config, s)):
            argv += [s.option, raw]
    return argv


# -- documentation -----------------------------------------------------------------------------

TABLE_START, TABLE_END = "<!-- flags:start -->", "<!-- flags:end -->"
SETTINGS_DOC = "docs/settings.md"  # the page that holds the table (relative to the repository)


def _flag_cell(s: Setting) -> str:
    where: dict[str, list[str]] = {}  # alias -> the commands that take it
    for table, note in ((s.aliases, ""), (s.deprecated, ", deprecated")):
        for command, flags in table.items():
            for flag in flags:
                where.setdefault(f"`{flag}`", []).append(command + note)
    return ", ".join([f"`{s.option}`", *(f"{flag} ({', '.join(cs)})" for flag, cs in where.items())])


def markdown() -> str:
    """The reference tables of docs/settings.md: one per help group, the advanced settings last."""
    out: list[str] = []
    for title, members in grouped(SETTINGS):
        heading = "advanced (`--help-all`)" if title == ADVANCED else title
        out += [f"## {heading}", "", "| flag | environment | type | default | commands | meaning |",
                "|---|---|---|---|---|---|"]
        for s in members:
            kind = " \\| ".join(f"`{c}`" for c in s.choices) if s.choices else s.kind.name + (
                " list" if s.repeat else "")
            default = _shown_default(s)
            default = default if s.doc_default or not default else f"`{default}`"
            commands = ", ".join(c for c in COMMANDS if c in s.commands)
            out.append(f"| {_flag_cell(s)} | `{s.env_var}` | {kind} | {default} | {commands} | "
                       f"{s.help.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out).rstrip()


def replace_table(text: str) -> str:
    """``text`` (a Markdown page) with the block between :data:`TABLE_START` and :data:`TABLE_END` regenerated."""
    head, start, rest = text.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not (start and end):
        raise ValueError(f"no {TABLE_START} ... {TABLE_END} block")
    return f"{head}{TABLE_START}\n{markdown()}\n{TABLE_END}{tail}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tokenfan_settings",
                                 description=f"Print or update the settings reference ({SETTINGS_DOC}).")
    ap.add_argument("--markdown", action="store_true", help="print the tables")
    ap.add_argument("--write", type=Path, metavar="PAGE", help=f"replace the tables in this page ({SETTINGS_DOC})")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.write:
        ns.write.write_text(replace_table(ns.write.read_text()))
    if ns.markdown or not ns.write:
        print(markdown())
    return 0
