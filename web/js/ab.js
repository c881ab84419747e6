// The A/B page: EventSource (A) against WebSocket (B), each reading fan-out streams of its own, with
// per-token delivery latency measured in the browser.
//
// Each run creates two streams with the same request body (prompt, max tokens, temperature, the seed if
// one is set), one after the other: one is read by an EventSource, the other by a WebSocket, and which
// API goes first alternates from run to run. Why not one stream read by both, side by side: two APIs
// reading the same token in one page act on each other (on the bench's lan placebo EventSource read
// ~0.6 ms later when the WebSocket copy of its token arrived ~1.5 ms before it: tokenfan_bench/
// clients/browser.py), so a paired per-token difference measures the page as much as the transports. Why one
// after the other: streams generated at the same time share engine steps (continuous batching), so their
// tokens would reach the page together and the two APIs would again read at the same moments. A page in
// production reads a stream with one API; so does each arm here, like the bench's browser arm
// (bencharm.js with `separate`; both read streams through readstream.js).
//
// Definitions follow `tokenfan bench` (tokenfan_bench/stats/metrics.py), so an export from this page and a
// bench result read the same way:
// - delivery latency = browser receive time + clock offset − engine emit time, per *live* content
//   event (emitted after that subscriber connected; earlier ones are a replay and would measure the join
//   delay). The receive time is performance.timeOrigin + performance.now() taken before parsing; the emit
//   time is the chunk's `tokenfan.emit_ns`; the offset comes from NTP-style `GET /v1/time` pings.
// - TTFT: POST /v1/streams → first content event; ITL: gaps between successive content events;
//   E2E: POST → last chunk; tokens/s: (deltas − 1) / (last − first content event).
// - B − A: the difference of the two arms' medians over every run so far (unpaired), with a 95% CI from
//   bootstrapping each arm on its own (by stream once there are enough). It carries the run-to-run
//   jitter that a paired difference cancelled; the clock offset, the same for both arms, still cancels.

import { apiKey, describeError, epochMs, getModelId, pageParam, setApiKey } from "./api.js";
import { Chart } from "./chart.js";
import { estimateOffset } from "./clock.js";
import { ROW, ROW_FIELDS, readOwnStream } from "./readstream.js";
import { ecdf, quantileSorted, sorted, summarize, unpairedMedianDiff } from "./stats.js";
import { EventSourceSubscription, WebSocketSubscription } from "./transports.js";

const $ = (sel, root = document) => root.querySelector(sel);

const ARMS = {
  A: { index: 0, api: "es", transport: "sse", name: "EventSource", Sub: EventSourceSubscription, color: "--a" },
  B: { index: 1, api: "ws", transport: "ws", name: "WebSocket", Sub: WebSocketSubscription, color: "--b" },
};
const KEYS = Object.keys(ARMS);
const TIMEOUT_MS = Number(pageParam("timeout_ms", 30000));
const BOOTSTRAP = { resamples: 1000, seed: 1 };
// performance.now() is coarsened to 5 µs when cross-origin isolated (these pages are), else 100 µs.
const TIMER_FLOOR_MS = globalThis.crossOriginIsolated ? 0.005 : 0.1;

const els = {
  model: $("#model"), banner: $("#banner"), form: $("#controls"), prompt: $("#prompt"),
  maxTokens: $("#max-tokens"), temperature: $("#temperature"), seed: $("#seed"), runs: $("#runs"),
  apiKey: $("#api-key"), start: $("#start"), stop: $("#stop"), exportBtn: $("#export"), clock: $("#clock"),
  resync: $("#resync"), progress: $("#progress"), verdict: $("#verdict"), diff: $("#diff"),
  ttftDiff: $("#ttft-diff"), net: $("#net"),
};
const cdfChart = new Chart($("#cdf"), { xLabel: "delivery latency (ms)", yLabel: "fraction" });
const timelineChart = new Chart($("#timeline"), { xLabel: "token (seq)", yLabel: "latency (ms)" });

