"""One trace across the gateway and two real vLLM engines (the tiny random-weight Llama), one of them killed
mid-stream: a streamed chat completion sent with a W3C ``traceparent``; the spans the gateway and both engine workers
export over OTLP/HTTP (the session's receiver, tests/otlp.py, decoding with opentelemetry-proto) form one trace.

vLLM makes its ``llm_request`` span when a request *finishes* (``OutputProcessor.do_tracing``), so an engine killed
mid-request exports none for it: the killed engine's part of the trace is its worker's ``engine.accept`` span
(exported at acceptance), and its own vLLM span is shown by a request that finished on it earlier in the same trace.
The engines: the session's plain vLLM engine and a traced spare (tests/conftest.py), both exporting to that receiver.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.helpers import wait_until
from tests.otlp import Receiver, Span, dump, named, traceparent
from tests.procs import ARTIFACTS, Proc, start_gateway, stop_all

pytestmark = pytest.mark.vllm


@pytest.fixture
def traced_gateway(vllm_traced_engine: tuple[str, Proc], vllm_engine: tuple[str, Proc], vllm_traces: Receiver,
                   vllm_gateway_url: str) -> Iterator[str]:
    """A traced gateway on the traced spare (first: a tie in load goes to it) and the session's engine."""
    spare, _ = vllm_traced_engine
    shared, _ = vllm_engine  # up once its gateway is (vllm_gateway_url waits for the engine's start)
    proc, url = start_gateway(f"{spare},{shared}", "--otlp-traces-endpoint", vllm_traces.endpoint,
                              "--heartbeat-timeout", "30", name="gateway-vllm-traced", timeout=480,
                              env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        wait_until(lambda: all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]), 480,
                   "both engines")
        yield url
    finally:
        stop_all([proc])


def body(max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Write about rivers."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


def the(spans: list[Span], name: str, **attrs: object) -> Span:
    found = [s for s in named(spans, name) if all(s.attributes.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, [(s.name, s.attributes) for s in spans])
    return found[0]


def run_until_the_kill(url: str, headers: dict[str, str], trace_id: str, spare: str, spare_proc: Proc,
                       vllm_traces: Receiver) -> tuple[list[Span], Span, Span]:
    """A request that finishes on the spare, then a stream on it whose engine is killed mid-stream."""
    # 1. a request that finishes on the spare: the spare's vLLM exports its llm_request span into the trace
    r = httpx.post(url + "/v1/chat/completions", json=body(4), headers=headers, timeout=120)
    assert r.text.strip().endswith("data: [DONE]")
    first = vllm_traces.wait(lambda ss: any(s.name == "llm_request" for s in ss), 60, "the spare's vLLM span",
                             trace_id)
    first_gen = next(s for s in first if s.name == "chat tiny")
    spare_vllm = the(first, "llm_request")
    assert spare_vllm.parent_id == first_gen.span_id
    assert the(first, "engine.accept").resource["tokenfan.engine.address"] == spare

    # 2. a stream on the spare, which is killed mid-stream: it continues on the session's engine
    with httpx.stream("POST", url + "/v1/chat/completions", json=body(120), headers=headers, timeout=300) as s:
        lines = s.iter_lines()
        seen = 0
        for line in lines:
            seen += '"content"' in line
            if seen >= 3:
                break
        accepted = vllm_traces.wait(lambda ss: len(list(named(ss, "engine.accept"))) == 2, 30,
                                    "the second request's engine.accept", trace_id)
        on_spare = [a for a in named(accepted, "engine.accept") if a.parent_id != first_gen.span_id]
        assert [a.resource["tokenfan.engine.address"] for a in on_spare] == [spare]  # a tie in load goes to it
        os.killpg(spare_proc.popen.pid, signal.SIGKILL)
        rest = "\n".join(lines)
    assert rest.strip().endswith("data: [DONE]") and "event: error" not in rest

    return accepted, spare_vllm, first_gen


@contextlib.contextmanager
def busy(gateway: str, traced: str, shared: str) -> Iterator[None]:
    """The session's engine busy with a long stream of another gateway, until the traced gateway sees it running:
    new requests of the traced gateway go to the spare (least-loaded routing), not by chance."""
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body(400), timeout=300) as load:
        lines = load.iter_lines()
        next(line for line in lines if '"content"' in line)
        wait_until(lambda: any(e["address"] == shared and (e["running"] or 0) >= 1
                               for e in httpx.get(traced + "/health").json()["engines"]), 30, "the shared engine busy")
        yield


def test_a_stream_migrated_off_a_killed_vllm_engine_is_one_trace_with_both_engines_spans(
        traced_gateway: str, vllm_traced_engine: tuple[str, Proc], vllm_engine: tuple[str, Proc],
        vllm_traces: Receiver, vllm_gateway_url: str) -> None:
    url, (spare, spare_proc), (shared, _) = traced_gateway, vllm_traced_engine, vllm_engine
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": traceparent(trace_id, parent)}
    with busy(vllm_gateway_url, url, shared):
        _, spare_vllm, first_gen = run_until_the_kill(url, headers, trace_id, spare, spare_proc,
                                                                      vllm_traces)
    spans = vllm_traces.wait(lambda ss: len(list(named(ss, "llm_request"))) == 2 and len(list(named(ss, "chat tiny"))) == 2,
                             60, "the migrated request's spans", trace_id)
    gen = next(g for g in named(spans, "chat tiny") if g.span_id != first_gen.span_id)
    # the gateway's generation span: a child of the client's traceparent, its events, its GenAI attributes
    assert gen.parent_id == parent and gen.service == "tokenfan-gateway"
    gen.event("first_token")
    lost, moved = gen.event("engine_lost"), gen.event("migration")
    assert lost.attributes["tokenfan.engine.address"] == spare
    assert (moved.attributes["tokenfan.migration.from"], moved.attributes["tokenfan.migration.to"]) == (spare, shared)
    assert moved.attributes["tokenfan.migration.gap_s"] > 0 and moved.attributes["tokenfan.migration.tokens"] >= 3
    assert gen.attributes["gen_ai.request.model"] == "tiny" and gen.attributes["gen_ai.usage.output_tokens"] == 120
    assert gen.attributes["gen_ai.response.finish_reasons"] == ["length"] and gen.attributes["tokenfan.migrations"] == 1
    # under it: the killed engine's engine.accept; the session engine's engine.accept and vLLM's llm_request
    accepts = [a for a in named(spans, "engine.accept") if a.parent_id == gen.span_id]
    assert sorted(a.resource["tokenfan.engine.address"] for a in accepts) == sorted([spare, shared])
    continued = next(a for a in accepts if a.resource["tokenfan.engine.address"] == shared)
    assert continued.attributes["tokenfan.resume.tokens"] >= 3
    shared_vllm = next(v for v in named(spans, "llm_request") if v.span_id != spare_vllm.span_id)
    assert shared_vllm.parent_id == gen.span_id and shared_vllm.service == "tokenfan-engine"
    assert str(shared_vllm.attributes["gen_ai.request.id"]).startswith(gen.attributes["gen_ai.response.id"] + ".m")
    assert spare_vllm.resource["vllm.process_id"] == str(spare_proc.popen.pid) != shared_vllm.resource["vllm.process_id"]
    dump(vllm_traces.spans(trace_id), ARTIFACTS / "trace-vllm-migration.json")  # docs/observability.md's picture
