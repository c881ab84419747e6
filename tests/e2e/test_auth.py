"""API keys, stream-scoped tokens for EventSource, WebSocket Origin checks, CORS."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import websockets

from tests.procs import start_gateway

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def secured(synthetic_engine: str) -> Iterator[str]:
    proc, url = start_gateway(synthetic_engine, "--api-key", KEY, "--allowed-origins", "https://app.example",
                              "--cors-origins", "https://app.example", "--stream-token-ttl", "60",
                              name="gateway-auth")
    yield url
    proc.stop()


def test_requests_without_a_valid_key_get_401_in_openai_shape(secured: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(secured + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured + "/v1", api_key="wrong").models.list()
    assert openai.OpenAI(base_url=secured + "/v1", api_key=KEY).models.list().data[0].id == "synthetic"
    assert httpx.get(secured + "/health").status_code == 200  # probes stay open


def test_stream_urls_carry_a_token_scoped_to_that_stream(secured: str) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    a = httpx.post(secured + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 3},
                   headers=h).json()
    b = httpx.post(secured + "/v1/streams", json={"endpoint": "completions", "prompt": "y", "max_tokens": 3},
                   headers=h).json()
    assert "token=" in a["events_url"] and "token=" in a["ws_url"]
    assert httpx.get(a["events_url"]).status_code == 200  # no header: the token is enough
    token_a = a["events_url"].split("token=")[1]
    stolen = f"{secured}/v1/streams/{b['id']}/events?token={token_a}"
    assert httpx.get(stolen).status_code == 401  # a token opens only its own stream
    assert httpx.get(f"{secured}/v1/streams/{a['id']}/events?token=1.forged").status_code == 401

    async def ws_ok() -> str:
        async with websockets.connect(a["ws_url"]) as ws:
            return json.loads(await ws.recv())["type"]

    assert asyncio.run(ws_ok()) == "chunk"


def test_websocket_key_and_origin_checks(secured: str) -> None:
    base = secured.replace("http", "ws")

    async def attempt(url: str, origin: str | None) -> str:
        try:
            async with websockets.connect(url, origin=origin) as ws:  # type: ignore[arg-type]
                try:
                    await ws.send(json.dumps({"type": "request", "id": "1", "body": {
                        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}}))
                except websockets.ConnectionClosed:
                    pass  # already refused: the reason is still in the receive buffer
                msg = json.loads(await ws.recv())
                if msg["type"] == "error":
                    await ws.wait_closed()
                    return f"{msg['error']['code']} {ws.close_code}"
                return str(msg["type"])
        except websockets.InvalidStatus as exc:
            return f"refused {exc.response.status_code}"
        except websockets.ConnectionClosedError as exc:
            return f"closed {exc.rcvd.code if exc.rcvd else None}"

    assert asyncio.run(attempt(base + "/v1/ws", None)) == "missing_api_key 4401"
    assert asyncio.run(attempt(base + "/v1/ws?api_key=nope", None)) == "invalid_api_key 4401"
    assert asyncio.run(attempt(base + f"/v1/ws?api_key={KEY}", None)) == "chunk"
    assert asyncio.run(attempt(base + f"/v1/ws?api_key={KEY}", "https://evil.example")) == "refused 403"
    assert asyncio.run(attempt(base + f"/v1/ws?api_key={KEY}", "https://app.example")) == "chunk"


def test_cors_preflight_allows_only_configured_origins(secured: str) -> None:
    ok = httpx.options(secured + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    bad = httpx.options(secured + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in bad.headers