const page = {
  model: null,
  clock: null, // {offsetMs, uncertaintyMs, rttMs, samples}: server clock = browser clock + offsetMs
  running: false,
  abort: null, // AbortController of the batch: Stop cancels the stream being read and the runs not begun
  runs: [], // per run: {order: ["A", "B"] or ["B", "A"], A: ArmRun | null, B: ArmRun | null, identical}
  current: { A: [], B: [] }, // content rows of the current run, for the timeline
  config: null,
  startedMs: 0,
  wallS: 0,
};
// For tests and the console: `streams` lists every stream the page created ({run, arm, api, id}).
const debug = (window.__tokenfan = { page: "ab", state: "idle", runs: 0, identical: null, result: null, errors: [],
  streams: [] });

function showBanner(text) {
  els.banner.textContent = text;
  els.banner.hidden = false;
}

function ms(v, digits = 2) {
  return v === null || v === undefined || !Number.isFinite(v) ? "–" : v.toFixed(digits);
}

function signed(v, digits = 3) {
  return `${v >= 0 ? "+" : ""}${ms(v, digits)}`;
}

// -- clock ----------------------------------------------------------------------------------

async function syncClock() {
  els.clock.textContent = "measuring…";
  try {
    page.clock = await estimateOffset(8);
    const c = page.clock;
    els.clock.textContent = `${signed(c.offsetMs)} ms ± ${c.uncertaintyMs.toFixed(3)} ms`
      + ` (min RTT ${c.rttMs.toFixed(3)} ms of ${c.samples} pings)`;
  } catch (err) {
    page.clock = null;
    els.clock.textContent = "unavailable";
    showBanner(describeError(err));
  }
}

// -- one arm's pane -------------------------------------------------------------------------

/** The live view of one arm: its stream's text, state and running latency. */
class Pane {
  constructor(key) {
    this.key = key;
    this.el = $(`#pane-${key}`);
    this.streamId = null;
    this.latencies = [];
    this.textNode = document.createTextNode("");
  }

  reset(state) {
    this.streamId = null;
    this.latencies = [];
    this.textNode = document.createTextNode("");
    $(".text", this.el).replaceChildren(this.textNode);
    $(".error", this.el).hidden = true;
    delete this.el.dataset.stream;
    this.setState(state);
  }

  setStream(id) {
    this.streamId = id;
    this.el.dataset.stream = id;
    this.showLive();
  }

  setState(state) {
    this.el.dataset.state = state;
    this.showLive();
  }

  append(text, latencyMs) {
    this.latencies.push(latencyMs);
    this.textNode.appendData(text);
  }

  fail(err) {
    const box = $(".error", this.el);
    box.textContent = describeError(err);
    box.hidden = false;
    this.setState("error");
  }

  showLive() {
    const lat = this.latencies;
    const stream = this.streamId ? ` · stream ${this.streamId}` : "";
    $(".live", this.el).textContent = `${this.el.dataset.state}${stream} · ${lat.length} chunks`
      + ` · last ${ms(lat.length ? lat[lat.length - 1] : null)} ms · p50 ${ms(quantileSorted(sorted(lat), 0.5))} ms`;
  }
}

const panes = Object.fromEntries(KEYS.map((key) => [key, new Pane(key)]));

// -- one arm in one run -----------------------------------------------------------------------

/** Delivery latency of one row: receive time on the server's clock − engine emit time (ms). */
function latencyMs(row, offsetMs) {
  return row[ROW.recv_ms] + offsetMs - row[ROW.emit_ns] / 1e6;
}

/** What one arm read in one run (a readOwnStream record) and the clock offset to put it on the server's clock. */
class ArmRun {
  constructor(rec, offsetMs) {
    Object.assign(this, rec);
    this.offsetMs = offsetMs;
    this.events = rec.rows.filter((r) => r[ROW.content]); // content events
  }

  get ok() {
    return this.error === null && this.reason === "done";
  }

  get lastChunkMs() {
    return this.rows.length ? this.rows[this.rows.length - 1][ROW.recv_ms] : null;
  }

  latency(row) {
    return latencyMs(row, this.offsetMs);
  }

  /** Emitted after this subscriber connected (server clock). */
  isLive(row) {
    return this.openMs !== null && row[ROW.emit_ns] / 1e6 >= this.openMs + this.offsetMs;
  }
}

