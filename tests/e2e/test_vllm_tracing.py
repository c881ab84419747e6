"""One trace across the gateway and two real vLLM engines (the tiny random-weight Llama), one of them killed
mid-stream: streamed chat completions sent with one W3C ``traceparent``; the spans the gateway and both engine
workers export over OTLP/HTTP (the session's receiver, tests/otlp.py, decoding with opentelemetry-proto) form one
trace.

vLLM makes its ``llm_request`` span when a request *finishes* (``OutputProcessor.do_tracing``), so an engine killed
mid-request exports none for it: the killed engine's part of the migrated request is its worker's ``engine.accept``
span (exported at acceptance), and both engines' own vLLM spans are shown by two requests that finished on them
earlier in the same trace. The engines: two lean traced engines of the session (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.helpers import wait_until
from tests.otlp import Receiver, Span, dump, named, traceparent
from tests.procs import ARTIFACTS, Proc, start_gateway, stop_all

pytestmark = pytest.mark.vllm


@pytest.fixture
def traced_gateway(vllm_traced_engine: tuple[str, Proc], vllm_traced_engine_b: tuple[str, Proc],
                   vllm_traces: Receiver) -> Iterator[str]:
    """A traced gateway on the session's two traced engines."""
    proc, url = start_gateway(f"{vllm_traced_engine[0]},{vllm_traced_engine_b[0]}", "--otlp-traces-endpoint",
                              vllm_traces.endpoint, "--heartbeat-timeout", "30", name="gateway-vllm-traced",
                              timeout=480, env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        wait_until(lambda: all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]), 480,
                   "both engines")
        yield url
    finally:
        stop_all([proc])


LONG = 400  # the killed stream's tokens


def body(max_tokens: int) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Write about rivers."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


def engine_of(spans: list[Span], generation: Span) -> str:
    """The address of the engine that accepted ``generation`` first."""
    accepts = sorted((s for s in named(spans, "engine.accept") if s.parent_id == generation.span_id),
                     key=lambda s: s.start_ns)
    return str(accepts[0].resource["tokenfan.engine.address"])


def test_a_stream_migrated_off_a_killed_vllm_engine_is_one_trace_with_both_engines_spans(
        traced_gateway: str, vllm_traced_engine: tuple[str, Proc], vllm_traced_engine_b: tuple[str, Proc],
        vllm_traces: Receiver) -> None:
    url = traced_gateway
    engines = dict([vllm_traced_engine, vllm_traced_engine_b])  # address -> process
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": traceparent(trace_id, parent)}
    # 1. two requests at once: least-loaded routing puts one on each engine; each engine's vLLM span joins the trace
    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda _: httpx.post(url + "/v1/chat/completions", json=body(40), headers=headers,
                                                   timeout=120).text, range(2)))
    assert all(t.strip().endswith("data: [DONE]") for t in texts)
    first = vllm_traces.wait(lambda ss: len(list(named(ss, "llm_request"))) == 2 and len(list(named(ss, "chat tiny"))) == 2
                             and len(list(named(ss, "engine.accept"))) == 2, 60, "both engines' vLLM spans", trace_id)
    gens = {g.span_id: g for g in named(first, "chat tiny")}
    assert len(gens) == 2 and {engine_of(first, g) for g in gens.values()} == set(engines)
    for v in named(first, "llm_request"):
        assert v.parent_id in gens and v.service == "tokenfan-engine"
    pids = {str(a.resource["process.pid"]): str(a.resource["tokenfan.engine.address"])
            for a in named(first, "engine.accept")}
    assert {pids[str(v.resource["vllm.process_id"])] for v in named(first, "llm_request")} == set(engines)

    # 2. a stream whose engine is killed mid-stream: it continues on the other one
    # 400 tokens (the engines take 512): the stream must still be running when its engine.accept span has been
    # exported and read back (200 ms batches); 120 tokens of the tiny model once ended first on a busy machine
    # (CI: no migration, and the killed engine took its llm_request span along)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body(LONG), headers=headers, timeout=300) as s:
        lines = s.iter_lines()
        seen = 0
        for line in lines:
            # three tokens read (the first chunk's content is "": the role's)
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            seen += any(c.get("delta", {}).get("content") for c in chunk.get("choices") or ())
            if seen >= 3:
                break
        accepted = vllm_traces.wait(lambda ss: len(list(named(ss, "engine.accept"))) == 3, 30,
                                    "the stream's engine.accept", trace_id)
        (on,) = [a for a in named(accepted, "engine.accept") if a.parent_id not in gens]
        victim = str(on.resource["tokenfan.engine.address"])
        (survivor,) = set(engines) - {victim}
        done = vllm_traces.spans(trace_id)
        assert len(list(named(done, "chat tiny"))) == 2, "the stream ended before its engine could be killed"
        os.killpg(engines[victim].popen.pid, signal.SIGKILL)
        rest = "\n".join(lines)
    assert rest.strip().endswith("data: [DONE]") and "event: error" not in rest

    spans = vllm_traces.wait(lambda ss: len(list(named(ss, "llm_request"))) == 3 and len(list(named(ss, "chat tiny"))) == 3
                             and len(list(named(ss, "engine.accept"))) == 4, 60, "the migrated request's spans", trace_id)
    (gen,) = [g for g in named(spans, "chat tiny") if g.span_id not in gens]
    # the gateway's generation span: a child of the client's traceparent, its events, its GenAI attributes
    assert gen.parent_id == parent and gen.service == "tokenfan-gateway"
    gen.event("first_token")
    lost, moved = gen.event("engine_lost"), gen.event("migration")
    assert lost.attributes["tokenfan.engine.address"] == victim
    assert (moved.attributes["tokenfan.migration.from"], moved.attributes["tokenfan.migration.to"]) == (victim, survivor)
    assert moved.attributes["tokenfan.migration.gap_s"] > 0 and moved.attributes["tokenfan.migration.tokens"] >= 3
    assert gen.attributes["gen_ai.request.model"] == "tiny" and gen.attributes["gen_ai.usage.output_tokens"] == LONG
    assert gen.attributes["gen_ai.response.finish_reasons"] == ["length"] and gen.attributes["tokenfan.migrations"] == 1
    # under it: the killed engine's engine.accept; the survivor's engine.accept and vLLM's llm_request
    accepts = {str(a.resource["tokenfan.engine.address"]): a for a in named(spans, "engine.accept")
               if a.parent_id == gen.span_id}
    assert set(accepts) == {victim, survivor} and accepts[survivor].attributes["tokenfan.resume.tokens"] >= 3
    (vllm_span,) = [v for v in named(spans, "llm_request") if v.parent_id == gen.span_id]
    assert pids[str(vllm_span.resource["vllm.process_id"])] == survivor
    assert str(vllm_span.attributes["gen_ai.request.id"]).startswith(gen.attributes["gen_ai.response.id"] + ".m")
    dump(vllm_traces.spans(trace_id), ARTIFACTS / "trace-vllm-migration.json")  # docs/observability.md's picture
