// The A/B page: one fan-out stream, an EventSource subscriber (A) and a WebSocket subscriber (B)
// side by side, with per-token delivery latency measured in the browser.
//
// Definitions follow `tokenfan bench` (gateway/bench/stats.py), so an export from this page and a
// bench result read the same way:
// - delivery latency = browser receive time + clock offset − engine emit time, per *live* content
//   event (emitted after that subscriber connected; the first events after POST /v1/streams are
//   otherwise a replay and would measure the join delay). The receive time is
//   performance.timeOrigin + performance.now() taken before parsing; the emit time is the chunk's
//   `tokenfan.emit_ns`; the offset comes from NTP-style `GET /v1/time` pings.
// - TTFT: POST /v1/streams → first content event; ITL: gaps between successive content events;
//   E2E: POST → last chunk; tokens/s: (deltas − 1) / (last − first content event).
// - B − A: the median of paired differences recv_B − recv_A of the same token (live in both arms,
//   not coalesced). Both subscribers watch the same stream, so engine and gateway jitter and the
//   clock offset cancel. 95% CI by bootstrap (stream clusters once there are enough runs).

import { apiKey, createStream, describeError, epochMs, getModelId, pageParam, setApiKey } from "./api.js";
import { Chart } from "./chart.js";
import { estimateOffset } from "./clock.js";
import { ecdf, pairedMedianDiff, quantileSorted, sorted, summarize } from "./stats.js";
import { EventSourceSubscription, WebSocketSubscription } from "./transports.js";

const $ = (sel, root = document) => root.querySelector(sel);

const ARMS = {
  A: { transport: "sse", Sub: EventSourceSubscription, color: "--a" },
  B: { transport: "ws", Sub: WebSocketSubscription, color: "--b" },
};
const TIMEOUT_MS = Number(pageParam("timeout_ms", 30000));
const BOOTSTRAP = { resamples: 1000, seed: 1 };

const els = {
  model: $("#model"), banner: $("#banner"), form: $("#controls"), prompt: $("#prompt"),
  maxTokens: $("#max-tokens"), temperature: $("#temperature"), runs: $("#runs"), apiKey: $("#api-key"),
  start: $("#start"), stop: $("#stop"), exportBtn: $("#export"), clock: $("#clock"), resync: $("#resync"),
  progress: $("#progress"), verdict: $("#verdict"), diff: $("#diff"), net: $("#net"),
};
const cdfChart = new Chart($("#cdf"), { xLabel: "delivery latency (ms)", yLabel: "fraction" });
const timelineChart = new Chart($("#timeline"), { xLabel: "token (seq)", yLabel: "latency (ms)" });

const page = {
  model: null,
  clock: null, // {offsetMs, uncertaintyMs, rttMs, samples}: server clock = browser clock + offsetMs
  running: false,
  stopRequested: false,
  subs: [], // subscriptions of the current run
  runs: [], // per run: {stream_id, identical, A: SubscriberRecord, B: SubscriberRecord}
  config: null,
  startedMs: 0,
  wallS: 0,
};
const debug = (window.__tokenfan = { page: "ab", state: "idle", runs: 0, identical: null, result: null, errors: [] });

function showBanner(text) {
  els.banner.textContent = text;
  els.banner.hidden = false;
}

function ms(v, digits = 2) {
  return v === null || v === undefined || !Number.isFinite(v) ? "–" : v.toFixed(digits);
}

// -- clock ----------------------------------------------------------------------------------

async function syncClock() {
  els.clock.textContent = "measuring…";
  try {
    page.clock = await estimateOffset(8);
    const c = page.clock;
    els.clock.textContent = `${c.offsetMs >= 0 ? "+" : ""}${c.offsetMs.toFixed(3)} ms ± ${c.uncertaintyMs.toFixed(3)} ms`
      + ` (min RTT ${c.rttMs.toFixed(3)} ms of ${c.samples} pings)`;
  } catch (err) {
    page.clock = null;
    els.clock.textContent = "unavailable";
    showBanner(describeError(err));
  }
}

// -- one subscriber in one run --------------------------------------------------------------

/** What one arm's subscriber saw in one run: raw samples, turned into metrics later. */
class SubscriberRecord {
  constructor(key, postMs, offsetMs) {
    this.key = key;
    this.postMs = postMs;
    this.offsetMs = offsetMs;
    this.events = []; // content events: {seq, emitMs, recvMs, deltas}
    this.chunks = 0;
    this.lastChunkMs = null;
    this.text = "";
    this.error = null;
    this.reason = null;
    this.sub = null;
    this.pane = $(`#pane-${key}`);
    this.textNode = document.createTextNode("");
    $(".text", this.pane).replaceChildren(this.textNode);
    $(".error", this.pane).hidden = true;
    this.pane.dataset.state = "connecting";
  }

