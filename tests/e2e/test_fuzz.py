"""Property-based fuzzing (hypothesis) of every input surface: HTTP JSON bodies, WebSocket messages and
raw ZeroMQ frames sent straight to the engine socket. Never a 500, never a crash or a hang; always an
OpenAI-shaped error; bad frames dropped and counted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import websockets
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine_worker import protocol as p
from tests.procs import engine_and_gateway

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "presence_penalty", "frequency_penalty", "ignore_eos", "n", "stream", "stream_options",
          "logprobs", "tools", "endpoint"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bogus"]),
                                 "content": st.one_of(st.text(max_size=40), json_values)})
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=3)},
                          optional={k: json_values for k in ["max_tokens", "temperature", "stop", "stream", "n"]}),
)


@pytest.fixture(scope="module")
def fast_gateway(ipc_dir: Path) -> Iterator[str]:
    """A gateway whose engine generates at 100,000 tokens/s: an accepted body (256 tokens by default) costs a
    few milliseconds, so the examples' time goes to the bodies, not to generating the valid ones."""
    with engine_and_gateway(f"ipc://{ipc_dir / 'fuzz.sock'}", ("--engine", "synthetic", "--synthetic-ttft-ms", "0",
                            "--synthetic-tokens-per-s", "100000"), name="fuzz") as url:
        yield url


def assert_openai_error_or_ok(r: httpx.Response) -> None:
    assert r.status_code < 500 or r.status_code == 503, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/streams"])
def test_http_bodies_never_cause_a_500(fast_gateway: str, path: str) -> None:
    client = httpx.Client(base_url=fast_gateway, timeout=10)

    @FUZZ
    @given(body=bodies)
    # found by this test: a forwarded body's `seed` reached the synthetic engine's corpus offset unchecked (500)
    @example(body={"model": None, "seed": [], "messages": None, "tools": None})
    @example(body={"stop": [1], "tools": None, "messages": []})
    @example(body={"messages": {"": None}, "tools": None})  # a forwarded dict of messages: the synthetic engine's 500
    @example(body={"prompt": [], "tools": None, "messages": []})
    def check(body: object) -> None:
        if isinstance(body, dict) and body.get("stream") is True:
            body["max_tokens"] = 2  # keep accepted streams short
        r = client.post(path, content=json.dumps(body))
        assert_openai_error_or_ok(r)

    check()
    client.post(path, content=b"\xff\xfe garbage")
    assert client.get("/health").status_code == 200


def test_websocket_messages_never_break_the_socket(fast_gateway: str) -> None:
    url = fast_gateway.replace("http", "ws") + "/v1/ws"

    @FUZZ
    @given(msgs=st.lists(st.one_of(
        st.text(max_size=60),
        json_values.map(json.dumps),
        st.fixed_dictionaries({"type": st.sampled_from(["request", "cancel", "x"]),
                               "id": st.one_of(st.text(max_size=8), json_values),
                               "endpoint": st.sampled_from(["chat.completions", "completions", "nope"]),
                               "body": bodies}).map(json.dumps)), min_size=1, max_size=4))
    def check(msgs: list[str]) -> None:
        async def run() -> None:
            async with websockets.connect(url) as ws:
                for m in msgs:
                    await ws.send(m)
                await ws.send(json.dumps({"type": "request", "id": "__probe__", "body": {
                    "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}}))
                while True:  # the socket still answers after whatever came before
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
                    if msg["type"] == "error":
                        assert set(msg["error"]) == {"message", "type", "param", "code"}
                    if msg.get("id") == "__probe__" and msg["type"] in ("done", "error"):
                        return

        asyncio.run(run())

    check()


def test_raw_engine_frames_are_dropped_counted_and_the_engine_survives(synthetic_engine: str,
                                                                       gateway_url: str) -> None:
    from tests.e2e.helpers import metric, wait_until

    before = metric(gateway_url, "tokenfan_engine_bad_frames")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(synthetic_engine)
    frame = st.one_of(st.binary(max_size=64), st.just(p.MAGIC),
                      json_values.map(lambda v: msgspec.msgpack.encode(v)),
                      st.lists(json_values, max_size=6).map(
                          lambda v: msgspec.msgpack.encode([st_tag for st_tag in ["submit"]] + v)))

    @FUZZ
    @given(frames=st.lists(frame, min_size=1, max_size=3))
    def check(frames: list[bytes]) -> None:
        sock.send_multipart(frames)

    try:
        check()
        sock.send_multipart(p.encode(p.Ping(sent_ns=7)))
        while True:
            msg = p.decode(sock.recv_multipart())
            if isinstance(msg, p.Heartbeat) and msg.ping_sent_ns == 7:
                assert msg.bad_frames > 0
                break
        wait_until(lambda: metric(gateway_url, "tokenfan_engine_bad_frames") > before, what="bad frames counted")
    finally:
        sock.close()
        ctx.term()
