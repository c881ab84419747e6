"""The report's loss section (``tokenfan bench report --loss``): every transport under real packet loss.

Per loss level (:func:`tokenfan_bench.network.lossy.parse_loss`: ``0.5%`` random, ``2%-burst``…), the bench's
clients run in a client namespace and the gateways in a gateway namespace, joined by the packet wire (the
base profile's RTT, jitter and bandwidth on every packet) with the kernel's random drops or the wire's
bursts (:mod:`tokenfan_bench.network.lossy`). Two gateways on one synthetic engine each, TLS (HTTP/2 by ALPN)
and ``--http3-port``:

- the answer run, on the same streams (paired): A ``sse`` (HTTP/1.1, a connection per subscriber),
  B ``sse`` (the A/A), C ``sse-h2`` (K subscribers per HTTP/2 connection, as a page shares one), D ``ws``
  (a connection each), E ``sse-h3`` (K per QUIC connection), F ``wt`` (K WebTransport streams per session);
- the QUIC calibration, against a gateway whose HTTP/3 writes sleep ``PLACEBO_MS`` and WebTransport writes
  that plus ``--inject-ms``: A ``sse-h3``, B ``sse-h3`` (A/A), C ``wt`` (C − A must read the difference of
  the sleeps the gateway timed, within the report's resolution), D ``wt``. D is there for balance: the
  readers whose sleeps end together write (and the client reads) one after the other in pure-Python QUIC,
  so with two ``sse-h3`` arms against one ``wt`` the ``sse-h3`` side queued longer after its sleep than the
  timed sleeps show and the calibration read short (1.1–1.5 ms for 1.8 ms applied in the report of
  2026-11-27; in one session, three arms 1.60 ms for 1.90, four 1.83 and 1.90, recovered: docs/benchmarks.md);
- headless Chromium, started in the client namespace, on the answer gateway's ``/ab`` page: ``es``, ``es``
  (A/A), ``ws``, ``wt``, each stream read by one API (unpaired, as the report's browser arm).

Beside each level: what the run really lost (iptables' and the wire's counts per protocol) and the kernel's
TCP retransmissions in each namespace.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tokenfan_bench.clients.quic import free_udp_port
from tokenfan_bench.clients.workers import Plan
from tokenfan_bench.network.lossy import Loss, LossyNet, measured
from tokenfan_bench.report import run_outputs
from tokenfan_bench.runner import Run, run_clients
from tokenfan_bench.servers import processes
from tokenfan_bench.stats.loss_table import arm_row, lowest
from tokenfan_bench.stats.report_estimates import (
    PLACEBO_MS,
    applied_delay,
    contains_zero,
    injected_sleeps,
    recovered,
)

LOSS_ARMS = ("sse", "sse", "sse-h2", "ws", "sse-h3", "wt")
BROWSER_LOSS_ARMS = ("es", "es", "ws", "wt")  # Chromium: EventSource (HTTP/2, shared), WebSocket, WebTransport
QUIC_CAL = ("sse-h3", "sse-h3", "wt", "wt")  # as many readers wake after each sleep (see the docstring)
QUIC = ("sse-h3", "wt")
DEFAULT_LEVELS = "0%,0.5%,2%,5%,2%-burst"
DEFAULT_BASE = "rtt=60ms,jitter=5ms,down=20mbit,up=5mbit"  # 4g without its modelled stalls: loss is real here
# The loss runs' first token comes at least this late, so every arm has joined its stream before it: over the
# lossy path the stream's POST or a subscriber's handshake waits out retransmission timeouts (a lost SYN: 1 s),
# and delivery counts only events emitted after the subscriber joined. At 5% loss with a 20 ms TTFT, a busy run
# had all three HTTP/2 and all three WebSocket subscribers join after their 16-token streams had ended.
JOIN_MS = 2000.0


@dataclass
class LossSettings:
    levels: list[Loss]
    base: str
    streams: int
    k: int
    max_tokens: int
    rate: float
    ttft_ms: float
    inject_ms: float
    min_streams: int
    ramp: float
    n_boot: int
    seed: int
    logs: Path
    browser: bool = False  # Chromium in the client namespace: es, es, ws, wt on streams of their own
    browser_streams: int = 8


@dataclass(frozen=True)
class LossGateways:
    tcp: str  # https://GATEWAY_IP:port (TLS: h2 and HTTP/1.1)
    h3: str  # https://GATEWAY_IP:udp-port
    cal_tcp: str
    cal_h3: str


def _on(url: str, host: str) -> str:
    u = urlsplit(url)
    return u._replace(netloc=f"{host}:{u.port}").geturl()


@contextlib.contextmanager
def lossy_gateways(s: LossSettings, net: LossyNet, cert: Path, key: str) -> Iterator[LossGateways]:
    """The answer gateway and the calibration gateway, started inside the gateway namespace."""
    with contextlib.ExitStack() as stack:
        with net.inside("gateway"):
            ports = [free_udp_port("0.0.0.0"), free_udp_port("0.0.0.0")]
            base = ["--host=0.0.0.0", f"--ssl-certfile={cert}", f"--ssl-keyfile={key}", f"--http3-certfile={cert}",
                    f"--http3-keyfile={key}"]
            args = [[*base, f"--http3-port={ports[0]}"],
                    [*base, f"--http3-port={ports[1]}", f"--inject-delay=sse-h3:{PLACEBO_MS:g}",
                     f"--inject-delay=wt:{PLACEBO_MS + s.inject_ms:g}"]]
            # one after the other: a child inherits the namespace of the thread that starts it (this one)
            spawned = [stack.enter_context(processes.spawn_synthetic(s.rate, max(s.ttft_ms, JOIN_MS), s.logs, a)) for a in args]
        ip = net.gateway_ip
        yield LossGateways(_on(spawned[0].url, ip), f"https://{ip}:{ports[0]}", _on(spawned[1].url, ip),
                           f"https://{ip}:{ports[1]}")


def _rows(run: Run, s: LossSettings, tag: str) -> dict[str, dict[str, Any]]:
    """The loss table's rows of ``run``, one per arm, printed in brief."""
    rows = {k: arm_row(a, s.n_boot, s.seed) for k, a in run.arms.items()}
    brief = " ".join(f"{k}={r['transport']} p50 {r['p50']['value'] or 0:.1f} p99 {r['p99']['value'] or 0:.1f} "
                     f"err {r['errors']} late {r['late']}" for k, r in rows.items())
    print(f"{tag}: {brief}", file=sys.stderr, flush=True)
    return rows


