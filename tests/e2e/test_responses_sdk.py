"""The Responses API with the unmodified official SDKs: Python ``openai`` (with its WebSocket mode,
``client.responses.connect()``) and Node ``openai`` + ``ws`` (``tests/node/responses_sdk.mjs``).

Each scenario is a function of a base URL that returns plain JSON results, so the same checks run
against any server: here against ``responses_stub`` (a test-only server over the pure modules, which
proves the harnesses themselves) and against a real gateway. Run the scenarios by hand with
``python -m tests.e2e.test_responses_sdk http://127.0.0.1:8000 [stream|resume|ws|cancel|unsupported]``
or ``node tests/node/responses_sdk.mjs http://127.0.0.1:8000 [scenario ...]``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.helpers import TERMINAL, until_terminal
from tests.e2e.responses_stub import StubServer
from tests.procs import ROOT
from tokenfan_bench.servers.processes import free_port

NODE_DIR = ROOT / "tests" / "node"
def client_for(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=60)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def summarize(events: list[Any]) -> dict[str, Any]:
    """What the checks need from a list of SDK event objects."""
    out: dict[str, Any] = {
        "types": [e.type for e in events],
        "seqs": [e.sequence_number for e in events],
        "text": "".join(e.delta for e in events if e.type == "response.output_text.delta"),
    }
    last = events[-1] if events else None
    if last is not None and getattr(last, "response", None) is not None:
        out["status"] = last.response.status
        out["id"] = last.response.id
        out["output_text"] = last.response.output_text
        out["usage"] = last.response.usage.model_dump() if last.response.usage else None
    for e in events:
        if getattr(e, "stream_id", None) is not None:
            out.setdefault("stream_ids", set()).add(e.stream_id)
    if "stream_ids" in out:
        out["stream_ids"] = sorted(out["stream_ids"])
    if last is not None and last.type == "error":
        err = getattr(last, "error", None)
        out["error_code"] = err.code if err is not None else last.code
    return out


# -- scenarios (official Python SDK, nothing else) ----------------------------------------------------


def scenario_stream(url: str) -> dict[str, Any]:
    client = client_for(url)
    events = list(client.responses.create(model=model_of(client), input="Say hello.", max_output_tokens=12,
                                          stream=True))
    # the SDK's stream helper (its accumulator checks the event order); a synthetic engine never stops
    # by itself, so the response may end incomplete (max_output_tokens) rather than completed
    with client.responses.stream(model=model_of(client), input=[{"role": "user", "content": "Hi"}],
                                 instructions="Be brief.", max_output_tokens=60) as helper:
        helper_events = list(helper)
        final = helper.get_final_response() if helper_events[-1].type == "response.completed" else None
    last = helper_events[-1].response  # type: ignore[union-attr]
    return {"events": summarize(events), "helper": {
        "text": "".join(e.delta for e in helper_events if e.type == "response.output_text.delta"),
        "output_text": last.output_text, "status": last.status,
        "final_text": final.output_text if final is not None else last.output_text}}


def scenario_resume(url: str, drop_after: int = 3, max_output_tokens: int = 30) -> dict[str, Any]:
    """Background + stream; the connection drops after ``drop_after`` deltas; resume with
    ``retrieve(stream=True, starting_after=<last sequence_number seen>)``."""
    client = client_for(url)
    stream = client.responses.create(model=model_of(client), input="Count.", background=True, stream=True,
                                     max_output_tokens=max_output_tokens)
    first: list[Any] = []
    deltas = 0
    for ev in stream:
        first.append(ev)
        deltas += ev.type == "response.output_text.delta"
        if deltas == drop_after:
            break
    stream.close()  # the dropped connection
    rid = first[0].response.id
    last = first[-1].sequence_number
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=last))
    final = client.responses.retrieve(rid)
    return {"id": rid, "first": summarize(first), "rest": summarize(rest), "final_status": final.status,
            "final_text": final.output_text, "background": final.background}


def scenario_ws(url: str) -> dict[str, Any]:
    """WebSocket mode: a response, its continuation by previous_response_id, the documented error for an
    unknown one, a warmup, and two lanes (stream_id) in flight at once."""
    client = client_for(url)
    model = model_of(client)
    out: dict[str, Any] = {}

    with client.responses.connect() as conn:
        conn.response.create(model=model, input="My name is Ada.", max_output_tokens=8)
        out["first"] = summarize(until_terminal(conn))
        conn.response.create(model=model, input="What is my name?", max_output_tokens=8,
                             previous_response_id=out["first"]["id"])
        out["continued"] = summarize(until_terminal(conn))
        conn.response.create(model=model, input="x", previous_response_id="resp_does_not_exist")
        err = until_terminal(conn)[-1]
        out["not_found"] = {"type": err.type, "code": err.error.code, "param": err.error.param,
                            "status": err.status}
        conn.response.create(model=model, input="Context to keep.", generate=False)
        out["warmup"] = summarize(until_terminal(conn))
        conn.response.create(model=model, input="lane a", max_output_tokens=10, stream_id="a")
        conn.response.create(model=model, input="lane b", max_output_tokens=10, stream_id="b")
        both = until_terminal(conn, lanes=2)
        out["lanes"] = {lane: summarize([e for e in both if getattr(e, "stream_id", None) == lane])
                        for lane in ("a", "b")}
        order = [e.stream_id for e in both if e.type == "response.output_text.delta"]
        out["lanes_interleaved"] = any(x != y for x, y in itertools.pairwise(order))
    return out


def scenario_cancel(url: str) -> dict[str, Any]:
    client = client_for(url)
    created = client.responses.create(model=model_of(client), input="Write a long story.", background=True,
                                      max_output_tokens=2000)
    time.sleep(0.2)
    cancelled = client.responses.cancel(created.id)
    again = client.responses.retrieve(created.id)
    tail = list(client.responses.retrieve(created.id, stream=True))
    return {"created_status": created.status, "cancelled_status": cancelled.status, "retrieved_status": again.status,
            "stream": summarize(tail)}


def scenario_unsupported(url: str) -> dict[str, Any]:
    client = client_for(url)
    try:
        client.responses.create(model=model_of(client), input="x",
                                tools=[{"type": "web_search"}])  # built-in tools are refused
    except openai.BadRequestError as exc:
        return {"status": exc.status_code, "param": exc.param, "code": exc.code}
    return {"status": 200}


SCENARIOS: dict[str, Callable[[str], dict[str, Any]]] = {
    "stream": scenario_stream, "resume": scenario_resume, "ws": scenario_ws, "cancel": scenario_cancel,
    "unsupported": scenario_unsupported,
}


# -- checks (the same for every server and both SDKs) ---------------------------------------------------


def check_events(s: dict[str, Any]) -> None:
    assert s["types"][:4] == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added"]
    assert s["types"][-4:-1] == ["response.output_text.done", "response.content_part.done",
                                 "response.output_item.done"]
    assert s["seqs"] == list(range(len(s["seqs"]))), "sequence numbers must be contiguous from 0"
    assert s["types"][-1] == "response." + s["status"] and s["status"] in ("completed", "incomplete")
    assert s["text"] and s["output_text"] == s["text"]
    assert s["usage"]["output_tokens"] > 0 and s["usage"]["total_tokens"] == (
        s["usage"]["input_tokens"] + s["usage"]["output_tokens"])


def check_stream(r: dict[str, Any]) -> None:
    check_events(r["events"])
    helper = r["helper"]
    assert helper["text"] and helper["text"] == helper["output_text"] == helper["final_text"]


def check_resume(r: dict[str, Any]) -> None:
    seqs = r["first"]["seqs"] + r["rest"]["seqs"]
    assert seqs == list(range(len(seqs))), "resume must lose nothing and repeat nothing"
    assert r["rest"]["seqs"] and r["rest"]["types"][-1] in TERMINAL
    text = r["first"]["text"] + r["rest"]["text"]
    assert text == r["final_text"] == r["rest"]["output_text"]
    assert r["final_status"] in ("completed", "incomplete") and r["background"] is True


def check_ws(r: dict[str, Any]) -> None:
    check_events(r["first"])
    check_events(r["continued"])
    assert r["first"]["id"] != r["continued"]["id"]
    assert r["not_found"] == {"type": "error", "code": "previous_response_not_found",
                              "param": "previous_response_id", "status": 400}
    assert r["warmup"]["types"][0] == "response.created" and r["warmup"]["status"] == "completed"
    assert r["warmup"]["text"] == ""
    for lane in ("a", "b"):
        check_events(r["lanes"][lane])
        assert r["lanes"][lane]["stream_ids"] == [lane]


def check_cancel(r: dict[str, Any]) -> None:
    assert r["created_status"] in ("queued", "in_progress")
    assert r["cancelled_status"] == r["retrieved_status"] == "cancelled"
    assert r["stream"]["types"][0] == "response.created" and r["stream"]["types"][-1] == "error"
    assert r["stream"]["error_code"] == "response_cancelled"
    assert r["stream"]["seqs"] == list(range(len(r["stream"]["seqs"])))


def check_unsupported(r: dict[str, Any]) -> None:
    assert r == {"status": 400, "param": "tools[0]", "code": "unsupported_parameter"}


CHECKS = {"stream": check_stream, "resume": check_resume, "ws": check_ws, "cancel": check_cancel,
          "unsupported": check_unsupported}


# -- Node ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def node_harness() -> Path:
    """``tests/node`` with its pinned ``openai`` + ``ws`` installed (``npm ci`` from the lockfile)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed for the Node SDK tests")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(NODE_DIR)], check=True,
                       timeout=600, capture_output=True)
    return NODE_DIR / "responses_sdk.mjs"