async function readArm(key, runIndex, signal) {
  const pane = panes[key];
  const offsetMs = page.clock ? page.clock.offsetMs : 0;
  const rows = (page.current[key] = []);
  pane.reset("connecting");
  const rec = await readOwnStream(ARMS[key].Sub, page.config.body, {
    signal,
    timeoutMs: TIMEOUT_MS,
    onStream: (stream) => {
      debug.streams.push({ run: runIndex, arm: key, api: ARMS[key].api, id: stream.id });
      pane.setStream(stream.id);
    },
    onState: (s) => pane.setState(s),
    onChunk: (row, text) => {
      if (!text) return;
      rows.push(row);
      pane.append(text, latencyMs(row, offsetMs));
      scheduleLive();
    },
  });
  if (rec.streamId === null && rec.error) throw rec.error; // the POST failed: the batch stops, the banner says why
  const run = new ArmRun(rec, offsetMs);
  if (rec.error) pane.fail(rec.error);
  else pane.setState(rec.reason);
  return run;
}

/** Run `index`: the arms read a stream each, one after the other; A first in even runs, B first in odd ones. */
async function runOnce(index, total, signal) {
  const order = index % 2 === 0 ? ["A", "B"] : ["B", "A"];
  const run = { order, A: null, B: null, identical: null };
  for (const key of KEYS) {
    panes[key].reset(key === order[0] ? "next" : "waiting");
    page.current[key] = [];
  }
  drawTimeline();
  for (const key of order) {
    if (signal.aborted) break;
    els.progress.textContent = `run ${index + 1} / ${total}: ${ARMS[key].name} reads stream ${order.indexOf(key) + 1}`
      + " of 2";
    run[key] = await readArm(key, index, signal);
    drawTimeline();
  }
  for (const key of KEYS) if (!run[key]) panes[key].setState("stopped");
  if (run.A && run.B && run.A.ok && run.B.ok) run.identical = run.A.text === run.B.text;
  return run;
}

let liveScheduled = false;
function scheduleLive() {
  if (liveScheduled) return;
  liveScheduled = true;
  requestAnimationFrame(() => {
    liveScheduled = false;
    for (const pane of Object.values(panes)) pane.showLive();
    drawTimeline();
  });
}

// -- metrics (tokenfan_bench/stats/metrics.py definitions) ---------------------------------------------

function gaps(times) {
  const out = [];
  for (let i = 1; i < times.length; i++) out.push(times[i] - times[i - 1]);
  return out;
}

/** Every ArmRun of one arm so far (a stopped run may lack its second arm). */
function armRuns(key) {
  return page.runs.map((r) => r[key]).filter(Boolean);
}

/** Live, per stream: delivery latencies and the stream index of each (the bootstrap's clusters). */
function deliveries(key) {
  const values = [];
  const streams = [];
  armRuns(key).forEach((r, i) => {
    for (const e of r.events) {
      if (!r.isLive(e)) continue;
      values.push(r.latency(e));
      streams.push(i);
    }
  });
  return { values, streams };
}

function ttfts(key) {
  return armRuns(key).filter((r) => r.events.length).map((r) => r.events[0][ROW.recv_ms] - r.postMs);
}

/** One arm's metrics over all runs, keys as `tokenfan bench` arm_metrics(). */
function armMetrics(key) {
  const recs = armRuns(key);
  const content = recs.flatMap((r) => r.events);
  const errors = recs.filter((r) => r.error).map((r) => describeError(r.error));
  const tps = recs.map((r) => {
    const deltas = r.events.reduce((n, e) => n + e[ROW.deltas], 0);
    const span = r.events.length ? (r.events[r.events.length - 1][ROW.recv_ms] - r.events[0][ROW.recv_ms]) / 1000 : 0;
    return deltas >= 2 && span > 0 ? (deltas - 1) / span : null;
  }).filter((v) => v !== null);
  return {
    transport: ARMS[key].transport,
    api: ARMS[key].name,
    subscribers: recs.length,
    errors: recs.filter((r) => !r.ok).length,
    error_examples: [...new Set(errors)].slice(0, 5),
    events: recs.reduce((n, r) => n + r.rows.length, 0),
    content_events: content.length,
    deltas_delivered: content.reduce((n, e) => n + e[ROW.deltas], 0),
    coalesced_events: content.filter((e) => e[ROW.deltas] > 1).length,
    live_content_events: recs.reduce((n, r) => n + r.events.filter((e) => r.isLive(e)).length, 0),
    deliveries_per_s: page.wallS > 0 ? content.length / page.wallS : null,
    ttft_ms: summarize(ttfts(key)),
    itl_ms: summarize(recs.flatMap((r) => gaps(r.events.map((e) => e[ROW.recv_ms])))),
    e2e_ms: summarize(recs.filter((r) => r.ok && r.lastChunkMs !== null).map((r) => r.lastChunkMs - r.postMs)),
    delivery_ms: summarize(deliveries(key).values),
    engine_to_gateway_ms: summarize(splitLatency(recs, "engine")),
    gateway_to_client_ms: summarize(splitLatency(recs, "client")),
    tokens_per_s: summarize(tps),
  };
}

