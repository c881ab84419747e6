"""Bad bytes against a real gateway: every POST endpoint and ``/v1/ws`` answer invalid UTF-8 and
pathological nesting with 400 ``invalid_json`` in the OpenAI error shape, never a 500, and keep serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

PREFIX = b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "zz": '
BAD = {
    "invalid UTF-8": b'{"prompt": "a\xff\xfeb", "messages": [{"role": "user", "content": "\xc0\xaf"}]}',
    "encoded surrogate": b'{"prompt": "\xed\xa0\x80", "input": "\xed\xa0\x80"}',
    "lone surrogate escape": b'{"prompt": "\\ud800", "input": "\\ud800"}',
    "nested 100,000 deep": PREFIX + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "objects nested 100,000 deep": PREFIX + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}",
    "nested 1,000 deep": PREFIX + b"[" * 1000 + b"]" * 1000 + b"}",  # past msgspec's recursion limit
    "nested 300 deep": PREFIX + b"[" * 300 + b"]" * 300 + b"}",  # past orjson.dumps' limit
}
POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/streams", "/v1/responses"]

def case(transport: str, name: str, *values: str) -> object:
    """A test case for ``name`` sent on ``transport``."""
    return pytest.param(*values)


def assert_invalid_json(status: int, body: dict, context: object) -> None:
    assert status == 400, context
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, context
    assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error", context


@pytest.mark.parametrize("path,name", [case(path, name, path, name) for path in POST_PATHS for name in BAD])
def test_every_post_endpoint_answers_bad_bytes_with_400_invalid_json(gateway_url: str, path: str, name: str) -> None:
    with httpx.Client(base_url=gateway_url, timeout=30) as c:
        r = c.post(path, content=BAD[name], headers={"Content-Type": "application/json"})
        assert_invalid_json(r.status_code, r.json(), r.text[:300])
        assert c.get("/health").status_code == 200


WS_REQUEST = b'{"type": "request", "id": "r", "endpoint": "completions", "body": '
WS_CASES = {
    "invalid UTF-8 in the message": b'{"type": "request", "id": "\xff", "body": {}}',
    "message nested 100,000 deep": b'{"type": "request", "id": "d", "zz": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    **{f"body: {name}": WS_REQUEST + raw + b"}" for name, raw in BAD.items()},
}


@pytest.mark.parametrize("name", [*list(WS_CASES)[:2], *(case("ws", name, f"body: {name}") for name in BAD)])
def test_ws_message_with_bad_bytes_gets_an_invalid_json_error_and_the_socket_stays_open(
        gateway_url: str, name: str) -> None:
    raw = WS_CASES[name]

    async def main() -> None:
        async with websockets.connect(gateway_url.replace("http", "ws") + "/v1/ws", max_size=None) as ws:
            try:
                await ws.send(raw.decode())  # a text frame when it can be one
            except UnicodeDecodeError:
                await ws.send(raw)  # invalid UTF-8 in a binary frame (the protocol closes a text frame with 1007)
            try:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
            except (TimeoutError, websockets.ConnectionClosed) as exc:
                pytest.fail(f"no error message ({exc!r})")
            assert msg["type"] == "error", msg
            assert_invalid_json(400, {"error": msg["error"]}, msg)
            await ws.send(json.dumps({"type": "request", "id": "ok", "endpoint": "completions",
                                      "body": {"prompt": "x", "max_tokens": 2}}))
            while (msg := json.loads(await asyncio.wait_for(ws.recv(), 10)))["type"] == "chunk":
                pass
            assert msg == {"type": "done", "id": "ok"}

    asyncio.run(main())
