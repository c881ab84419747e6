// The A/B page: one fan-out stream, an EventSource subscriber (A) and a WebSocket subscriber (B)
// side by side, with per-token delivery latency measured in the browser.
//
// delivery latency = browser receive time + clock offset − engine emit time, where the receive
// time is performance.timeOrigin + performance.now() taken before parsing, the emit time is the
// chunk's `tokenfan.emit_ns`, and the offset comes from NTP-style `GET /v1/time` pings.
//
// Generation starts when the stream is created, before either subscriber is connected; the first
// events then arrive as a replay, not live. Delivery and inter-token statistics therefore only use
// events the gateway published after *both* subscribers were open, so both arms are measured on
// the same tokens. TTFT (stream creation → first content event) includes the connection setup.

import { apiKey, createStream, describeError, epochMs, getModelId, pageParam, setApiKey } from "./api.js";
import { Chart } from "./chart.js";
import { estimateOffset } from "./clock.js";
import { bootstrapMedianDiff, ecdf, quantileSorted, sorted, summarize } from "./stats.js";
import { EventSourceSubscription, WebSocketSubscription } from "./transports.js";

const $ = (sel, root = document) => root.querySelector(sel);

const ARMS = {
  A: { transport: "sse", label: "EventSource (SSE)", Sub: EventSourceSubscription, color: "--a" },
  B: { transport: "ws", label: "WebSocket", Sub: WebSocketSubscription, color: "--b" },
};
const TIMEOUT_MS = Number(pageParam("timeout_ms", 30000));
const BOOTSTRAP = { resamples: 1000, seed: 1 };

const els = {
  model: $("#model"), banner: $("#banner"), form: $("#controls"), prompt: $("#prompt"),
  maxTokens: $("#max-tokens"), temperature: $("#temperature"), runs: $("#runs"), apiKey: $("#api-key"),
  start: $("#start"), stop: $("#stop"), exportBtn: $("#export"), clock: $("#clock"), resync: $("#resync"),
  progress: $("#progress"), verdict: $("#verdict"), diff: $("#diff"),
};
const cdfChart = new Chart($("#cdf"), { xLabel: "delivery latency (ms)", yLabel: "fraction" });
const timelineChart = new Chart($("#timeline"), { xLabel: "token (seq)", yLabel: "latency (ms)" });