/** Delivery latency split at the gateway's publish stamp (live, uncoalesced events), as the bench does. */
function splitLatency(recs, part) {
  return recs.flatMap((r) => r.events.filter((e) => e[ROW.deltas] === 1 && r.isLive(e)).map((e) => {
    const engineToGateway = (e[ROW.sent_ns] - e[ROW.emit_ns]) / 1e6; // both stamped on the server's clock
    return part === "engine" ? engineToGateway : r.latency(e) - engineToGateway;
  }));
}

/** B − A: differences of the arms' medians (delivery latency and TTFT), unpaired. */
function differences() {
  const a = deliveries("A");
  const b = deliveries("B");
  const opts = { ...BOOTSTRAP, floorMs: TIMER_FLOOR_MS };
  return {
    delivery: unpairedMedianDiff(a.values, a.streams, b.values, b.streams, opts),
    ttft: unpairedMedianDiff(ttfts("A"), null, ttfts("B"), null, opts),
  };
}

// -- rendering --------------------------------------------------------------------------------

function drawTimeline() {
  const series = [];
  let yMax = 1;
  let xMax = 1;
  const offsetMs = page.clock ? page.clock.offsetMs : 0;
  for (const key of KEYS) {
    const pts = page.current[key].map((e) => [e[ROW.seq], latencyMs(e, offsetMs)]);
    for (const [x, y] of pts) {
      xMax = Math.max(xMax, x);
      yMax = Math.max(yMax, y);
    }
    const color = ARMS[key].color;
    series.push({ color, points: pts, style: "line" }, { color, points: pts, style: "dots" });
  }
  timelineChart.set(series, { xMax, yMax: yMax * 1.1 });
}

function drawCdf() {
  const perArm = KEYS.map((key) => [key, deliveries(key).values]);
  const all = perArm.flatMap(([, d]) => d);
  if (!all.length) return;
  const xMax = quantileSorted(sorted(all), 0.995) * 1.1 || 1;
  cdfChart.set(perArm.map(([key, d]) => ({ color: ARMS[key].color, points: ecdf(d), style: "step" })),
    { xMax, yMax: 1 });
}

function describeDiff(d, unit) {
  if (d.median === null) return `– (needs ${unit} from both arms)`;
  return `${signed(d.median)} ms (95% CI ${signed(d.ci95[0])} … ${signed(d.ci95[1])}; ${d.method};`
    + ` at least ${d.n} ${unit} per arm, ×${d.n_boot})`;
}

function renderTable(arms, diffs) {
  for (const [key, m] of Object.entries(arms)) {
    const d = m.delivery_ms;
    const values = [String(m.subscribers), String(d.n), ms(d.p50), ms(d.p90), ms(d.p99), ms(d.mean),
      ms(m.ttft_ms.p50, 1), ms(m.itl_ms.p50), String(m.errors)];
    $(`#summary tr[data-arm="${key}"]`).querySelectorAll("td").forEach((cell, i) => (cell.textContent = values[i]));
  }
  els.diff.textContent = describeDiff(diffs.delivery, "tokens");
  els.ttftDiff.textContent = describeDiff(diffs.ttft, "streams");
}

