"""The engine worker freezes its startup heap once its backend started (as ``vllm serve``'s API server does),
so a full collection while serving does not scan the loaded engine, and unfreezes it before the backend's
shutdown, whose own collection must reach the backend's objects (docs/vs-vllm.md, 2026-11-29)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from pathlib import Path
from typing import Any

import pytest

import engine_worker.__main__ as main
from engine_worker.config import EngineConfig
from engine_worker.server import EngineServer


def test_the_startup_heap_is_frozen_while_serving_and_unfrozen_for_the_shutdown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = dataclasses.replace(EngineConfig(), backend="synthetic", engine_address=f"ipc://{tmp_path}/e.sock")
    seen: dict[str, Any] = {}
    built = main.build_backend

    def build(cfg: EngineConfig) -> Any:
        backend = built(cfg)
        shutdown = backend.shutdown

        async def recorded_shutdown() -> None:
            seen["frozen at shutdown"] = gc.get_freeze_count()
            await shutdown()

        backend.shutdown = recorded_shutdown  # type: ignore[method-assign]
        seen["backend"] = backend
        return backend

    async def serve(self: EngineServer, stop: asyncio.Event) -> None:
        seen["frozen while serving"] = gc.get_freeze_count()
        seen["backend frozen"] = not any(o is seen["backend"] for o in gc.get_objects())

    monkeypatch.setattr(main, "sweep_stale", lambda _runtime: None)  # not this machine's runtime directory
    monkeypatch.setattr(main, "build_backend", build)
    monkeypatch.setattr(EngineServer, "serve", serve)
    gc.unfreeze()
    try:
        asyncio.run(main.run_engine(config))
    finally:
        gc.unfreeze()
    assert seen["frozen while serving"] > 0
    assert seen["backend frozen"]  # gc.get_objects() lists what collections scan: not the frozen backend
    assert seen["frozen at shutdown"] == 0
