"""The Vercel AI SDK's UI message stream protocol: ``useChat`` with ``DefaultChatTransport`` talks to tokenfan.

A third API peer of chat completions and the Responses API on the delivery core (docs/ai-sdk.md); one job
per module:

  convert.py   the transport's POST body (UI messages + chat settings) -> a chat completions body
  render.py    engine deltas (plain text, or vLLM's layer's chat chunks) -> UI message parts
  framing.py   the parts on the wire: SSE ``data:`` frames, ``[DONE]``, the endings, the merge rules
  chats.py     chat id -> the stream running its answer (here; in Redis with ``--broker``)
  routes.py    ``POST /api/chat``, ``GET`` / ``DELETE /api/chat/{id}/stream``

Protocol read from ``ai`` 7.0.173 and ``@ai-sdk/react`` 4.0.177 (npm), the versions the tests pin.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from gateway.api.ui_chat.routes import UiChatRoutes


def mount(prefix: str = "/api/chat") -> list[Any]:
    """The routes at the SDK's default ``api`` (``prefix``), sharing one chat index."""
    chat = UiChatRoutes()
    return [Route(prefix, chat.post, methods=["POST"]),
            Route(prefix + "/{id:path}/stream", chat.resume, methods=["GET"]),
            Route(prefix + "/{id:path}/stream", chat.cancel, methods=["DELETE"])]