function renderVerdict() {
  const judged = page.runs.filter((r) => r.identical !== null);
  const differ = judged.filter((r) => !r.identical).length;
  debug.identical = judged.length ? differ === 0 : null;
  els.verdict.dataset.identical = judged.length ? String(differ === 0) : "";
  if (!judged.length) {
    els.verdict.textContent = "Texts of the two streams identical: – (no run where both arms completed)";
  } else if (!differ) {
    els.verdict.textContent = `✓ The two streams' texts are identical in ${judged.length} of ${judged.length} runs`;
  } else {
    const { temperature, seed } = page.config;
    const why = temperature > 0 && seed === null
      ? "temperature > 0 without a seed: each stream samples on its own, so the two arms read different"
        + " generations (set a seed to compare the same text)"
      : "same request, yet the engine generated different texts";
    els.verdict.textContent = `✗ The two streams' texts differ in ${differ} of ${judged.length} runs: ${why}`;
  }
}

function refresh() {
  page.wallS = (epochMs() - page.startedMs) / 1000;
  const arms = Object.fromEntries(KEYS.map((key) => [key, armMetrics(key)]));
  const diffs = differences();
  renderTable(arms, diffs);
  renderVerdict();
  drawCdf();
  return { arms, diffs };
}

// -- batch, export -----------------------------------------------------------------------------

/** One record per stream, as bencharm.js returns them (tokenfan_bench/clients/browser.py samples() reads them). */
function records() {
  return page.runs.flatMap((run, i) => run.order.filter((key) => run[key]).map((key) => {
    const r = run[key];
    const error = r.error ? describeError(r.error) : r.reason !== "done" ? `ended: ${r.reason}` : null;
    return { arm: ARMS[key].index, key, api: ARMS[key].api, run: i, position: run.order.indexOf(key),
      stream: 2 * i + ARMS[key].index, stream_id: r.streamId, seed: page.config.seed, postMs: r.postMs,
      openMs: r.openMs, rows: r.rows, text: r.text, reason: r.reason, error, reconnects: r.reconnects };
  }));
}

/** The batch in the shape of a `tokenfan bench` run result (keys the bench report reads). */
function result({ arms, diffs }) {
  const c = page.clock;
  const events = Object.values(arms).reduce((n, a) => n + a.content_events, 0);
  const recs = records();
  return {
    streams: recs.length,
    runs: page.runs.length,
    max_tokens: page.config.maxTokens,
    separate_streams: true,
    wall_s: page.wallS,
    arms,
    diff_ms: diffs.delivery,
    ttft_diff_ms: diffs.ttft,
    server: { url: location.origin, cpu_s: null, deliveries_per_s: page.wallS > 0 ? events / page.wallS : null },
    row_fields: ROW_FIELDS,
    records: recs,
    meta: {
      command: ["tokenfan-web", "/ab", `--runs=${page.config.runs}`, `--max-tokens=${page.config.maxTokens}`],
      source: "browser A/B page (/ab): one stream per API, read one after the other, unpaired",
      time: new Date().toISOString().replace(/\.\d+Z$/, "Z"),
      seed: BOOTSTRAP.seed,
      versions: { python: null, browser: navigator.userAgent },
      machine: { platform: navigator.platform, cpus: navigator.hardwareConcurrency, cpu_model: null },
      url: location.origin,
      net: pageParam("net", "") || "direct",
      model: page.model,
      request: page.config.body,
      prompt: page.config.prompt,
      temperature: page.config.temperature,
      generation_seed: page.config.seed,
      runs_requested: page.config.runs,
      texts_identical: debug.identical,
      clock: c && { offset_ms: c.offsetMs, uncertainty_ms: c.uncertaintyMs, rtt_ms: c.rttMs, pings: c.samples },
      per_run: page.runs.map((run) => ({
        order: run.order, identical: run.identical,
        ...Object.fromEntries(KEYS.filter((k) => run[k]).map((k) => [k, {
          api: ARMS[k].api, stream_id: run[k].streamId, content_events: run[k].events.length, reason: run[k].reason,
          error: run[k].error && describeError(run[k].error), reconnects: run[k].reconnects,
        }])),
      })),
    },
  };
}

