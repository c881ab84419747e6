"""tokenfan gateway: fans engine token deltas out over SSE and WebSocket (Starlette)."""
