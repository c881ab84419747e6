"""The markdown report of ``tokenfan bench report`` (:mod:`tokenfan_bench.report.matrix`) and its plots
(matplotlib, Agg): pure formatting of the matrix's results dictionary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from tokenfan_bench.report.plots import slug, write_plots
from tokenfan_bench.runner import Run
from tokenfan_bench.stats.report_estimates import (
    PLACEBO_MS,
    RESOLUTION_MS,
    calibration_difference,
    contains_zero,
    recovered,
    verdict,
)


def _f(x: Any, nd: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{nd}f}"


def _ci(d: dict[str, Any] | None, nd: int = 2) -> str:
    if not d or d.get("median") is None:
        return "–"
    lo, hi = d["ci95"]
    return f"{d['median']:+.{nd}f} [{_f(lo, nd)}, {_f(hi, nd)}]"


def _label(arm: dict[str, Any], wire: dict[str, Any] | None = None, key: str = "") -> str:
    t = arm["transport"]
    if wire and key in wire and wire[key].get("via") not in (None, "direct"):
        t += f" @ {wire[key]['via']}"
    return t


def arm_table(r: dict[str, Any]) -> list[str]:
    rows = [("| arm | transport | TTFT p50 ms | gap p50 ms | gap p99 ms | delivery p50 / p99 ms | stalls /1000 gaps | "
            "errors | Δ delivery vs A ms [95% CI] | Δ TTFT vs A ms | Δ p99 gap vs A ms |"),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    wire = r.get("wire")
    for k, a in r["arms"].items():
        d = "" if k == "A" else f"{k}-A"
        rows.append(f"| {k} | {_label(a, wire, k)} | {_f(a['ttft_ms']['p50'])} | {_f(a['itl_ms']['p50'])} | "
                    f"{_f(r['gap_p99_ms'][k])} | {_f(a['delivery_ms']['p50'], 2)} / {_f(a['delivery_ms']['p99'])} | "
                    f"{_f(r['stalls'][k]['per_1000'], 2)} | {a['errors']} | "
                    f"{_ci(r['diffs_ms'].get(d), 3) if d else '(reference)'} | "
                    f"{_ci(r['ttft_diffs_ms'].get(d)) if d else ''} | {_ci(r['gap_p99_diffs_ms'].get(d)) if d else ''} |")
    return rows


def _aa(r: dict[str, Any]) -> str:
    d = r["diffs_ms"]["B-A"]
    return f"{_ci(d, 3)} {'✓ contains 0' if contains_zero(d) else '✗ excludes 0'}"


def _cal_recovered(r: dict[str, Any]) -> bool:
    """Whether a calibration read the delay its gateway applied in that run (``expected_ms``)."""
    return recovered(calibration_difference(r), r["expected_ms"])


def _cal(r: dict[str, Any]) -> str:
    d = calibration_difference(r)
    per_pair = ", ".join(f"{x:+.2f}" for x in d.get("per_pair_ms", []))
    pairs = f" (mean of {d['pairs']} run pairs: {per_pair})" if d.get("pairs", 1) > 1 else ""
    applied = r["applied"]
    placebo = f" − placebo {r['applied_placebo']['mean_ms']:.3f}" if "applied_placebo" in r else ""
    return (f"{_ci(d, 3)}{pairs} for {r['expected_ms']:.3f} ms applied (gateway-timed sleeps: mean "
            f"{applied['mean_ms']:.3f}, median {applied['median_ms']:.3f}, {applied['n']} sleeps{placebo}) "
            f"{'✓ recovered' if _cal_recovered(r) else '✗ not recovered'}")


def _verdicts(r: dict[str, Any], ref: str, others: dict[str, str]) -> dict[str, str]:
    """Per metric, 'X vs ref: verdict' for each other arm key -> name."""
    out: dict[str, list[str]] = {"delivery": [], "TTFT": [], "p99 gap": []}
    for k, name in others.items():
        for metric, diffs in (("delivery", r["diffs_ms"]), ("TTFT", r["ttft_diffs_ms"]),
                              ("p99 gap", r["gap_p99_diffs_ms"])):
            out[metric].append(f"{name} vs {ref}: {verdict(diffs[f'{k}-A'], ref, name)}")
    return {m: "; ".join(v) for m, v in out.items()}


def cpu_rows(cpu: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, tuple[float, float, float]]]]:
    """The CPU and bytes table (a row per profile and transport) and, per profile, each transport's
    server CPU per token as (mean, min, max) over the repeated runs."""
    rows = [("| profile | transport | server CPU µs per delivered token: mean (min–max of runs) | client CPU µs per "
            "received event: mean (min–max) | down bytes per token (TLS) | up bytes per token |"),
            "| --- | --- | --- | --- | --- | --- |"]
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for profile, per in cpu.items():
        prows, out[profile] = _cpu_profile(per)
        rows += [f"| {profile} {r}" for r in prows]
    return rows, out


def _cpu_profile(cpu: dict[str, Any]) -> tuple[list[str], dict[str, tuple[float, float, float]]]:
    rows: list[str] = []
    server: dict[str, tuple[float, float, float]] = {}
    for t, runs in cpu.get("runs", {}).items():
        sv = [x["server"].get("cpu_us_per_token") for x in runs]
        cv = [x["client"].get("cpu_us_per_event") for x in runs]
        sv_ok = [v for v in sv if v is not None]
        cv_ok = [v for v in cv if v is not None]
        down = [x["wire"]["A"]["down_bytes_per_token"] for x in runs if x.get("wire")]
        up = [x["wire"]["A"]["up_bytes_per_token"] for x in runs if x.get("wire")]
        if sv_ok:
            server[t] = (float(np.mean(sv_ok)), min(sv_ok), max(sv_ok))
        rows.append(f"| {t} | {_f(np.mean(sv_ok)) if sv_ok else '–'} ({_f(min(sv_ok)) if sv_ok else '–'}–"
                    f"{_f(max(sv_ok)) if sv_ok else '–'}) | {_f(np.mean(cv_ok)) if cv_ok else '–'} "
                    f"({_f(min(cv_ok)) if cv_ok else '–'}–{_f(max(cv_ok)) if cv_ok else '–'}) | "
                    f"{_f(np.mean(down)) if down else '–'} | {_f(np.mean(up), 2) if up else '–'} |")
    return rows, server


def cpu_verdict(server: dict[str, tuple[float, float, float]], a: str, b: str) -> str:
    if a not in server or b not in server:
        return "not measured"
    (_, alo, ahi), (_, blo, bhi) = server[a], server[b]
    if ahi < blo:
        return f"{a} lower"
    if bhi < alo:
        return f"{b} lower"
    return "no difference resolved (ranges overlap)"


def write_report(results: dict[str, Any], runs: dict[str, Run], out: Path, plots: Path) -> None:
    """The report's markdown at ``out`` and its plots in ``plots``, from the matrix's results."""
    plots.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(plots, out.parent)
    s = results["settings"]
    level0 = str(s["levels"].strip("[]").split(",")[0]).strip()
    lines = [*_method(results), *_profiles(results), *_answer(results, level0, rel), *_per_profile(results, level0, rel),
             *_via_section(results), *_cpu_and_bytes(results, rel)]
    out.write_text("\n".join(lines) + "\n")
    write_plots(results, runs, plots)


def _method(results: dict[str, Any]) -> list[str]:
    """The title, where and how the report was made, and the method."""
    s = results["settings"]
    m = results["meta"]
    inject, margin = float(s["inject_ms"]), float(s["equivalence_ms"])
    return [
        "# SSE or WebSocket under real conditions: the A/B report", "",
        (f"Made on this machine by `tokenfan {' '.join(m['command'][1:])}` at {m['time']} in "
        f"{m['matrix_s']:.0f} s: {m['machine']['cpu_model']} × {m['machine']['cpus']} (shared), Python "
        f"{m['versions']['python']}, load {m['load']} before and {m['load_after']} after. Raw results: "
        "`results.json` of the run (not committed)."), "",
        "## Method", "",
        (f"- Synthetic engines at {float(s['rate']):g} tokens/s per stream, {float(s['ttft_ms']):g} ms TTFT, "
        f"{s['max_tokens']} tokens per stream; concurrency levels {s['levels']}. The engine is the same for "
        "every arm, so every difference is the path's and the transport's."),
        ("- Every arm goes through the same userspace shaping proxy (`tokenfan_bench/network/shaping_proxy.py`: per-connection "
        "bandwidth and stalls, a one-RTT handshake, a path jitter shared by the run), one route per arm so "
        "bytes are counted per arm. TCP slow start and loss recovery are not modelled. The proxy's timers "
        "fire within tens of µs (`select(2)`; on uvloop they fired on millisecond ticks, which turned a 2.1 ms "
        "difference into 2 or 3 ms depending on a phase that held for a whole run)."),
        ("- Fan-out arms (one stream, every arm subscribed; paired per token): A `sse` (HTTP/1.1 over TLS), "
        f"B `sse` again (the A/A), C `ws` (wss), D `sse-h2` ({s['h2_k']} subscribers per HTTP/2 connection, as "
        "a page shares one). The gateway is TLS (Granian, h2 by ALPN). Responses API: A `resp-sse`, B "
        "`resp-sse` (A/A), C `resp-ws`, one response each (unpaired). Every run has at least 20 streams (a slot "
        "runs several in turn), so intervals come from the stream-cluster bootstrap. Who subscribes first "
        "matters: the gateway writes an event to a stream's subscribers in their subscription order (rotated by "
        "`seq`), so the arms subscribe in a random order and the next stream in the reverse of it: every pair "
        "of arms is written first equally often. Each slot warms one connection per pool first, so no arm "
        "pays a handshake the other does not."),
        (f"- Calibration: a second gateway started with `--inject-delay ws:{inject:g}` (every WebSocket write "
        f"sleeps {inject:g} ms); `sse, ws` against it must read the delay the gateway really adds. That expected "
        "value is the gateway's own: it times each injected sleep (`tokenfan_injected_delay_seconds` on "
        "`/metrics`, scraped before and after the calibration's runs; a sleep lasts longer than asked, more on a "
        "loaded gateway than in an idle process). The socket calibration, paired per token, expects the median "
        "sleep of its run; the browser's difference-in-differences, a difference of unpaired medians (wide: "
        "they carry the browser's own noise), expects the delayed gateway's mean sleep minus the placebo's. "
        f"*Recovered* = the 95% interval excludes 0 and comes within {RESOLUTION_MS:g} ms of the expected "
        "value: the slack of that model, between the sleeps' median and mean (not a clock's resolution: the "
        "`/ab` page is cross-origin isolated, `performance.now()` moves in 5 µs)."),
        (f"- Browser arm: headless Chromium (`/usr/bin/chromium`, Playwright) on the gateway's `/ab` page through "
        f"the same proxy: A `EventSource`, B `EventSource` (A/A), C streamed `fetch`, D `WebSocket`, "
        f"{s['browser_streams']} concurrent streams, each read by one arm (arms dealt to streams in shuffled blocks, "
        f"at least {s['min_streams']} streams per arm; arms compared by their medians, unpaired), as a page "
        "reads a stream with one API: two APIs reading the same token in one browser act on each other (on "
        "the lan placebo, EventSource read 0.6 ms later when the WebSocket copy of its token arrived "
        "~1.5 ms before it, which made the calibration read 2.4–2.6 ms for 2.08 ms). Receive times from "
        "`performance.timeOrigin + performance.now()`, aligned to the server clock over CDP (± reported). "
        "Chromium lets one WebSocket per host and port be in its opening handshake at a time (RFC 6455 §4.1): "
        "with every stream's socket on one port, a 3g run opened them one after another, 2.7–4.5 s after "
        "their streams' POST, when the streams had ended. So each stream slot opens its WebSockets to a port "
        "of its own on the proxy (same profile), as a page talking to that many hosts would; EventSource and "
        "fetch share the page's HTTP/2 connection. A WebSocket still costs its own TCP + TLS + upgrade "
        "handshake, which is the browser's WebSocket TTFT. "
        "Chromium's EventSource and WebSocket differ without any delay, so the browser's calibration is a "
        "difference-in-differences: `EventSource, WebSocket` on the delayed gateway minus the same on a placebo "
        f"gateway (`--inject-delay ws:{PLACEBO_MS:g}` against `ws:{PLACEBO_MS + inject:g}`: the same server path, "
        "both writes off the engine's step; against a placebo writing inside the step, where every process on "
        "the way is awake, Chromium read the delayed write 0.1–0.15 ms later than the gateway slept), each arm "
        "over at least "
        f"{s['min_streams']} streams, {s.get('browser_cal_runs', 1)} pairs of runs averaged pair by pair (a run "
        "moves both of its arms together, by up to ±0.6 ms on lan, which cancels inside its pair)."),
        ("- Intervals: bootstrap 95% over streams. Δ delivery is paired per token (as `tokenfan bench`; "
        "unpaired, the difference of the arms' medians, for the Responses and browser arms). Unpaired arms read "
        "different tokens at different moments of the path's jitter, so each token's delivery first loses the "
        "jitter the proxy added to it: a seeded function of time, the same for every connection, looked up at "
        "the gateway's send stamp. It has the same distribution in both arms, so removing it takes out noise "
        "the profile adds on purpose and no transport's effect (3g browser calibration, one pair: per-token "
        "spread 9.5 → 1.1 ms, interval ±3.1 → ±0.26 ms); the delivery columns of the tables stay raw. "
        "Δ TTFT is paired per stream (unpaired for the Responses and browser arms); Δ p99 gap is the difference of the "
        "pooled p99 inter-token gaps with streams resampled. An interval holding 0 reads *no difference "
        "resolved*. A stall is a gap > 5 × the stream's median gap and > 250 ms."),
        (f"- A proxy does *no damage* when its tokens are not held back: an equivalence test (two one-sided "
        f"tests) on Δ delivery against the straight path, the 95% interval inside ±{margin:g} ms. The margin is "
        "one frame of a 60 Hz display: a token shown less than a frame later cannot be seen to be late. A proxy "
        "hop on loopback costs tens of µs, which a paired test resolves but nobody sees."),
        ("- CPU per token is measured in every profile: one single-transport run per transport, "
        f"{s['cpu_repeats']} times (server CPU from the gateway's `/metrics`, client CPU of the bench's client "
        "process); a transport wins when its range of runs lies below the other's."),
        "",
    ]


def _profiles(results: dict[str, Any]) -> list[str]:
    """Each network profile's model beside what was measured through the proxy."""
    lines = ["## Profiles (model and measured through the proxy)", "",
              "| profile | model | measured RTT p50 (min–max) ms | down Mbit/s | up Mbit/s |", "| --- | --- | --- | --- | --- |"]
    for name, p in results["profiles"].items():
        prof = p["network"]["profile"]
        me = prof["measured"] or {}
        lines.append(f"| {name} | {prof['describe']} | {_f(me.get('rtt_ms'))} ({_f(me.get('rtt_min_ms'))}–"
                     f"{_f(me.get('rtt_max_ms'))}) | {_f(me.get('down_mbit'))} | {_f(me.get('up_mbit'), 2)} |")
    lines.append("")
    return lines


