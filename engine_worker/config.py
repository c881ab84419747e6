"""Engine worker settings: one dataclass, parsed once from CLI flags with environment fallbacks.

Every flag ``--foo-bar`` has the environment equivalent ``TOKENFAN_FOO_BAR``; the flag wins.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def env(name: str, default: Any, cast: type = str) -> Any:
    """``TOKENFAN_<NAME>`` from the environment, cast like the default, else the default."""
    raw = os.environ.get("TOKENFAN_" + name.upper().replace("-", "_"))
    if raw is None:
        return default
    if cast is bool:
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    return cast(raw)


def default_runtime_dir() -> Path:
    """A per-user directory for IPC sockets: ``$XDG_RUNTIME_DIR/tokenfan`` or ``/tmp/tokenfan-<uid>``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "tokenfan" if base else Path(f"/tmp/tokenfan-{os.getuid()}")


def default_engine_address() -> str:
    return f"ipc://{default_runtime_dir() / 'engine.sock'}"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenfan"


@dataclass(slots=True)
class EngineConfig:
    backend: str = "vllm"  # "vllm" | "synthetic"
    address: str = field(default_factory=default_engine_address)
    model: str | None = None  # local HF directory; None = the default model (prepared into cache_dir)
    cache_dir: Path = field(default_factory=default_cache_dir)
    max_model_len: int = 2048
    dtype: str = "auto"
    kv_cache_gib: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.9
    chat_template: str | None = None  # path to a Jinja template overriding the tokenizer's
    # synthetic backend
    synthetic_ttft_ms: float = 20.0
    synthetic_tokens_per_s: float = 50.0
    synthetic_token_chars: int = 0  # 0: natural words; N: every token stretched to N characters
    # engine server
    max_queue: int = 1024  # requests waiting beyond this are rejected with engine_overloaded
    allow_remote_tcp: bool = False
    curve_dir: Path | None = None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by ``tokenfan engine`` and ``tokenfan serve``."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--engine", "--backend", dest="backend", choices=["vllm", "synthetic"],
                   default=env("engine", d.backend), help="engine backend [TOKENFAN_ENGINE]")
    g.add_argument("--model", default=env("model", None),
                   help="local Hugging Face model directory (default: Gemma 3 270M, prepared once) [TOKENFAN_MODEL]")
    g.add_argument("--cache-dir", type=Path, default=env("cache_dir", d.cache_dir, Path),
                   help="where the default model is prepared [TOKENFAN_CACHE_DIR]")
    g.add_argument("--max-model-len", type=int, default=env("max_model_len", d.max_model_len, int),
                   help="context length (prompt + output tokens) [TOKENFAN_MAX_MODEL_LEN]")
    g.add_argument("--dtype", default=env("dtype", d.dtype), help="vLLM dtype [TOKENFAN_DTYPE]")
    g.add_argument("--kv-cache-gib", type=int, default=env("kv_cache_gib", d.kv_cache_gib, int),
                   help="CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE) [TOKENFAN_KV_CACHE_GIB]")
    g.add_argument("--tensor-parallel-size", type=int, default=env("tensor_parallel_size", 1, int),
                   help="vLLM tensor parallelism (GPUs per engine) [TOKENFAN_TENSOR_PARALLEL_SIZE]")
    g.add_argument("--pipeline-parallel-size", type=int, default=env("pipeline_parallel_size", 1, int),
                   help="vLLM pipeline parallelism [TOKENFAN_PIPELINE_PARALLEL_SIZE]")
    g.add_argument("--enforce-eager", type=_bool, default=env("enforce_eager", d.enforce_eager, bool),
                   help="disable CUDA graphs / torch.compile [TOKENFAN_ENFORCE_EAGER]")
    g.add_argument("--gpu-memory-utilization", type=float,
                   default=env("gpu_memory_utilization", d.gpu_memory_utilization, float),
                   help="vLLM GPU memory fraction [TOKENFAN_GPU_MEMORY_UTILIZATION]")
    g.add_argument("--chat-template", default=env("chat_template", None),
                   help="Jinja chat template file overriding the tokenizer's [TOKENFAN_CHAT_TEMPLATE]")
    g.add_argument("--synthetic-ttft-ms", type=float, default=env("synthetic_ttft_ms", d.synthetic_ttft_ms, float),
                   help="synthetic engine: time to first token [TOKENFAN_SYNTHETIC_TTFT_MS]")
    g.add_argument("--synthetic-tokens-per-s", type=float,
                   default=env("synthetic_tokens_per_s", d.synthetic_tokens_per_s, float),
                   help="synthetic engine: tokens per second per stream [TOKENFAN_SYNTHETIC_TOKENS_PER_S]")
    g.add_argument("--synthetic-token-chars", type=int, default=env("synthetic_token_chars", 0, int),
                   help="synthetic engine: stretch every token to this many characters (payload-size knob) "
                        "[TOKENFAN_SYNTHETIC_TOKEN_CHARS]")
    g.add_argument("--max-queue", type=int, default=env("max_queue", d.max_queue, int),
                   help="requests in the engine (running + waiting) beyond which new ones get 503 "
                        "engine_overloaded [TOKENFAN_MAX_QUEUE]")


def engine_config_from_args(ns: argparse.Namespace, address: str) -> EngineConfig:
    return EngineConfig(
        backend=ns.backend, address=address, model=ns.model, cache_dir=ns.cache_dir,
        max_model_len=ns.max_model_len, dtype=ns.dtype, kv_cache_gib=ns.kv_cache_gib,
        tensor_parallel_size=ns.tensor_parallel_size, pipeline_parallel_size=ns.pipeline_parallel_size,
        enforce_eager=ns.enforce_eager, gpu_memory_utilization=ns.gpu_memory_utilization,
        chat_template=ns.chat_template, synthetic_ttft_ms=ns.synthetic_ttft_ms,
        synthetic_tokens_per_s=ns.synthetic_tokens_per_s, synthetic_token_chars=ns.synthetic_token_chars,
        max_queue=ns.max_queue,
    )


def _bool(raw: str) -> bool:
    return raw.strip().lower() in {"1", "true", "yes", "on"}