  onChunk(chunk, recvMs) {
    this.chunks += 1;
    this.lastChunkMs = recvMs;
    const choice = chunk.choices && chunk.choices[0];
    const piece = choice ? (choice.delta ? choice.delta.content : choice.text) || "" : "";
    if (!piece) return;
    const tf = chunk.tokenfan;
    this.events.push({ seq: tf.seq, emitMs: tf.emit_ns / 1e6, sentMs: tf.sent_ns / 1e6, recvMs,
      deltas: tf.coalesced || 1 });
    this.text += piece;
    this.textNode.appendData(piece);
  }

  get ok() {
    return this.error === null && this.reason === "done";
  }

  /** Server-clock time the subscriber connected (null if it never did). */
  get connectedMs() {
    return this.sub.openMs === null ? null : this.sub.openMs + this.offsetMs;
  }

  latency(e) {
    return e.recvMs + this.offsetMs - e.emitMs;
  }

  isLive(e) {
    return this.connectedMs !== null && e.emitMs >= this.connectedMs;
  }

  fail(err) {
    this.error = err;
    const box = $(".error", this.pane);
    box.textContent = describeError(err);
    box.hidden = false;
    this.pane.dataset.state = "error";
  }

  showLive() {
    const lat = this.events.map((e) => this.latency(e));
    const last = lat.length ? lat[lat.length - 1] : null;
    $(".live", this.pane).textContent = `${this.pane.dataset.state} · ${this.events.length} chunks`
      + ` · last ${ms(last)} ms · p50 ${ms(quantileSorted(sorted(lat), 0.5))} ms`;
  }
}

async function runOnce(index, total) {
  const cfg = page.config;
  const offset = page.clock ? page.clock.offsetMs : 0;
  els.progress.textContent = `run ${index + 1} / ${total}`;
  const postMs = epochMs();
  const stream = await createStream({
    endpoint: "chat.completions", model: page.model ?? undefined, max_tokens: cfg.maxTokens,
    temperature: cfg.temperature, messages: [{ role: "user", content: cfg.prompt }],
  });
  const recs = {};
  page.subs = [];
  for (const [key, arm] of Object.entries(ARMS)) {
    const rec = (recs[key] = new SubscriberRecord(key, postMs, offset));
    rec.sub = new arm.Sub({
      timeoutMs: TIMEOUT_MS,
      onChunk: (chunk, recvMs) => {
        rec.onChunk(chunk, recvMs);
        scheduleLive(recs);
      },
      onState: (s) => {
        rec.pane.dataset.state = s;
        rec.showLive();
      },
    });
    page.subs.push(rec.sub);
    rec.sub.subscribe(stream);
  }
  await Promise.all(Object.values(recs).map((rec) => rec.sub.done.then(
    ({ reason }) => {
      rec.reason = reason;
      rec.pane.dataset.state = reason;
    },
    (err) => rec.fail(err),
  )));
  for (const rec of Object.values(recs)) rec.showLive();
  drawTimeline(recs);
  const complete = recs.A.ok && recs.B.ok;
  return { stream_id: stream.id, identical: complete ? recs.A.text === recs.B.text && recs.A.text !== "" : null,
    ...recs };
}

let liveScheduled = false;
function scheduleLive(recs) {
  if (liveScheduled) return;
  liveScheduled = true;
  requestAnimationFrame(() => {
    liveScheduled = false;
    for (const rec of Object.values(recs)) rec.showLive();
    drawTimeline(recs);
  });
}

// -- metrics (gateway/bench/stats.py definitions) ---------------------------------------------

function gaps(times) {
  const out = [];
  for (let i = 1; i < times.length; i++) out.push(times[i] - times[i - 1]);
  return out;
}