BROWSER_DELIVERY_NOTE = (
    "*Browser delivery*: the WebSocket arm's median delivery minus the EventSource arm's (unpaired, the path's "
    "known jitter removed; the `browser ws − es` rows of the plot below). It is Chromium's delivery to page code, "
    "not an artefact of the page's stamps: the page reaches the gateway over HTTP/2 (TLS), and Chromium's "
    "HTTP/2 stack holds each small piece of a streamed response body for 1 ms before passing it on, which "
    "EventSource and a streamed `fetch` pay alike and a WebSocket does not; over HTTP/1.1 the two APIs read the "
    "same tokens within 0.03 ms. Measured per API, with a calibration, by `tokenfan bench page-levels` "
    "([browser.md](browser.md#where-the-browsers-millisecond-goes-tokenfan-bench-page-levels)).")


def browser_delivery(b: dict[str, Any] | None) -> str:
    """The answer table's browser delivery cell: WebSocket − EventSource (the browser run's ``D-A``, the
    difference of the arms' medians with the path's known jitter removed, as in ``diffs.png``) with its
    interval and the winner."""
    if not b or "D-A" not in b["diffs_ms"]:
        return "–"
    d = b["diffs_ms"]["D-A"]
    return f"{_ci(d)} ({verdict(d, 'EventSource', 'WebSocket')})"


