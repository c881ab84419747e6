"""The gateway freezes its start-up heap once its app is ready (as the engine worker and ``vllm serve``'s API
server do), so a full collection while streams are live does not scan the app, its modules and its engine
links; the shutdown unfreezes it."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

from starlette.testclient import TestClient

from gateway.config import GatewayConfig
from gateway.http.app import create_app


def test_the_gateways_startup_heap_is_frozen_while_it_serves_and_unfrozen_after(tmp_path: Path) -> None:
    # no engine behind the address: the lifespan waits for it a bounded moment, then serves (503s)
    config = dataclasses.replace(GatewayConfig(), engine_address=f"ipc://{tmp_path}/none.sock")
    gc.unfreeze()
    try:
        app = create_app(config)
        with TestClient(app) as client:
            frozen = gc.get_freeze_count()
            scanned = any(o is app for o in gc.get_objects())  # what collections scan: not the frozen app
            assert client.get("/v1/time").status_code == 200
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert frozen > 10_000, frozen  # the app and everything imported for it
    assert not scanned
    assert after == 0
