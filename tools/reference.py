"""docs/reference.md from the code: every route, every error code and every metric of the gateway, and what its
probes ask.

``python tools/reference.py --write docs/reference.md`` regenerates the three tables between their markers;
``tests/test_docs_reference.py`` fails when they are stale, when the gateway gains a route or an error code that
:data:`ROUTES` / :data:`ERRORS` do not describe, or when one of them describes something the code no longer has.

What is read from the code: the routes of the app :func:`gateway.http.app.create_app` builds (with ``--workers 2``,
so the workers' internal routes are listed too); the error codes the gateway and the engine can send (every
``code="…"`` of a call or a dict, the engine's codes in :data:`gateway.errors.ENGINE_CODES`, the per-client limits'
codes, module constants named ``*_CODE``, the codes the engine worker replies with); every metric a scrape of
``/metrics`` can hold (name, type, labels, help). What is written here: what each route serves and, for each error
code, its status, when it happens and what the client should do.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAGE = "docs/reference.md"
BLOCKS = ("routes", "errors", "metrics", "probes")

# "METHOD path" (WS for a WebSocket route) -> what it serves, and where the page that explains it is
ROUTES: dict[str, tuple[str, str]] = {
    "POST /v1/chat/completions": ("OpenAI chat completions, streamed (SSE `data:` chunks, `[DONE]`) or not",
                                  "api.md#openai-compatible-endpoints"),
    "POST /v1/completions": ("OpenAI completions, streamed or not", "api.md#openai-compatible-endpoints"),
    "GET /v1/models": ("the served model (OpenAI list shape)", "api.md#service-endpoints"),
    "WS /v1/ws": ("several chat/completions generations multiplexed on one WebSocket, cancel by id",
                  "api.md#websocket-v1ws"),
    "POST /v1/streams": ("starts a fan-out stream; returns its id, `events_url`, `ws_url` and `durable_url` (201)",
                         "api.md#fan-out-streams-v1streams"),
    "GET /v1/streams/{id}": ("a fan-out stream's status: running or finished, events, subscribers",
                             "api.md#fan-out-streams-v1streams"),
    "DELETE /v1/streams/{id}": ("cancels a fan-out stream's generation", "api.md#fan-out-streams-v1streams"),
    "GET /v1/streams/{id}/events": (("a fan-out stream over SSE (HTTP/1.1, HTTP/2, HTTP/3, WebTransport), after "
                                     "`Last-Event-ID` or `?after=`"), "api.md#fan-out-streams-v1streams"),
    "WS /v1/streams/{id}/ws": ("a fan-out stream over WebSocket, after `?after=` (or `Last-Event-ID`)",
                               "api.md#fan-out-streams-v1streams"),
    "GET /v1/streams/{id}/durable": (("any listed stream by the Durable Streams protocol: catch-up from `?offset=`, "
                                      "`live=long-poll`, `live=sse`; HEAD: its tail offset and closure"),
                                     "durable-streams.md"),
    "POST /v1/responses": ("OpenAI Responses API: a response, streamed (SSE) or not, or in the background",
                           "api.md#responses-api-v1responses-sse-and-websocket-mode"),
    "GET /v1/responses/{id}": ("a stored response, or its events again with `stream=true&starting_after=N`",
                               "api.md#responses-api-v1responses-sse-and-websocket-mode"),
    "DELETE /v1/responses/{id}": ("deletes a stored response", "api.md#responses-api-v1responses-sse-and-websocket-mode"),
    "POST /v1/responses/{id}/cancel": ("cancels a background response",
                                       "api.md#responses-api-v1responses-sse-and-websocket-mode"),
    "WS /v1/responses": ("the Responses API's WebSocket mode (`response.create` events)",
                         "api.md#responses-api-v1responses-sse-and-websocket-mode"),
    "POST /api/chat": ("the AI SDK's `useChat` (UI message stream protocol over SSE)", "ai-sdk.md"),
    "GET /api/chat/{id:path}/stream": ("resumes a chat's running answer from its first part (204: none runs)",
                                       "ai-sdk.md#resume-fan-out-stop"),
    "DELETE /api/chat/{id:path}/stream": ("stops a chat's running answer", "ai-sdk.md#resume-fan-out-stop"),
    "GET /livez": ("liveness: 200 while the process and its event loop answer (asks neither engine nor Redis)",
                   "deploy.md#probes"),
    "GET /readyz": (("readiness: 200 while the engine link is up and the gateway is not draining (with `--workers`: "
                     "every listening worker's); Redis is not asked; else 503 with `reason`"), "deploy.md#probes"),
    "GET /health": (("for people: 200 when everything answers (engine link, workers, `--broker`: Redis writable and "
                     "the lease held), else 503; engines, workers, `broker` state and `limits`"),
                    "api.md#service-endpoints"),
    "GET /metrics": ("Prometheus metrics (the table below)", "api.md#service-endpoints"),
    "GET /v1/time": ("the gateway's clock (`time_ns`), for the pages' clock-offset estimate", "api.md#service-endpoints"),
    "GET /": ("the chat page (`web/index.html`)", "browser.md"),
    "GET /ab": ("the live SSE / WebSocket comparison page (`web/ab.html`)", "browser.md"),
    "GET /web/{path}": ("the pages' scripts and styles (`web/`)", "browser.md"),
    "GET /internal/streams/{id}": (("`--workers`: a stream owned by this worker, for a sibling's mirror (private Unix "
                                   "socket only)"), "failures.md#--workers-a-worker-that-dies"),
    "POST /internal/streams/{id}": (("`--workers`: the same for the stream's standby, its pending events too; the "
                                    "request body carries the standby's acknowledgements (private socket only)"),
                                   "failures.md#--workers-a-worker-that-dies"),
    "DELETE /internal/streams/{id}": ("`--workers`: cancels a stream this worker owns (private socket)",
                                      "failures.md#--workers-a-worker-that-dies"),
    "GET /internal/transcripts/{id}": ("`--workers`: a response transcript held by this worker (private socket)",
                                       "failures.md#--workers-a-worker-that-dies"),
    "GET /internal/metrics": (("`--workers`: this worker's own metrics, merged into every `/metrics` (private "
                              "socket)"), "limits.md#readiness-with---workers-n"),
    "GET /internal/ready": ("`--workers`: whether this worker listens and its engine link is up (private socket)",
                            "limits.md#readiness-with---workers-n"),
    "POST /internal/standby/{id}": ("`--workers`: asks this worker to mirror a stream as its standby (private socket)",
                                    "failures.md#--workers-a-worker-that-dies"),
}

# Routes that are not the app's: served by the QUIC listener itself (gateway/http3/bridge.py), listed after the
# app's routes; each is checked against the constant the code uses.
QUIC_ROUTES: dict[str, tuple[str, str]] = {
    "CONNECT /v1/wt": (("`--http3-port`: opens a WebTransport session on the UDP port; each stream on it is one "
                        "request to the routes above (a fan-out stream resumes as over SSE)"),
                       "api.md#http3-and-webtransport---http3-port"),
}


def quic_routes() -> list[tuple[str, str]]:
    from gateway.http3.bridge import WT_PATH

    return [("CONNECT", WT_PATH)]


# code -> (status(es), when, what the client should do)
ERRORS: dict[str, tuple[str, str, str]] = {
    "invalid_json": ("400", "the body or a WebSocket message is not JSON, or nests deeper than `--max-json-depth`",
                     "fix the request; do not retry it as is"),
    "invalid_type": ("400", "a field has the wrong JSON type (`param` names it)", "fix the field"),
    "invalid_value": ("400", "a field's value is out of range or not allowed (`param` names it)", "fix the field"),
    "invalid_request": ("400", ("the engine refused the request (e.g. a duplicate request id, a bad sampling "
                        "parameter)"), "fix the request"),
    "unsupported_parameter": ("400", "a field tokenfan refuses rather than ignores (api-fields.md)",
                              "drop the field"),
    "context_length_exceeded": ("400", "prompt + `max_tokens` exceed the model's context", ("shorten the prompt or "
                                "lower `max_tokens`")),
    "prompt_too_long": ("400", "the prompt has more tokens than `--max-prompt-tokens`", "shorten the prompt"),
    "model_not_found": ("404", "`model` names a model this gateway does not serve",
                        "use the id `GET /v1/models` returns, or leave `model` out"),
    "not_found": ("404", "no such route, response or request id (`/v1/ws` cancel of an unknown id)",
                  "check the path or id"),
    "stream_not_found": ("404", "no fan-out stream or chat answer has this id (never existed)", "check the id"),
    "stream_expired": ("410", "the stream finished and was dropped after `--stream-ttl`, or evicted",
                       "start a new generation"),
    "response_expired": ("410", "the stored response was dropped from retention", "create a new response"),
    "previous_response_not_found": ("400", "`previous_response_id` is unknown, expired or not stored",
                                    "send the whole conversation as `input`"),
    "response_cancelled": ("400", "the background response was cancelled (its stream's `error` event)",
                           "nothing: it was asked for"),
    "invalid_event": ("400", "Responses WebSocket mode: a message without a known string `type`",
                      "send `response.create`"),
    "invalid_stream_id": ("400", "Responses WebSocket mode: `stream_id` is not 1-256 letters, digits, `_-.`",
                          "fix `stream_id`"),
    "websocket_stream_limit_reached": ("400", ("Responses WebSocket mode: more distinct `stream_id`s than "
                                       "`--responses-ws-max-lanes` on one connection"),
                                       "reuse `stream_id`s or open another connection"),
    "method_not_allowed": ("405", "the route exists, not with this method", "use the method the reference lists"),
    "request_timeout": ("408", "the request body did not arrive within `--http-body-timeout`",
                        "send the body at once; retry"),
    "request_too_large": ("413", "the body is larger than `--max-body-bytes`", "send less, or raise the limit"),
    "missing_api_key": ("401", "API keys are on (`--api-key`) and the request sent none",
                        "send `Authorization: Bearer KEY` (WebSocket: `?api_key=`)"),
    "invalid_api_key": ("401", "the key or the stream token is wrong or expired", ("use a valid key; a stream token "
                        "lasts `--stream-token-ttl`: create the stream again")),
    "origin_not_allowed": ("403", "a WebSocket handshake from an `Origin` not in `--allowed-origins`",
                           "serve the page from the gateway's host or list its origin"),
    "client_generation_limit": ("429", "this client has `--max-generations-per-client` generations in flight",
                                "retry after `Retry-After`; a load generator lifts the limit (limits.md)"),
    "client_connection_limit": ("429", "this client has `--max-connections-per-client` connections open",
                                "close connections; retry after `Retry-After`"),
    "client_subscription_limit": ("429", "this client has `--max-subscriptions-per-client` subscriptions open",
                                  "close subscriptions; retry after `Retry-After`"),
    "connection_queue_limit": ("429", "`/v1/ws`: `--ws-max-queued` requests already wait on this connection",
                               "send it again when one has finished"),
    "fair_share_limit": ("429", "the gateway is busy and this client holds at least its share", "retry shortly"),
    "too_many_requests": ("429", ("`--max-concurrent` generations in the gateway, or `--max-concurrent-per-key` for "
                          "this key"), "retry after `Retry-After`"),
    "too_many_streams": ("429", "`--max-streams` fan-out streams running or retained", "retry after `Retry-After`"),
    "too_many_subscribers": ("429", "the stream has `--max-subscribers` subscribers", ("read it from another "
                             "subscriber, or retry later")),
    "rate_limit_exceeded": ("429", ("Responses WebSocket mode: `--responses-ws-max-pending` `response.create`s "
                            "already wait on this connection"), "wait for a response to finish"),
    "aborted": ("499", "the generation was aborted (its client left or cancelled it)", "nothing"),
    "engine_error": ("500", "the engine failed while generating", "retry; report it if it repeats (engine log)"),
    "internal_error": ("500", "a bug in the gateway (logged with its traceback)", "retry; report it"),
    "owner_lost": ("502", "the gateway that ran a listed stream died before its end and no one adopted it",
                   "resume (`Last-Event-ID`, `?after=`) or start again"),
    "stream_rolled_back": ("502", ("`--broker`: this reader read events its stream's Redis no longer holds (a "
                                   "replica promoted while behind, a restart) and the stream goes on from before "
                                   "them: never read as one answer (docs/failures.md)"),
                           "read it again from the start (`?after=-1`) or start a new generation"),
    "stream_lost": ("502, 410", "part of a stream is gone (a mirror missed events that no replica still holds)",
                    "start a new generation"),
    "engine_unavailable": ("503", ("no engine answers heartbeats, or the engine running the request died and it "
                           "could not be continued"), "retry after `Retry-After`"),
    "engine_overloaded": ("503", "the engine's queue holds `--max-queue` requests", "retry after `Retry-After`"),
    "overloaded": ("503", "the gateway's event loop runs `--max-loop-lag` late", "retry shortly"),
    "server_shutdown": ("503", "the gateway is shutting down (after `--shutdown-grace`)",
                        "retry on another instance"),
    "slow_consumer": ("503", "a write to this reader was blocked longer than `--send-timeout`",
                      "read faster; resume with `Last-Event-ID` / `?after=`"),
    "broker_unavailable": ("503", ("`--broker`: Redis is unreachable or hangs, or this gateway fenced itself: a new "
                           "listed stream (fan-out, background response, `/api/chat`) is refused at once"),
                           "retry after `Retry-After`"),
    "broker_full": ("503", ("`--broker`: Redis refuses writes for lack of memory (`maxmemory`, `noeviction`): a new "
                    "listed stream is refused"), "retry after `Retry-After`; free or grow Redis's memory"),
    "owner_fenced": ("503", ("`--broker`: a stored response's gateway lost touch with Redis before its end was "
                     "durable (it fenced itself: docs/failures.md); a Durable Streams read of a stream this gateway "
                     "fenced itself from or handed over"),
                     "GET `/v1/responses/{id}` (or the durable URL) on another replica, or here shortly"),
    "mirror_closed": ("503", "this replica stopped mirroring the stream", ("resume on another replica "
                      "(`Last-Event-ID`, `?after=`)")),
}

# codes the code names that never reach a client, and why
INTERNAL = {
    "adopted": "an internal marker: a mirror's stream was adopted (the `outcome` of `tokenfan_adoptions_total`)",
    "stream_mirrored": "`/internal/streams/{id}` between workers: the worker mirrors the stream, it does not own it",
    "version_mismatch": "the engine's answer to a gateway of another protocol version, which cannot decode it and "
                        "logs both versions instead (CHANGELOG.md)",
    "bad_frame": "the engine's log and `tokenfan_engine_bad_frames`: a malformed frame it dropped",
}


# -- what the code has --------------------------------------------------------------------------------------


def app_routes() -> list[tuple[str, str]]:
    """``(method, path)`` of every route of the app (``WS`` for a WebSocket route; a mount as ``path/{path}``)."""
    from starlette.routing import Mount, Route, WebSocketRoute

    import tokenfan_settings as settings
    from gateway.config import gateway_config
    from gateway.http.app import create_app

    ap = argparse.ArgumentParser()
    settings.add_arguments(ap, "gateway")
    values = settings.resolve(ap.parse_args([]), "gateway", environ={})
    app = create_app(gateway_config({**values, "workers": 2})).app
    out = []
    for r in app.routes:
        if isinstance(r, WebSocketRoute):
            out.append(("WS", r.path))
        elif isinstance(r, Mount):
            out.append(("GET", r.path + "/{path}"))
        elif isinstance(r, Route):
            out += [(m, r.path) for m in sorted(r.methods or ()) if m != "HEAD"]
    return out


def _code_sites(tree: ast.AST) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            status = n.args[0].value if n.args and isinstance(n.args[0], ast.Constant) else None
            for k in n.keywords:
                if k.arg == "code" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str):
                    found.setdefault(k.value.value, set()).update({status} if isinstance(status, int) else set())
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            pos = {"_reply_error": 2, "EngineError": 0}.get(name)
            if pos is not None and len(n.args) > pos and isinstance(n.args[pos], ast.Constant):
                found.setdefault(str(n.args[pos].value), set())
        elif isinstance(n, ast.Dict):
            for key, value in zip(n.keys, n.values):
                if isinstance(key, ast.Constant) and key.value == "code" and isinstance(value, ast.Constant) \
                        and isinstance(value.value, str):
                    found.setdefault(value.value, set())
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                and n.targets[0].id.endswith("_CODE") and isinstance(n.value, ast.Constant):
            found.setdefault(str(n.value.value), set())
    return found


def error_codes() -> dict[str, set[int]]:
    """Every error code the gateway or the engine can send, with the HTTP statuses the code raises it with
    where the status is a literal."""
    from engine_worker import protocol
    from gateway import admission, errors

    found: dict[str, set[int]] = {}
    for folder in ("gateway", "engine_worker"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for code, statuses in _code_sites(ast.parse(path.read_text())).items():
                found.setdefault(code, set()).update(statuses)
    for code, (status, _) in errors.ENGINE_CODES.items():
        found.setdefault(code, set()).add(status)
    for code in admission.CODES.values():
        found.setdefault(code, set()).add(429)
    for code in (protocol.Error.__doc__ or "").partition("machine-readable:")[2].split("``")[1::2]:
        found.setdefault(code, set())
    return found


def metric_families() -> list[tuple[str, str, list[str], str]]:
    """``(name, type, labels, help)`` of every metric a scrape of ``/metrics`` can hold (``--workers`` and
    ``--inject-delay`` included)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.core.metrics import Metrics, MigrationCollector, Migrations
    from gateway.scaleout.peers import merge_metrics

    m = Metrics()
    m.hot.inject({"sse": 0.001, "ws": 0.001})
    m.registry.register(MigrationCollector(Migrations()))
    text = merge_metrics([generate_latest(m.registry).decode()] * 2)
    declared = {name: list(getattr(c, "_labelnames", ())) for name, c in m.registry._names_to_collectors.items()}
    out = []
    for fam in text_string_to_metric_families(text if isinstance(text, str) else text.decode()):
        if fam.name.endswith("_created"):  # the creation time of each counter and histogram: not listed
            continue
        labels = set(declared.get(fam.name, ())) | set(declared.get(f"{fam.name}_total", ()))
        labels |= {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out.append((name, fam.type, sorted(labels), " ".join(fam.documentation.split())))
    return sorted(out)


# -- the tables ---------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def routes_md() -> str:
    rows = ["| method | path | serves | see |", "|---|---|---|---|"]
    routes = app_routes()
    missing = [f"{m} {p}" for m, p in routes if f"{m} {p}" not in ROUTES]
    stale = sorted(set(ROUTES) - {f"{m} {p}" for m, p in routes})
    if missing or stale:
        raise LookupError(f"tools/reference.py ROUTES: no row for {missing}; rows for routes that are gone: {stale}")
    quic = quic_routes()
    if {f"{m} {p}" for m, p in quic} != set(QUIC_ROUTES):
        raise LookupError(f"tools/reference.py QUIC_ROUTES: {sorted(QUIC_ROUTES)}; the QUIC listener serves {quic}")
    for m, p in [*routes, *quic]:
        serves, see = {**ROUTES, **QUIC_ROUTES}[f"{m} {p}"]
        rows.append(f"| {m} | `{p}` | {_cell(serves)} | [{see.split('#')[0]}]({see}) |")
    return "\n".join(rows)


def errors_md() -> str:
    codes = error_codes()
    missing = sorted(set(codes) - set(ERRORS) - set(INTERNAL))
    stale = sorted((set(ERRORS) | set(INTERNAL)) - set(codes))
    if missing or stale:
        raise LookupError(f"tools/reference.py ERRORS: no row for {missing}; rows for codes that are gone: {stale}")
    wrong = [c for c, statuses in codes.items() if c in ERRORS
             and not {str(s) for s in statuses} <= set(ERRORS[c][0].split(", "))]
    if wrong:
        raise LookupError(f"tools/reference.py ERRORS: the status of {wrong} differs from the code's")
    rows = ["| code | status | when | what to do |", "|---|---|---|---|"]
    order = sorted(ERRORS, key=lambda c: (ERRORS[c][0], c))
    rows += [f"| `{c}` | {ERRORS[c][0]} | {_cell(ERRORS[c][1])} | {_cell(ERRORS[c][2])} |" for c in order]
    rows += ["", "Codes the code uses that never reach a client:", ""]
    rows += [f"- `{c}`: {why}" for c, why in sorted(INTERNAL.items())]
    return "\n".join(rows)


def metrics_md() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    # every counter and histogram also has a `_created` gauge (its creation time), as prometheus_client exports
    for name, kind, labels, doc in metric_families():
        rows.append(f"| `{name}` | {kind} | {', '.join(f'`{x}`' for x in labels) or '–'} | {_cell(doc)} |")
    return "\n".join(rows)


def probes_md() -> str:
    """What ``/readyz`` and ``/health`` ask, from :data:`gateway.http.service.CONDITIONS`."""
    from gateway.http.service import CONDITIONS

    rows = ["| condition (`/readyz`'s `reason`) | `/readyz` | `/health` | holds when |", "|---|---|---|---|"]
    for c in CONDITIONS:
        rows.append(f"| `{c.reason}` | {'asked' if 'readyz' in c.asked_by else '–'} | "
                    f"{'asked' if 'health' in c.asked_by else '–'} | {_cell(c.holds_when)} |")
    return "\n".join(rows)


def generated() -> dict[str, str]:
    return {"routes": routes_md(), "errors": errors_md(), "metrics": metrics_md(), "probes": probes_md()}


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each ``<!-- NAME:start -->`` … ``<!-- NAME:end -->`` block replaced by ``blocks[NAME]``."""
    for name, body in blocks.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        head, s, rest = text.partition(start)
        _, e, tail = rest.partition(end)
        if not (s and e):
            raise ValueError(f"no {start} … {end} block")
        text = f"{head}{start}\n{body}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/reference.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", type=Path, metavar="PAGE", help=f"replace the tables in this page ({PAGE})")
    ns = ap.parse_args(argv)
    blocks = generated()
    if ns.write:
        ns.write.write_text(replace_blocks(ns.write.read_text(), blocks))
    else:
        print("\n\n".join(blocks.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

