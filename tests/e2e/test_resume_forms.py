"""Every documented way to resume a fan-out stream reads exactly the events after the given one, with and
without ``--api-key`` (whose ``events_url`` / ``ws_url`` already carry ``?token=…``): the ``Last-Event-ID``
header and the query forms ``?after=`` and ``?last_event_id=`` over SSE, ``?after=`` over WebSocket. The query
is added to the URL the create response gave, as docs/api.md tells a client to (``URL.searchParams``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import websockets

from tests.e2e.helpers import sse_events
from tests.procs import start_gateway

KEY = "sk-resume"
TOKENS = 24  # an event carries the tokens of one engine step: one or more
AFTER = 4


@pytest.fixture(scope="module")
def keyed(synthetic_engine: str) -> Iterator[str]:
    proc, url = start_gateway(synthetic_engine, "--api-key", KEY, name="gateway-resume-keyed")
    yield url
    proc.stop()


@pytest.fixture(params=["open", "api-key"])
def gateway(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    """A gateway, and the headers its POSTs need."""
    if request.param == "open":
        return request.getfixturevalue("gateway_url"), {}
    return request.getfixturevalue("keyed"), {"Authorization": f"Bearer {KEY}"}


def finished_stream(url: str, headers: dict[str, str]) -> tuple[dict, list[tuple[int, dict]]]:
    """A fan-out stream run to its end, and its events as ``(seq, chunk)`` read from the start."""
    r = httpx.post(url + "/v1/streams", headers=headers, timeout=30,
                   json={"endpoint": "completions", "prompt": "resume me", "max_tokens": TOKENS})
    assert r.status_code == 201, r.text
    info = r.json()
    assert ("token=" in info["events_url"]) == bool(headers), info
    return info, sse_read(info["events_url"], {})


def sse_read(url: str | httpx.URL, headers: dict[str, str]) -> list[tuple[int, dict]]:
    r = httpx.get(url, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1]["data"] == "[DONE]", events[-3:]
    return [(int(e["id"]), json.loads(e["data"])) for e in events if "id" in e]


def ws_read(url: httpx.URL) -> list[tuple[int, dict]]:
    async def run() -> list[tuple[int, dict]]:
        out = []
        async with websockets.connect(str(url)) as ws:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] == "done":
                    return out
                assert msg["type"] == "chunk", msg
                out.append((msg["seq"], msg["data"]))
        raise AssertionError(f"the WebSocket closed without a done message after {out}")

    return asyncio.run(run())


def with_query(url: str, **params: str) -> httpx.URL:
    """``url`` (maybe with ``?token=…``) with ``params`` added, as docs/api.md says to build a resume URL."""
    return httpx.URL(url).copy_merge_params(params)


@pytest.mark.parametrize("form", ["sse Last-Event-ID", "sse ?after=", "sse ?last_event_id=", "ws ?after="])
def test_resume_form_reads_exactly_the_events_after_the_given_one(
        form: str, gateway: tuple[str, dict[str, str]]) -> None:
    url, headers = gateway
    info, whole = finished_stream(url, headers)
    assert [seq for seq, _ in whole] == list(range(len(whole))) and len(whole) > AFTER + 2, whole
    if form == "sse Last-Event-ID":
        got = sse_read(info["events_url"], {"Last-Event-ID": str(AFTER)})
    elif form == "sse ?after=":
        got = sse_read(with_query(info["events_url"], after=str(AFTER)), {})
    elif form == "sse ?last_event_id=":
        got = sse_read(with_query(info["events_url"], last_event_id=str(AFTER)), {})
    else:
        got = ws_read(with_query(info["ws_url"], after=str(AFTER)))
    assert got == whole[AFTER + 1:], f"{form}: {[s for s, _ in got]}"


def test_the_websocket_reads_from_the_start_with_after_minus_one(gateway: tuple[str, dict[str, str]]) -> None:
    """The README's WebSocket example (``after=-1``, added with searchParams): every event, with ``--api-key`` too."""
    url, headers = gateway
    info, whole = finished_stream(url, headers)
    assert ws_read(with_query(info["ws_url"], after="-1")) == whole


def test_resume_forms_that_disagree_are_refused(gateway_url: str) -> None:
    info, whole = finished_stream(gateway_url, {})
    r = httpx.get(with_query(info["events_url"], after="2"), headers={"Last-Event-ID": "5"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert "disagree" in r.json()["error"]["message"]
    r = httpx.get(with_query(info["events_url"], after="x"), timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "after", r.text
    agreeing = sse_read(with_query(info["events_url"], after="3"), {"Last-Event-ID": "3"})
    assert agreeing == whole[4:]