/** One arm's metrics over all runs, keys as `tokenfan bench` arm_metrics(). */
function armMetrics(key) {
  const recs = page.runs.map((r) => r[key]);
  const content = recs.flatMap((r) => r.events);
  const errors = recs.filter((r) => r.error).map((r) => describeError(r.error));
  const tps = recs.map((r) => {
    const deltas = r.events.reduce((n, e) => n + e.deltas, 0);
    const span = r.events.length ? (r.events[r.events.length - 1].recvMs - r.events[0].recvMs) / 1000 : 0;
    return deltas >= 2 && span > 0 ? (deltas - 1) / span : null;
  }).filter((v) => v !== null);
  return {
    transport: ARMS[key].transport,
    subscribers: recs.length,
    errors: recs.filter((r) => !r.ok).length,
    error_examples: [...new Set(errors)].slice(0, 5),
    events: recs.reduce((n, r) => n + r.chunks, 0),
    content_events: content.length,
    deltas_delivered: content.reduce((n, e) => n + e.deltas, 0),
    coalesced_events: content.filter((e) => e.deltas > 1).length,
    live_content_events: recs.reduce((n, r) => n + r.events.filter((e) => r.isLive(e)).length, 0),
    deliveries_per_s: page.wallS > 0 ? content.length / page.wallS : null,
    ttft_ms: summarize(recs.filter((r) => r.events.length).map((r) => r.events[0].recvMs - r.postMs)),
    itl_ms: summarize(recs.flatMap((r) => gaps(r.events.map((e) => e.recvMs)))),
    e2e_ms: summarize(recs.filter((r) => r.ok && r.lastChunkMs !== null).map((r) => r.lastChunkMs - r.postMs)),
    delivery_ms: summarize(deliveries(key)),
    engine_to_gateway_ms: summarize(splitLatency(key, "engine")),
    gateway_to_client_ms: summarize(splitLatency(key, "client")),
    tokens_per_s: summarize(tps),
  };
}

function deliveries(key) {
  return page.runs.flatMap((run) => {
    const r = run[key];
    return r.events.filter((e) => r.isLive(e)).map((e) => r.latency(e));
  });
}

/** Delivery latency split at the gateway's publish stamp (live, uncoalesced events), as the bench does. */
function splitLatency(key, part) {
  return page.runs.flatMap((run) => {
    const r = run[key];
    return r.events.filter((e) => e.deltas === 1 && r.isLive(e)).map((e) => {
      const engineToGateway = e.sentMs - e.emitMs; // both stamped on the server's clock
      return part === "engine" ? engineToGateway : r.latency(e) - engineToGateway;
    });
  });
}

/**
 * recv_B − recv_A per token both arms received live and uncoalesced, averaged over each (even, odd)
 * pair of tokens: the gateway writes those two in opposite transport order, so the write-order
 * effect cancels (as in `tokenfan bench`). The interval is widened by the browser timer's resolution.
 */
function pairedDiffs() {
  const diffs = [];
  const streams = [];
  page.runs.forEach((run, i) => {
    const usable = (r) => new Map(r.events.filter((e) => e.deltas === 1 && r.isLive(e)).map((e) => [e.seq, e.recvMs]));
    const a = usable(run.A);
    const d = new Map();
    for (const [seq, recvB] of usable(run.B)) if (a.has(seq)) d.set(seq, recvB - a.get(seq));
    for (const [seq, v] of d) {
      if (seq % 2 === 0 && d.has(seq + 1)) {
        diffs.push((v + d.get(seq + 1)) / 2);
        streams.push(i);
      }
    }
  });
  // performance.now() is coarsened to 5 µs when cross-origin isolated (these pages are), else 100 µs.
  const floorMs = globalThis.crossOriginIsolated ? 0.005 : 0.1;
  return pairedMedianDiff(diffs, streams,
    { ...BOOTSTRAP, floorMs, method: "paired per token pair (write order balanced)" });
}

// -- rendering --------------------------------------------------------------------------------

