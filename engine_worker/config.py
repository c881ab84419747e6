"""Engine worker settings: the :class:`EngineConfig` dataclass, filled from the table in
:mod:`tokenfan_settings` (flags, ``TOKENFAN_*`` environment fallbacks and defaults are declared there)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfan_settings import (  # noqa: F401  (re-exported: the defaults lived here)
    add_arguments,
    build,
    declared,
    default_cache_dir,
    default_engine_address,
    default_runtime_dir,
    to_argv,
)


@dataclass(slots=True)
class EngineConfig:
    backend: str = declared("backend")  # "vllm" | "synthetic"
    engine_address: str = declared("engine_address")  # the address the engine binds
    model: str | None = declared("model")  # local HF directory; None = the default model (prepared into cache_dir)
    served_model_name: str | None = declared("served_model_name")  # vLLM's name for the model (default: its dir)
    cache_dir: Path = declared("cache_dir")
    max_model_len: int = declared("max_model_len")
    dtype: str = declared("dtype")
    kv_cache_gib: int = declared("kv_cache_gib")
    tensor_parallel_size: int = declared("tensor_parallel_size")
    pipeline_parallel_size: int = declared("pipeline_parallel_size")
    enforce_eager: bool = declared("enforce_eager")
    gpu_memory_utilization: float = declared("gpu_memory_utilization")
    chat_template: str | None = declared("chat_template")  # path to a Jinja template overriding the tokenizer's
    # vLLM's OpenAI layer (engine_worker.backends.vllm_openai): the flags of vllm serve, same names and meaning
    enable_auto_tool_choice: bool = declared("enable_auto_tool_choice")
    tool_call_parser: str | None = declared("tool_call_parser")
    tool_parser_plugin: str | None = declared("tool_parser_plugin")
    reasoning_parser: str | None = declared("reasoning_parser")
    structured_outputs_config: str | None = declared("structured_outputs_config")  # JSON object
    stream_interval: int = declared("stream_interval")  # tokens per delta event
    cpu_placement: str = declared("cpu_placement")  # vLLM on CPU: see engine_worker.backends.vllm.cpu_placement
    # synthetic backend
    synthetic_ttft_ms: float = declared("synthetic_ttft_ms")
    synthetic_tokens_per_s: float = declared("synthetic_tokens_per_s")
    synthetic_steps: str = declared("synthetic_steps")  # "per-stream" or "shared" (one step clock)
    synthetic_script: Path | None = declared("synthetic_script")
    synthetic_token_chars: int = declared("synthetic_token_chars")  # 0: natural words; N: tokens of N characters
    # engine server
    gateway_grace: float = declared("gateway_grace")  # a silent gateway's requests are aborted after this
    max_queue: int = declared("max_queue")  # requests waiting beyond this are rejected with engine_overloaded
    allow_remote_engine: bool = declared("allow_remote_engine")
    curve_dir: Path | None = declared("curve_dir")
    log_level: str = declared("log_level")
    otlp_traces_endpoint: str | None = declared("otlp_traces_endpoint")  # OpenTelemetry traces (OTLP/HTTP)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tokenfan engine`` (``tokenfan serve`` takes them too)."""
    add_arguments(parser, "engine")


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """An EngineConfig from :func:`tokenfan_settings.resolve` values (of ``engine`` or ``serve``)."""
    return build(EngineConfig, values, "engine")


def engine_argv(config: EngineConfig) -> list[str]:
    """The ``python -m engine_worker`` arguments that rebuild ``config``."""
    return to_argv(config, "engine")