def measure(s: LossSettings, tcp: str, h3: str, arms: tuple[str, ...], tag: str) -> tuple[Run, dict[str, Any]]:
    plan = Plan(url=tcp, transports=arms, streams=s.streams, max_tokens=s.max_tokens, duration=None, separate=False,
                ramp=s.ramp, seed=s.seed, timeout=180.0, h2_streams_per_connection=s.k,
                arm_urls=tuple(h3 if t in QUIC else tcp for t in arms), metrics_url=tcp,
                rounds=-(-s.min_streams // s.streams))
    run = run_clients(plan, 1, tag, False)
    result = run_outputs.run_result(run, n_boot=s.n_boot, seed=s.seed)
    result["loss_rows"] = _rows(run, s, tag)
    return run, result


def browser_run(s: LossSettings, g: LossGateways, cert: Path, tag: str) -> dict[str, Any]:
    """Chromium (started in the calling thread's namespace) on the answer gateway's ``/ab`` page: each stream
    read by one of :data:`BROWSER_LOSS_ARMS`, at least ``min_streams`` streams per arm."""
    from gateway.http.certs import sha256_of
    from tokenfan_bench.clients.browser import chromium, run_browser

    rounds = -(-s.min_streams * len(BROWSER_LOSS_ARMS) // s.browser_streams)
    with chromium(quic=True) as browser:
        result = run_browser(g.tcp, BROWSER_LOSS_ARMS, streams=s.browser_streams, rounds=rounds,
                             max_tokens=s.max_tokens, ramp=s.ramp / 2, n_boot=s.n_boot, seed=s.seed, browser=browser,
                             separate=True, wt={"url": g.h3 + "/v1/wt", "hash": sha256_of(cert)})
    run = result.pop("_run")
    result["loss_rows"] = _rows(run, s, tag)
    return result


def scrape_sleeps(url: str) -> tuple[Any, Any]:
    """The calibration gateway's timed sleeps: (``sse-h3``'s placebo, ``wt``'s)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False, verify=False).text
    return injected_sleeps(text, "sse-h3"), injected_sleeps(text, "wt")


def run_loss(s: LossSettings) -> dict[str, Any]:
    """Every loss level: the answer run, the QUIC calibration, what was lost. Raises if namespaces cannot be
    made here (not root, no iptables)."""
    from gateway.http.certs import generate

    out: dict[str, Any] = {"base": s.base, "arms": list(LOSS_ARMS), "calibration_arms": list(QUIC_CAL),
                           "k": s.k, "streams": s.streams, "inject_ms": s.inject_ms, "levels": {}}
    with tempfile.TemporaryDirectory(prefix="tokenfan-loss-") as tmp:
        cert, key = generate(Path(tmp) / "tls", ("10.77.0.2",), days=13)
        for i, loss in enumerate(s.levels):
            with LossyNet(s.base, loss, seed=s.seed + i) as net, lossy_gateways(s, net, cert, str(key)) as g:
                level: dict[str, Any] = {"loss": loss.describe(), "spec": loss.name}
                with net.inside("client"):
                    before = net.counters()
                    _, level["run"] = measure(s, g.tcp, g.h3, LOSS_ARMS, f"loss {loss.name} answer")
                    level["measured"] = measured(before, net.counters())
                    sleeps0 = scrape_sleeps(g.cal_tcp)
                    _, cal = measure(s, g.cal_tcp, g.cal_h3, QUIC_CAL, f"loss {loss.name} QUIC calibration")
                    sleeps1 = scrape_sleeps(g.cal_tcp)
                    placebo = applied_delay(sleeps1[0] - sleeps0[0])
                    applied = applied_delay(sleeps1[1] - sleeps0[1])
                # both arms' writes leave off the engine's step (the placebo's by PLACEBO_MS), so the difference
                # is the sleeps' alone: an undelayed write shares its step with every other reader's, and read
                # 0.35 ms later than a delayed one on the 60 ms path (0% loss, 2 ms for 2.27 ms slept)
                cal.update(applied=applied, applied_placebo=placebo,
                           expected_ms=applied["median_ms"] - placebo["median_ms"])
                level["calibration"] = cal
                if s.browser:
                    with net.inside("client"):
                        level["browser"] = browser_run(s, g, cert, f"loss {loss.name} browser")
                out["levels"][loss.name] = level
    return out


# -- markdown ------------------------------------------------------------------------------------------


def _v(cell: dict[str, Any], nd: int = 1) -> str:
    if cell["value"] is None:
        return "–"
    lo, hi = cell["ci95"]
    return f"{cell['value']:.{nd}f} [{lo:.{nd}f}, {hi:.{nd}f}]"


def _d(diff: dict[str, Any], nd: int = 3) -> str:
    lo, hi = diff["ci95"]
    if diff.get("median") is None or lo is None:
        return "–"
    return f"{diff['median']:+.{nd}f} [{lo:+.{nd}f}, {hi:+.{nd}f}]"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def answer_rows(level: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The answer run's rows, one per transport (the A/A's second ``sse`` left out)."""
    rows = level["run"]["loss_rows"]
    return {r["transport"]: r for k, r in rows.items() if k != "B"}


def browser_rows(level: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The browser run's rows, one per API (its A/A's second EventSource left out)."""
    rows = level.get("browser", {}).get("loss_rows", {})
    return {r["transport"]: r for k, r in rows.items() if k != "B"}


def section(loss: dict[str, Any]) -> list[str]:
    """The loss section of docs/ab-report.md."""
    lines = ["## Under real packet loss (network namespaces)", "",
             (f"Base path: `{loss['base']}` on every packet (the packet wire between a client and a gateway "
             "namespace), plus loss: random drops by the kernel (`iptables -m statistic --mode random` on arrival, each way, "
             "TCP and UDP alike) or bursts at the wire (Gilbert-Elliott, mean burst 8 packets). The kernels' TCP "
             "and QUIC (aioquic at both ends) recover every loss themselves, at the path's RTT. Arms on the same "
             f"streams: `sse` (HTTP/1.1 over TLS, a connection each), `sse-h2` ({loss['k']} subscribers per HTTP/2 "
             f"connection, as a page shares one), `ws` (a connection each), `sse-h3` ({loss['k']} per QUIC "
             f"connection), `wt` ({loss['k']} WebTransport streams per session); {loss['streams']} concurrent "
             "streams." + (" Then headless Chromium in the client namespace on the gateway's `/ab` page: `browser-es` "
             "(EventSource, the page's HTTP/2 connection), `browser-ws`, `browser-wt` (WebTransport, one session), "
             "each stream read by one API (unpaired)." if any("browser" in lv for lv in loss["levels"].values())
                           else "") + " Each cell: value [95% interval over streams]; a stall is a "
             "gap > 5 × the stream's median gap and > 250 ms."), "",
             ("| loss | measured loss TCP · UDP | TCP retransmitted / sent (gateway) | "
             "transport | delivery p50 ms | delivery p99 ms | stalls /1000 gaps | errors |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, level in loss["levels"].items():
        m = level["measured"]
        lost = f"{_pct(m['protocols']['tcp']['loss'])} · {_pct(m['protocols']['udp']['loss'])}"
        gw = m["tcp"]["gateway"]
        retrans = f"{gw.get('Tcp.RetransSegs', 0)} / {gw.get('Tcp.OutSegs', 0)} ({_pct(gw['retrans_per_segment'])})"
        for i, (t, r) in enumerate({**answer_rows(level), **browser_rows(level)}.items()):
            head = f"| {name} | {lost} | {retrans} |" if i == 0 else "| | | |"
            lines.append(f"{head} {t} | {_v(r['p50'], 2)} | {_v(r['p99'])} | {_v(r['stalls'], 2)} | {r['errors']} |")
    lines += ["", ("Which transport is lowest (its interval below every other transport's; else none resolved), "
              "and the checks of each level:"), "",
              ("| loss | lowest delivery p50 | lowest delivery p99 | fewest stalls | A/A sse (B − A ms) | "
              "A/A sse-h3 | QUIC calibration: wt − sse-h3 ms for the applied sleep | browser: lowest p99 · "
              "A/A EventSource (B − A ms) |"),
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, level in loss["levels"].items():
        rows = answer_rows(level)
        aa = level["run"]["diffs_ms"]["B-A"]
        cal = level["calibration"]
        qaa, qcal = cal["diffs_ms"]["B-A"], cal["diffs_ms"]["C-A"]
        ok = recovered(qcal, cal["expected_ms"])
        cells = [lowest(rows, m) or "none resolved" for m in ("p50", "p99", "stalls")]
        browser = "–"
        if "browser" in level:
            baa = level["browser"]["diffs_ms"]["B-A"]
            browser = (f"{lowest(browser_rows(level), 'p99') or 'none resolved'} · {_d(baa)} "
                       f"{'✓' if contains_zero(baa) else '✗'}")
        lines.append(f"| {name} | {' | '.join(cells)} | {_d(aa)} {'✓' if contains_zero(aa) else '✗'} | "
                     f"{_d(qaa)} {'✓' if contains_zero(qaa) else '✗'} | {_d(qcal)} for {cal['expected_ms']:.3f} "
                     f"{'✓ recovered' if ok else '✗ not recovered'} | {browser} |")
    return lines + [""]


START, END = "<!-- loss:start -->", "<!-- loss:end -->"


def write_section(loss: dict[str, Any], out: Path, made: str | None = None) -> None:
    """Put the loss section into the report at ``out``: in place of its previous one, else at its end;
    ``made``: a line under its title saying when and how it was made (``--loss-only``)."""
    if "error" in loss:
        body = ["## Under real packet loss (network namespaces)", "", f"Not run here: {loss['error']}.", ""]
    else:
        body = section(loss)
    if made:
        body[2:2] = [made, ""]
    block = "\n".join([START, *body, END])
    text = out.read_text() if out.exists() else ""
    head, start, rest = text.partition(START)
    if start:
        _, end, tail = rest.partition(END)
        text = head + block + (tail if end else "")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block + "\n"
    out.write_text(text)
