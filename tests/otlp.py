"""A tiny OTLP/HTTP traces receiver for the tracing tests: ``POST /v1/traces`` bodies (protobuf
``ExportTraceServiceRequest``, gzip or plain) decoded with the ``opentelemetry-proto`` package into plain
:class:`Span` records, one list for the whole receiver, read with :meth:`Receiver.spans` / :meth:`Receiver.wait`."""

from __future__ import annotations

import dataclasses
import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Event:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass
class Span:
    """One exported span, its ids in hex, its resource's attributes beside its own."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    status: int = 0  # 0 unset, 1 ok, 2 error

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    def event(self, name: str) -> Event:
        found = [e for e in self.events if e.name == name]
        assert found, f"span {self.name} has no {name} event: {[e.name for e in self.events]}"
        return found[0]


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out: list[Span] = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                    kind=s.kind, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes={a.key: _value(a.value) for a in s.attributes}, resource=resource,
                    events=[Event(e.name, e.time_unix_nano, {a.key: _value(a.value) for a in e.attributes})
                            for e in s.events],
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links], status=s.status.code))
    return out


class Receiver:
    """``with Receiver() as r:`` an OTLP/HTTP endpoint at ``r.endpoint`` (loopback, a free port)."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode(body)
                with receiver._lock:
                    receiver._spans += spans
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait(self, pred: Callable[[list[Span]], bool], timeout: float = 20.0, what: str = "spans",
             trace_id: str | None = None) -> list[Span]:
        """The spans (of ``trace_id``) once ``pred`` holds for them; AssertionError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            if pred(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {[(s.service, s.name) for s in spans]}")
            time.sleep(0.05)


def named(spans: list[Span], name: str) -> Iterator[Span]:
    return (s for s in spans if s.name == name)


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


def dump(spans: list[Span], path: Path) -> None:
    """``spans`` as JSON (what tools/trace_picture.py draws)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([dataclasses.asdict(s) for s in spans], indent=1))