function setRunning(running) {
  page.running = running;
  els.start.disabled = running;
  els.stop.disabled = !running;
  debug.state = running ? "running" : "idle";
}

function readConfig() {
  const cfg = {
    prompt: els.prompt.value.trim(),
    maxTokens: Number(els.maxTokens.value) || 64,
    temperature: Number(els.temperature.value),
    seed: els.seed.value.trim() === "" ? null : Math.trunc(Number(els.seed.value)),
    runs: Math.max(1, Number(els.runs.value) || 1),
  };
  // One body for every stream of the batch: both arms' requests are the same bytes.
  cfg.body = { endpoint: "chat.completions", model: page.model ?? undefined, max_tokens: cfg.maxTokens,
    temperature: cfg.temperature, messages: [{ role: "user", content: cfg.prompt }] };
  if (cfg.seed !== null) cfg.body.seed = cfg.seed;
  return cfg;
}

async function startBatch() {
  if (page.running || !els.prompt.value.trim()) return;
  els.banner.hidden = true;
  page.runs = [];
  page.abort = new AbortController();
  const { signal } = page.abort;
  debug.result = null;
  debug.streams = [];
  let summary = null;
  setRunning(true);
  try {
    if (page.model === null) await loadModel();
    page.config = readConfig();
    await syncClock();
    page.startedMs = epochMs();
    for (let i = 0; i < page.config.runs && !signal.aborted; i++) {
      page.runs.push(await runOnce(i, page.config.runs, signal));
      debug.runs = page.runs.length;
      summary = refresh();
    }
    els.progress.textContent = signal.aborted ? `stopped after ${page.runs.length} runs`
      : `done: ${page.runs.length} runs`;
  } catch (err) {
    showBanner(describeError(err));
    debug.errors.push(describeError(err));
    els.progress.textContent = "failed";
  } finally {
    if (summary) {
      debug.result = result(summary);
      els.exportBtn.disabled = false;
    }
    setRunning(false);
  }
}

function stopBatch() {
  if (page.running) page.abort.abort();
}

function exportJSON() {
  if (!debug.result) return;
  const blob = new Blob([JSON.stringify(debug.result, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `tokenfan-ab-${debug.result.meta.time.replace(/[:]/g, "-")}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function loadModel() {
  return getModelId().then(
    (id) => {
      page.model = id;
      els.model.textContent = id;
      els.banner.hidden = true;
    },
    (err) => {
      els.model.textContent = "unavailable";
      showBanner(describeError(err));
    },
  );
}

els.form.addEventListener("submit", (e) => {
  e.preventDefault();
  startBatch();
});
els.stop.addEventListener("click", stopBatch);
els.exportBtn.addEventListener("click", exportJSON);
els.resync.addEventListener("click", syncClock);
els.apiKey.value = apiKey();
els.apiKey.addEventListener("change", () => {
  setApiKey(els.apiKey.value.trim());
  loadModel();
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") stopBatch();
});

// -- network profiles -------------------------------------------------------------------------
// `tokenfan bench net --url GATEWAY` serves this page through one shaping proxy per profile (the bench's own,
// tokenfan_bench/network/shaping_proxy.py) and links here with ?net=NAME&routes=NAME:PORT,…; picking a profile reopens the
// page on that profile's port, so every connection of the page (and of the A/B run) takes that path.

function setupProfiles() {
  const routes = pageParam("routes", "");
  const current = pageParam("net", "");
  const pairs = routes.split(",").map((r) => r.split(":")).filter((r) => r.length === 2 && /^\d+$/.test(r[1]));
  if (!pairs.length) {
    els.net.disabled = true;
    els.net.title = "Start `tokenfan bench net --url <this gateway>` to watch the A/B under network profiles";
    return;
  }
  els.net.replaceChildren(...pairs.map(([name, port]) => {
    const opt = document.createElement("option");
    opt.value = port;
    opt.textContent = name;
    opt.selected = name === current;
    return opt;
  }));
  els.net.addEventListener("change", () => {
    const opt = els.net.selectedOptions[0];
    const url = new URL(location.href);
    url.port = opt.value;
    url.searchParams.set("net", opt.textContent);
    location.assign(url.toString());
  });
}

setupProfiles();
loadModel();
syncClock();