def _answer(results: dict[str, Any], level0: str, rel: str) -> list[str]:
    """The answer table: per profile, the winner of every comparison or *no difference resolved*."""
    _, server_cpu = cpu_rows(results.get("cpu", {}))
    lines = ["## The answer per profile", "",
              (f"At {level0} concurrent streams. Each cell: the winner (lower is better) or *no difference resolved*; "
              "the intervals are in the per-profile tables below. CPU: server µs per delivered token, the range "
              "of repeated single-transport runs in that profile."), "",
              ("| profile | TTFT: ws vs sse · sse-h2 vs sse | p99 gap: ws vs sse · sse-h2 vs sse | delivery: ws vs sse | "
              "server CPU: ws vs sse · sse-h2 vs sse · resp-ws vs resp-sse | "
              "Responses TTFT: resp-ws vs resp-sse | browser TTFT: WebSocket vs EventSource | "
              "browser delivery: WebSocket − EventSource ms [95% CI] | A/A contains 0 "
              "(socket · Responses · browser) | calibration recovered (socket · browser) |"),
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, p in results["profiles"].items():
        r = p["levels"][level0]
        v = _verdicts(r, "sse", {"C": "ws", "D": "sse-h2"})
        rv = verdict(p["responses"]["ttft_diffs_ms"]["C-A"], "resp-sse", "resp-ws")
        b = p.get("browser")
        bv = verdict(b["ttft_diffs_ms"]["D-A"], "EventSource", "WebSocket") if b else "–"
        bd = browser_delivery(b)
        aa = " · ".join("✓" if contains_zero(x["diffs_ms"]["B-A"]) else "✗"
                        for x in (r, p["responses"], b) if x is not None)
        cal = " · ".join("✓" if _cal_recovered(x) else "✗"
                         for x in (p["calibration"], p.get("browser_calibration")) if x is not None)
        cpu = " · ".join(cpu_verdict(server_cpu.get(name, {}), a, b)
                         for a, b in (("sse", "ws"), ("sse", "sse-h2"), ("resp-sse", "resp-ws")))
        lines.append(f"| {name} | {v['TTFT']} | {v['p99 gap']} | {v['delivery'].split('; ')[0]} | {cpu} | {rv} | "
                     f"{bv} | {bd} | {aa} | {cal} |")
    lines += ["", BROWSER_DELIVERY_NOTE, ""]
    lines += [f"![TTFT p50 per profile and transport]({rel}/ttft.png)", "",
              f"![inter-token gap p50 and p99]({rel}/gaps.png)", "",
              f"![delivery differences with intervals]({rel}/diffs.png)", ""]
    return lines


def _per_profile(results: dict[str, Any], level0: str, rel: str) -> list[str]:
    """Per profile: every arm table, the A/A and the calibrations."""
    inject = float(results["settings"]["inject_ms"])
    lines: list[str] = []
    for name, p in results["profiles"].items():
        lines += [f"## {name}: {p['network']['profile']['describe']}", ""]
        for n, r in p["levels"].items():
            lines += [f"Fan-out, {n} streams (paired):", "", *arm_table(r), ""]
        lines += ["Responses API (unpaired):", "", *arm_table(p["responses"]), ""]
        if p.get("browser"):
            b = p["browser"]["browser"]
            how = "one arm per stream, unpaired" if p["browser"].get("separate_streams") else "paired"
            lines += [(f"Browser (Chromium, {how}; clock offset {b['clock_offset_ms']:+.3f} ms ± "
                      f"{b['clock_uncertainty_ms']:.3f} ms; texts identical per seed: {b['texts_identical']}):"), "",
                      *arm_table(p["browser"]), ""]
        lines += [f"A/A: socket {_aa(p['levels'][level0])}; Responses {_aa(p['responses'])}"
                  + (f"; browser {_aa(p['browser'])}" if p.get("browser") else "") + ".",
                  f"Calibration (+{inject:g} ms on WebSocket writes): socket {_cal(p['calibration'])}"
                  + (f"; browser {_cal(p['browser_calibration'])}"
                     if p.get("browser_calibration") else "") + ".", "",
                  f"![delivery latency CDF, {name}]({rel}/cdf_{slug(name)}.png)", ""]
    return lines


def _via_section(results: dict[str, Any]) -> list[str]:
    """The nginx run: the tested config and a buffering one against the straight path (empty without it)."""
    if not results.get("via"):
        return []
    margin = float(results["settings"]["equivalence_ms"])
    lines = ["## Through nginx: the tested config and a buffering one", "",
              ("One plain-HTTP gateway; per stream six subscribers: `sse` and `ws` each straight to the gateway, "
               "through nginx with `deploy/nginx/tokenfan.conf` (TLS + HTTP/2 to the client) and through the same "
               "file with `proxy_buffering on` and the gateway's `X-Accel-Buffering: no` ignored. The first table "
               "is paired against A (`sse` straight); the second compares each proxied arm with the straight arm "
               "of its own transport. The nginx paths add TLS (the straight ones are plain HTTP): a new "
               "connection pays the TLS handshake (one more RTT), which WebSocket subscribers, opening one "
               "connection each, show in TTFT; SSE subscribers reuse keep-alive connections. A buffering proxy "
               "holds SSE events until it flushes (here: the stream's end), so none arrives live; *buffers* = "
               "the arm's median gap is under a quarter of the straight arm's (tokens arrive in bursts); "
               f"*no damage* = the equivalence test of the method: Δ delivery's 95% interval inside ±{margin:g} ms."),
              ""]
    for name, v in results["via"].items():
        r = v["run"]
        lines += [f"### via, {name}", "", *arm_table(r), "",
                  ("| arm | path | Δ TTFT vs straight ms [95% CI] | Δ delivery vs straight ms [95% CI] | "
                  "gap p50 ms (straight) | verdict |"), "| --- | --- | --- | --- | --- | --- |"]
        for k, d in v["vs_straight"].items():
            verdict_text = ("**damage: buffers**, tokens arrive in bursts" if d["buffers"]
                            else f"no damage: within ±{margin:g} ms" if d.get("no_damage")
                            else f"streams, but not shown within ±{margin:g} ms")
            lines.append(f"| {k} | {d['transport']} via {d['via']} | {_ci(d['ttft_ms'])} | "
                         f"{_ci(d['delivery_ms'], 3) if d['delivery_ms']['n'] else 'no live token'} | "
                         f"{_f(d['gap_p50_ms'])} ({_f(d['straight_gap_p50_ms'])}) | {verdict_text} |")
        lines.append("")
    return lines


def _cpu_and_bytes(results: dict[str, Any], rel: str) -> list[str]:
    """CPU per token and bytes on the wire per profile and transport, and the plaintext bytes."""
    cpu_table, _ = cpu_rows(results.get("cpu", {}))
    lines = ["## CPU and bytes on the wire", "", *cpu_table, ""]
    plain = _plain_bytes(results)
    if plain:
        lines += [("Plaintext (the via run's straight arms, HTTP/1.1 without TLS), and what a compressing transport "
                  "would at best send: the down stream deflated per read with a sync flush (as permessage-deflate "
                  "or a flushed gzip; their own framing left out):"), "",
                  "| transport | down bytes per token | deflated | ratio |", "| --- | --- | --- | --- |"]
        for t, (raw, dfl) in plain.items():
            lines.append(f"| {t} | {_f(raw)} | {_f(dfl)} | {_f(dfl / raw if raw else None, 2)} |")
        lines.append("")
    lines += [f"![CPU and bytes per token]({rel}/cpu_bytes.png)", ""]
    return lines


def _plain_bytes(results: dict[str, Any]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for v in results.get("via", {}).values():
        for k, w in v["run"].get("wire", {}).items():
            if k != "post" and not w["tls"] and w["down_bytes_per_token"]:
                out.setdefault(w["transport"], (w["down_bytes_per_token"], w["deflated_down_bytes_per_token"]))
    return out