def run_node(script: Path, url: str, *scenarios: str) -> dict[str, Any]:
    proc = subprocess.run(["node", str(script), url, *scenarios], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NODE_NO_WARNINGS": "1"}, check=False)
    assert proc.returncode == 0, f"node harness failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


# -- the harnesses against the stub (run now) -------------------------------------------------------------


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    with StubServer(free_port()) as server:
        yield server.url


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_python_sdk_harness_against_the_stub(stub_url: str, name: str) -> None:
    CHECKS[name](SCENARIOS[name](stub_url))


def test_node_sdk_harness_against_the_stub(stub_url: str, node_harness: Path) -> None:
    results = run_node(node_harness, stub_url, *SCENARIOS)
    for name in SCENARIOS:
        CHECKS[name](results[name])


# -- the harnesses against a real gateway (synthetic engine) ----------------------------------------------

GATEWAY_SCENARIOS = list(SCENARIOS)


@pytest.mark.parametrize("name", GATEWAY_SCENARIOS)
def test_python_sdk_against_the_gateway(gateway_url: str, name: str) -> None:
    CHECKS[name](SCENARIOS[name](gateway_url))


@pytest.mark.parametrize("name", GATEWAY_SCENARIOS)
def test_node_sdk_against_the_gateway(gateway_url: str, node_harness: Path, name: str) -> None:
    CHECKS[name](run_node(node_harness, gateway_url, name)[name])


if __name__ == "__main__":
    target, names = sys.argv[1], sys.argv[2:] or list(SCENARIOS)
    print(json.dumps({n: SCENARIOS[n](target) for n in names}, indent=2, default=str))