const page = {
  model: null,
  clock: null, // {offsetMs, uncertaintyMs, rttMs, samples}
  running: false,
  stopRequested: false,
  subs: [], // subscriptions of the current run
  pooled: null, // per arm, samples over all completed runs of this batch
  runs: [], // per run: {identical, reason, A: {...}, B: {...}}
  config: null,
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

// -- one run ----------------------------------------------------------------------------------

function emptyPooled() {
  return Object.fromEntries(Object.keys(ARMS).map((k) => [k, { delivery: [], ttft: [], itl: [], errors: 0 }]));
}

/** What one arm saw in one run. */
class ArmRun {
  constructor(key, t0) {
    this.key = key;
    this.t0 = t0;
    this.events = []; // content events: {seq, emitMs, sentMs, recvMs}
    this.text = "";
    this.error = null;
    this.reason = null;
    this.pane = $(`#pane-${key}`);
    this.textNode = document.createTextNode("");
    $(".text", this.pane).replaceChildren(this.textNode);
    $(".error", this.pane).hidden = true;
    this.pane.dataset.state = "connecting";
  }

  onChunk(chunk, recvMs) {
    const choice = chunk.choices && chunk.choices[0];
    const piece = choice ? (choice.delta ? choice.delta.content : choice.text) || "" : "";
    if (!piece) return;
    const tf = chunk.tokenfan;
    this.events.push({ seq: tf.seq, emitMs: tf.emit_ns / 1e6, sentMs: tf.sent_ns / 1e6, recvMs });
    this.text += piece;
    this.textNode.appendData(piece);
  }

  /** Latency of each event in ms (server clock). */
  latencies(offsetMs) {
    return this.events.map((e) => e.recvMs + offsetMs - e.emitMs);
  }

  fail(err) {
    this.error = err;
    const box = $(".error", this.pane);
    box.textContent = describeError(err);
    box.hidden = false;
    this.pane.dataset.state = "error";
  }

  live(offsetMs) {
    const state = this.pane.dataset.state;
    const lat = this.latencies(offsetMs);
    const last = lat.length ? lat[lat.length - 1] : null;
    $(".live", this.pane).textContent = `${state} · ${this.events.length} chunks · last ${ms(last)} ms`
      + ` · p50 ${ms(quantileSorted(sorted(lat), 0.5))} ms`;
  }
}

async function runOnce(index, total) {
  const cfg = page.config;
  const offset = page.clock ? page.clock.offsetMs : 0;
  els.progress.textContent = `run ${index + 1} / ${total}`;
  const t0 = epochMs();
  const stream = await createStream({
    endpoint: "chat.completions", model: page.model ?? undefined, max_tokens: cfg.maxTokens,
    temperature: cfg.temperature, messages: [{ role: "user", content: cfg.prompt }],
  });
  const arms = {};
  page.subs = [];
  for (const [key, arm] of Object.entries(ARMS)) {
    const run = (arms[key] = new ArmRun(key, t0));
    const sub = new arm.Sub({
      timeoutMs: TIMEOUT_MS,
      onChunk: (chunk, recvMs) => {
        run.onChunk(chunk, recvMs);
        scheduleLive(arms, offset);
      },
      onState: (s) => {
        run.pane.dataset.state = s;
        run.live(offset);
      },
    });
    run.sub = sub;
    page.subs.push(sub);
    sub.subscribe(stream);
  }
  await Promise.all(Object.values(arms).map((run) => run.sub.done.then(
    ({ reason }) => {
      run.reason = reason;
      run.pane.dataset.state = reason;
    },
    (err) => run.fail(err),
  )));
  for (const run of Object.values(arms)) run.live(offset);
  drawTimeline(arms, offset);
  return record(arms, offset, stream.id);
}

let liveScheduled = false;
function scheduleLive(arms, offset) {
  if (liveScheduled) return;
  liveScheduled = true;
  requestAnimationFrame(() => {
    liveScheduled = false;
    for (const run of Object.values(arms)) run.live(offset);
    drawTimeline(arms, offset);
  });
}

/** Pool this run's samples (live tokens only) and return the run's record. */
function record(arms, offset, streamId) {
  const opens = Object.values(arms).map((r) => r.sub.openMs).filter((v) => v !== null);
  // Server-clock time after which every subscriber was connected: events published later are live.
  const liveFromMs = opens.length ? Math.max(...opens) + offset : -Infinity;
  const out = { stream_id: streamId, live_from_ms: liveFromMs };
  for (const [key, run] of Object.entries(arms)) {
    const pool = page.pooled[key];
    const live = run.events.filter((e) => e.sentMs >= liveFromMs);
    pool.delivery.push(...live.map((e) => e.recvMs + offset - e.emitMs));
    for (let i = 1; i < live.length; i++) pool.itl.push(live[i].recvMs - live[i - 1].recvMs);
    if (run.events.length) pool.ttft.push(run.events[0].recvMs - run.t0);
    if (run.error) pool.errors += 1;
    out[key] = { tokens: run.events.length, live_tokens: live.length, reason: run.reason,
      error: run.error ? describeError(run.error) : null, reconnects: run.sub.reconnects,
      duplicates: run.sub.duplicates, text: run.text };
  }
  const complete = arms.A.reason === "done" && arms.B.reason === "done";
  out.identical = complete ? arms.A.text === arms.B.text && arms.A.text.length > 0 : null;
  return out;
}

// -- rendering --------------------------------------------------------------------------------

function drawTimeline(arms, offset) {
  const series = [];
  let yMax = 1;
  let xMax = 1;
  for (const [key, run] of Object.entries(arms)) {
    const lat = run.latencies(offset);
    const pts = run.events.map((e, i) => [e.seq, lat[i]]);
    for (const [x, y] of pts) {
      xMax = Math.max(xMax, x);
      yMax = Math.max(yMax, y);
    }
    series.push({ color: ARMS[key].color, points: pts, style: "line" }, { color: ARMS[key].color, points: pts, style: "dots" });
  }
  timelineChart.set(series, { xMax, yMax: yMax * 1.1 });
}

function drawCdf() {
  const all = Object.values(page.pooled).flatMap((p) => p.delivery);
  if (!all.length) return;
  const xMax = quantileSorted(sorted(all), 0.995) * 1.1 || 1;
  cdfChart.set(Object.entries(page.pooled).map(([key, p]) => ({
    color: ARMS[key].color, points: ecdf(p.delivery), style: "step",
  })), { xMax, yMax: 1 });
}

function renderTable() {
  for (const [key, p] of Object.entries(page.pooled)) {
    const d = summarize(p.delivery);
    const cells = $(`#summary tr[data-arm="${key}"]`).querySelectorAll("td");
    const values = [String(d.n), ms(d.p50), ms(d.p90), ms(d.p99), ms(d.mean), ms(summarize(p.ttft).p50, 1),
      ms(summarize(p.itl).p50), String(p.errors)];
    values.forEach((v, i) => (cells[i].textContent = v));
  }
  const diff = bootstrapMedianDiff(page.pooled.A.delivery, page.pooled.B.delivery, BOOTSTRAP);
  els.diff.textContent = diff.median === null ? "–"
    : `${diff.median >= 0 ? "+" : ""}${ms(diff.median, 3)} ms (95% CI ${ms(diff.ci95[0], 3)} … ${ms(diff.ci95[1], 3)},`
      + ` bootstrap ×${diff.resamples})`;
  return diff;
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

// -- batch, export -----------------------------------------------------------------------------

function result() {
  const diff = bootstrapMedianDiff(page.pooled.A.delivery, page.pooled.B.delivery, BOOTSTRAP);
  const arms = {};
  for (const [key, arm] of Object.entries(ARMS)) {
    const p = page.pooled[key];
    arms[key] = { transport: arm.transport, metrics: {
      delivery_ms: summarize(p.delivery), ttft_ms: summarize(p.ttft), itl_ms: summarize(p.itl), errors: p.errors,
    } };
  }
  const c = page.clock;
  return {
    arms,
    diff_ms: { median: diff.median, ci95: diff.ci95 },
    meta: {
      source: "tokenfan web /ab",
      created: new Date().toISOString(),
      gateway: location.origin,
      model: page.model,
      prompt: page.config.prompt,
      max_tokens: page.config.maxTokens,
      temperature: page.config.temperature,
      runs: page.runs.length,
      runs_requested: page.config.runs,
      texts_identical: debug.identical,
      clock: c && { offset_ms: c.offsetMs, uncertainty_ms: c.uncertaintyMs, rtt_ms: c.rttMs, pings: c.samples },
      delivery: "browser receive (performance.timeOrigin + now) + clock offset − engine emit_ns; live tokens only",
      bootstrap: BOOTSTRAP,
      user_agent: navigator.userAgent,
      per_run: page.runs.map(({ stream_id, identical, A, B }) => ({
        stream_id, identical,
        A: { tokens: A.tokens, live_tokens: A.live_tokens, reason: A.reason, error: A.error, reconnects: A.reconnects },
        B: { tokens: B.tokens, live_tokens: B.live_tokens, reason: B.reason, error: B.error, reconnects: B.reconnects },
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
  page.pooled = emptyPooled();
  page.runs = [];
  page.stopRequested = false;
  debug.result = null;
  setRunning(true);
  try {
    if (page.model === null) await loadModel();
    await syncClock();
    for (let i = 0; i < page.config.runs && !page.stopRequested; i++) {
      page.runs.push(await runOnce(i, page.config.runs));
      debug.runs = page.runs.length;
      renderTable();
      renderVerdict();
      drawCdf();
    }
    els.progress.textContent = page.stopRequested ? `stopped after ${page.runs.length} runs`
      : `done: ${page.runs.length} runs`;
  } catch (err) {
    showBanner(describeError(err));
    debug.errors.push(describeError(err));
    els.progress.textContent = "failed";
  } finally {
    if (page.runs.length) {
      debug.result = result();
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
  const blob = new Blob([JSON.stringify(result(), null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `tokenfan-ab-${new Date().toISOString().replace(/[:.]/g, "-")}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

els.form.addEventListener("submit", (e) => {
  e.preventDefault();
  startBatch();
});
els.stop.addEventListener("click", stopBatch);
els.exportBtn.addEventListener("click", exportJSON);
els.resync.addEventListener("click", syncClock);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape") stopBatch();
});

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

els.apiKey.value = apiKey();
els.apiKey.addEventListener("change", () => {
  setApiKey(els.apiKey.value.trim());
  loadModel();
});
loadModel();
syncClock();
