"""The ASGI server under the gateway: start it, and on SIGTERM/SIGINT drain before stopping."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.config import GatewayConfig


def run_gateway(config: GatewayConfig, extra_lifespan: Any = None) -> None:
    """Serve the gateway app until SIGTERM/SIGINT, then drain (see :class:`GracefulServer`)."""
    import uvicorn

    from gateway.app import create_app

    app = create_app(config, extra_lifespan=extra_lifespan)  # RawSend is part of the app

    class GracefulServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop accepting, let streams finish for ``--shutdown-grace`` seconds, then
        end the rest with an explicit ``server_shutdown`` error (never a silent cut, never a hang)."""

        async def shutdown(self, sockets: Any = None) -> None:
            gw = getattr(app.state, "gateway", None)
            if gw is not None:
                gw.draining = True  # new generations get 503 from here on
                for server in self.servers:
                    server.close()  # stop accepting; open connections (SSE and WS) carry on
                deadline = asyncio.get_running_loop().time() + config.shutdown_grace
                while gw.in_flight() and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.05)
                gw.end_all_streams()
                await asyncio.sleep(0.2)  # let the error events reach the clients
            await super().shutdown(sockets)

    GracefulServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        ws_max_size=config.ws_max_message_bytes, ws_per_message_deflate=config.ws_per_message_deflate,
        ws_ping_interval=config.keepalive_interval, ws_ping_timeout=config.keepalive_interval * 2,
        timeout_graceful_shutdown=config.shutdown_grace + 2.0,
        access_log=False,  # tokenfan.access writes one JSON line per request instead
    )).run()