function drawTimeline(recs) {
  const series = [];
  let yMax = 1;
  let xMax = 1;
  for (const [key, rec] of Object.entries(recs)) {
    const pts = rec.events.map((e) => [e.seq, rec.latency(e)]);
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
  const perArm = Object.keys(ARMS).map((key) => [key, deliveries(key)]);
  const all = perArm.flatMap(([, d]) => d);
  if (!all.length) return;
  const xMax = quantileSorted(sorted(all), 0.995) * 1.1 || 1;
  cdfChart.set(perArm.map(([key, d]) => ({ color: ARMS[key].color, points: ecdf(d), style: "step" })),
    { xMax, yMax: 1 });
}

function renderTable(arms, diff) {
  for (const [key, m] of Object.entries(arms)) {
    const d = m.delivery_ms;
    const values = [String(d.n), ms(d.p50), ms(d.p90), ms(d.p99), ms(d.mean), ms(m.ttft_ms.p50, 1),
      ms(m.itl_ms.p50), String(m.errors)];
    $(`#summary tr[data-arm="${key}"]`).querySelectorAll("td").forEach((cell, i) => (cell.textContent = values[i]));
  }
  els.diff.textContent = diff.median === null ? "– (no token received live by both arms)"
    : `${diff.median >= 0 ? "+" : ""}${ms(diff.median, 3)} ms (95% CI ${ms(diff.ci95[0], 3)} … ${ms(diff.ci95[1], 3)};`
      + ` ${diff.method}, ${diff.n} token pairs, ×${diff.n_boot})`;
}

function renderVerdict() {
  const judged = page.runs.filter((r) => r.identical !== null);
  const ok = judged.length > 0 && judged.every((r) => r.identical);
  debug.identical = judged.length ? ok : null;
  els.verdict.dataset.identical = judged.length ? String(ok) : "";
  els.verdict.textContent = judged.length === 0 ? "Texts identical: – (no complete run)"
    : ok ? `✓ Texts identical in ${judged.length} of ${judged.length} runs`
      : `✗ Texts differ in ${judged.filter((r) => !r.identical).length} of ${judged.length} runs`;
}

function refresh() {
  page.wallS = (epochMs() - page.startedMs) / 1000;
  const arms = Object.fromEntries(Object.keys(ARMS).map((key) => [key, armMetrics(key)]));
  const diff = pairedDiffs();
  renderTable(arms, diff);
  renderVerdict();
  drawCdf();
  return { arms, diff };
}

// -- batch, export -----------------------------------------------------------------------------

/** The batch in the shape of a `tokenfan bench` run result (keys the bench report reads). */
function result({ arms, diff }) {
  const c = page.clock;
  const events = Object.values(arms).reduce((n, a) => n + a.content_events, 0);
  return {
    streams: page.runs.length,
    max_tokens: page.config.maxTokens,
    separate_streams: false,
    wall_s: page.wallS,
    arms,
    diff_ms: diff,
    server: { url: location.origin, cpu_s: null, deliveries_per_s: page.wallS > 0 ? events / page.wallS : null },
    meta: {
      command: ["tokenfan-web", "/ab", `--runs=${page.config.runs}`, `--max-tokens=${page.config.maxTokens}`],
      source: "browser A/B page (/ab)",
      time: new Date().toISOString().replace(/\.\d+Z$/, "Z"),
      seed: BOOTSTRAP.seed,
      versions: { python: null, browser: navigator.userAgent },
      machine: { platform: navigator.platform, cpus: navigator.hardwareConcurrency, cpu_model: null },
      url: location.origin,
      model: page.model,
      prompt: page.config.prompt,
      temperature: page.config.temperature,
      runs_requested: page.config.runs,
      texts_identical: debug.identical,
      clock: c && { offset_ms: c.offsetMs, uncertainty_ms: c.uncertaintyMs, rtt_ms: c.rttMs, pings: c.samples },
      per_run: page.runs.map((run) => ({
        stream_id: run.stream_id, identical: run.identical,
        ...Object.fromEntries(Object.keys(ARMS).map((k) => [k, {
          content_events: run[k].events.length, reason: run[k].reason,
          error: run[k].error && describeError(run[k].error), reconnects: run[k].sub.reconnects,
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

async function startBatch() {
  if (page.running) return;
  page.config = {
    prompt: els.prompt.value.trim(),
    maxTokens: Number(els.maxTokens.value) || 64,
    temperature: Number(els.temperature.value),
    runs: Math.max(1, Number(els.runs.value) || 1),
  };
  if (!page.config.prompt) return;
  els.banner.hidden = true;
  page.runs = [];
  page.stopRequested = false;
  debug.result = null;
  let summary = null;
  setRunning(true);
  try {
    if (page.model === null) await loadModel();
    await syncClock();
    page.startedMs = epochMs();
    for (let i = 0; i < page.config.runs && !page.stopRequested; i++) {
      page.runs.push(await runOnce(i, page.config.runs));
      debug.runs = page.runs.length;
      summary = refresh();
    }
    els.progress.textContent = page.stopRequested ? `stopped after ${page.runs.length} runs`
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
  if (!page.running) return;
  page.stopRequested = true;
  for (const sub of page.subs) sub.stop();
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
// tokenfan_bench/netem.py) and links here with ?net=NAME&routes=NAME:PORT,…; picking a profile reopens the
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
