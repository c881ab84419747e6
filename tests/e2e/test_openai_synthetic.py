"""The OpenAI-compatible API end to end: official openai SDK, httpx and websockets clients
against a real gateway process attached over ZeroMQ IPC to a real (synthetic) engine process."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import websockets

from tests.e2e.helpers import chunk_text, engine_load, metric, sse_events, wait_until


@pytest.fixture()
def client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused")


def test_sdk_streams_a_chat_completion_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "hello"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_sdk_streams_a_completion_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="synthetic", prompt="Once", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage.completion_tokens == 5  # type: ignore[union-attr]


def test_non_streaming_matches_streaming_text(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=8, seed=7)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "x"}], max_tokens=8, seed=7, stream=True)
        if c.choices)
    assert full.choices[0].message.content == streamed
    assert full.usage is not None and full.usage.completion_tokens == 8


def test_stop_string_ends_generation(client: openai.OpenAI) -> None:
    base = client.completions.create(model="synthetic", prompt="p", max_tokens=20, seed=1).choices[0].text
    word = base.split()[3]
    cut = client.completions.create(model="synthetic", prompt="p", max_tokens=20, seed=1, stop=[word]).choices[0]
    assert cut.finish_reason == "stop" and word not in cut.text and base.startswith(cut.text)


def test_websocket_multiplexes_and_carries_the_same_chunks(gateway_url: str, client: openai.OpenAI) -> None:
    body = {"messages": [{"role": "user", "content": "same"}], "max_tokens": 6, "seed": 3}
    sse_text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="synthetic", stream=True, **body) if c.choices)  # type: ignore[arg-type]

    async def run() -> dict[str, list[dict]]:
        got: dict[str, list[dict]] = {"a": [], "b": []}
        async with websockets.connect(gateway_url.replace("http", "ws") + "/v1/ws") as ws:
            for cid in ("a", "b"):
                await ws.send(json.dumps({"type": "request", "id": cid, "endpoint": "chat.completions", "body": body}))
            done = set()
            while len(done) < 2:
                msg = json.loads(await ws.recv())
                if msg["type"] == "chunk":
                    got[msg["id"]].append(msg["data"])
                elif msg["type"] == "done":
                    done.add(msg["id"])
                else:
                    raise AssertionError(msg)
        return got

    got = asyncio.run(run())
    for cid in ("a", "b"):
        assert got[cid][0]["object"] == "chat.completion.chunk"
        assert got[cid][0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(chunk_text(c) for c in got[cid]) == sse_text
        assert got[cid][-1]["choices"][0]["finish_reason"] == "length"


def test_tokenfan_timing_adds_the_timing_object_to_post_sse_and_ws_chunks_only_when_asked(gateway_url: str) -> None:
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "timed"}], "max_tokens": 4, "seed": 5,
            "stream": True}

    def post(query: str) -> list[dict]:
        r = httpx.post(gateway_url + "/v1/chat/completions" + query, json=body, timeout=30)
        assert r.status_code == 200
        return [json.loads(e["data"]) for e in sse_events(r.text) if e["data"] != "[DONE]"]

    async def ws(query: str) -> list[dict]:
        async with websockets.connect(gateway_url.replace("http", "ws") + "/v1/ws" + query) as conn:
            await conn.send(json.dumps({"type": "request", "id": "t", "body": body}))
            got = []
            while (msg := json.loads(await conn.recv()))["type"] == "chunk":
                got.append(msg["data"])
            assert msg["type"] == "done", msg
            return got

    for timed, plain in ((post("?tokenfan_timing=1"), post("")),
                         (asyncio.run(ws("?tokenfan_timing=1")), asyncio.run(ws("")))):
        assert timed and plain and not any("tokenfan" in c for c in plain)
        assert [c["tokenfan"]["seq"] for c in timed] == list(range(len(timed)))
        assert all(c["tokenfan"]["emit_ns"] > 0 and c["tokenfan"]["sent_ns"] >= c["tokenfan"]["emit_ns"]
                   for c in timed)
        # the chunks themselves are unchanged: the timing object is one key more
        assert all(set(c) - {"tokenfan"} == set(plain[0]) for c in timed)
        assert "".join(map(chunk_text, timed)) == "".join(map(chunk_text, plain))


def test_websocket_bad_messages_get_errors_and_the_socket_survives(gateway_url: str) -> None:
    async def run() -> list[dict]:
        out = []
        async with websockets.connect(gateway_url.replace("http", "ws") + "/v1/ws") as ws:
            for raw in ["not json", "[1]", json.dumps({"type": "request", "id": "x", "body": {"messages": []}}),
                        json.dumps({"type": "cancel", "id": "nope"}),
                        json.dumps({"type": "request", "id": "ok", "body": {"messages": [{"role": "user", "content": "x"}],
                                                                            "max_tokens": 2}})]:
                await ws.send(raw)
            while True:
                msg = json.loads(await ws.recv())
                out.append(msg)
                if msg["type"] == "done":
                    return out

    msgs = asyncio.run(run())
    errors = [m for m in msgs if m["type"] == "error"]
    assert len(errors) == 4
    assert all(set(e["error"]) == {"message", "type", "param", "code"} for e in errors)
    assert msgs[-1] == {"type": "done", "id": "ok"}


def test_websocket_cancel_aborts_in_the_engine(gateway_url: str) -> None:
    before = metric(gateway_url, "tokenfan_requests_aborted_total")

    async def run() -> dict:
        async with websockets.connect(gateway_url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "request", "id": "c", "body": {
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 1500}}))
            for _ in range(3):
                assert json.loads(await ws.recv())["type"] == "chunk"
            await ws.send(json.dumps({"type": "cancel", "id": "c"}))
            while True:
                msg = json.loads(await ws.recv())
                if msg["type"] != "chunk":
                    return msg

    assert asyncio.run(run()) == {"type": "done", "id": "c", "cancelled": True}
    wait_until(lambda: metric(gateway_url, "tokenfan_requests_aborted_total") > before, what="abort counted")
    wait_until(lambda: engine_load(gateway_url) == (0, 0), what="engine idle")


def test_every_websocket_request_cancelled_at_any_point_ends_with_one_done(gateway_url: str) -> None:
    """Requests cancelled while running, while queued, and the instant they start (before their task first
    ran, as when a cancelled request frees the slot of a queued one): each gets exactly one final message."""
    n = 120  # beyond --ws-max-in-flight + --ws-max-queued (32 + 64 by default): some are refused

    async def run() -> dict[str, list[dict]]:
        finals: dict[str, list[dict]] = {}
        async with websockets.connect(gateway_url.replace("http", "ws") + "/v1/ws", max_queue=None) as ws:
            for i in range(n):
                await ws.send(json.dumps({"type": "request", "id": str(i), "body": {
                    "messages": [{"role": "user", "content": "x"}], "max_tokens": 1500}}))
            for i in range(n):
                await ws.send(json.dumps({"type": "cancel", "id": str(i)}))
            while sum(1 for v in finals.values() if v) < n:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if msg["type"] == "error" and msg["error"]["code"] == "not_found":
                    continue  # the cancel of a request that was refused
                if msg["type"] != "chunk":
                    finals.setdefault(msg["id"], []).append(msg)
        return finals

    finals = asyncio.run(run())
    assert sorted(finals, key=int) == [str(i) for i in range(n)]
    assert all(len(v) == 1 for v in finals.values()), {k: v for k, v in finals.items() if len(v) != 1}
    done = [k for k, (m,) in finals.items() if m["type"] == "done"]
    assert all(finals[k][0] == {"type": "done", "id": k, "cancelled": True} for k in done), \
        [finals[k] for k in done if finals[k][0] != {"type": "done", "id": k, "cancelled": True}]
    assert len(done) >= 32 + 64 and {m["error"]["code"] for (m,) in finals.values() if m["type"] == "error"} \
        <= {"connection_queue_limit"}
    wait_until(lambda: engine_load(gateway_url) == (0, 0), what="engine idle")


def test_sse_client_that_leaves_aborts_the_generation(gateway_url: str) -> None:
    before = metric(gateway_url, "tokenfan_requests_aborted_total")
    with httpx.stream("POST", gateway_url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 1500, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        next(lines)
        wait_until(lambda: engine_load(gateway_url)[0] >= 1, what="engine running the request")
    wait_until(lambda: metric(gateway_url, "tokenfan_requests_aborted_total") > before, what="abort counted")
    wait_until(lambda: engine_load(gateway_url) == (0, 0), what="engine idle")


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b'{"messages": "x"}', 400, "messages"),
    ("/v1/chat/completions", b"{", 400, None),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"x"}],"n":2}', 400, "n"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"x"}],"model":"gpt-4"}', 404, "model"),
    ("/v1/completions", b'{"prompt":"x","max_tokens":100000}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt":"' + b"w " * 3000 + b'"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt":"' + b"x" * (2 << 20) + b'"}', 413, None),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(
        gateway_url: str, path: str, body: bytes, status: int, param: str | None) -> None:
    r = httpx.post(gateway_url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert httpx.get(gateway_url + "/health").status_code == 200


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="synthetic", messages=[], max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_errors_are_counted_by_class(gateway_url: str) -> None:
    before = {c: metric(gateway_url, "tokenfan_errors_total", {"class": c}) for c in ("client", "content")}
    httpx.post(gateway_url + "/v1/completions", json={"prompt": "x", "n": 3})
    httpx.post(gateway_url + "/v1/completions", json={"prompt": "w " * 3000})
    assert metric(gateway_url, "tokenfan_errors_total", {"class": "client"}) == before["client"] + 1
    assert metric(gateway_url, "tokenfan_errors_total", {"class": "content"}) == before["content"] + 1


def test_models_health_and_metrics(gateway_url: str) -> None:
    models = httpx.get(gateway_url + "/v1/models").json()
    assert models["data"][0]["id"] == "synthetic" and "NOT a model" in models["data"][0]["description"]
    assert httpx.get(gateway_url + "/health").json()["status"] == "ok"
    text = httpx.get(gateway_url + "/metrics").text
    assert 'tokenfan_active_streams{transport="sse"}' in text and 'tokenfan_active_streams{transport="ws"}' in text
    assert "tokenfan_requests_aborted_total" in text


def test_sse_stream_carries_anti_buffering_headers(gateway_url: str) -> None:
    with httpx.stream("POST", gateway_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                                      "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        events = sse_events(r.read().decode())
    assert events[-1]["data"] == "[DONE]"


def test_deleting_a_running_response_cancels_its_generation_and_forgets_it(
        gateway_url: str, client: openai.OpenAI) -> None:
    before = metric(gateway_url, "tokenfan_requests_aborted_total")
    bg = client.responses.create(model="synthetic", input="x", max_output_tokens=1500, background=True)
    wait_until(lambda: engine_load(gateway_url)[0] >= 1, what="engine running the response")
    r = httpx.delete(f"{gateway_url}/v1/responses/{bg.id}")
    assert (r.status_code, r.json()) == (200, {"id": bg.id, "object": "response.deleted", "deleted": True})
    wait_until(lambda: metric(gateway_url, "tokenfan_requests_aborted_total") > before, what="abort counted")
    wait_until(lambda: engine_load(gateway_url) == (0, 0), what="engine idle")
    for method, path in (("GET", ""), ("POST", "/cancel"), ("DELETE", "")):  # unknown from now on, as on OpenAI
        r = httpx.request(method, f"{gateway_url}/v1/responses/{bg.id}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)
        assert r.json()["error"]["message"] == f"Response with id '{bg.id}' not found."
        assert r.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(bg.id)
    with pytest.raises(openai.BadRequestError) as info:  # nor can a conversation continue from it
        client.responses.create(model="synthetic", input="y", previous_response_id=bg.id, max_output_tokens=2)
    assert info.value.code == "previous_response_not_found"
    r = httpx.get(f"{gateway_url}/v1/responses/resp_never")
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (404, "not_found", "response_id")


def test_only_a_background_response_can_be_cancelled(gateway_url: str, client: openai.OpenAI) -> None:
    done = client.responses.create(model="synthetic", input="x", max_output_tokens=3)
    r = httpx.post(f"{gateway_url}/v1/responses/{done.id}/cancel")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    assert client.responses.retrieve(done.id).status == "incomplete"  # untouched: it hit max_output_tokens
