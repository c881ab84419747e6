// The bench's browser arm (tokenfan_bench/clients/browser.py drives it through Playwright): `streams` slots
// each create `rounds` fan-out streams one after another, and every arm (or one, `separate`) subscribes to
// each stream from this page with the browser's own API: "es" EventSource, "fetch" a streamed fetch of the same
// events_url, "ws" WebSocket, "wt" WebTransport (webtransport.js; `cfg.wt` = {url, hash} of the gateway's
// --http3-port: one session for the page, a stream per subscription). Per chunk it keeps [seq, emit_ns, sent_ns, receive ms, deltas, content]
// (readstream.js, which the /ab page reads its streams with too) with the receive time taken first thing
// in the handler (performance.timeOrigin + performance.now()); the bench aligns that clock with the
// server's and computes the metrics as for its socket clients.
// `wsOrigins` (optional): slot i opens its WebSockets to wsOrigins[i] (another port of the shaping
// proxy): Chromium opens one WebSocket per host:port at a time, so on a slow path sockets sharing one
// port open one after another, after their streams have ended.
// `separate`: each stream is read by one arm only (dealt in shuffled blocks: see deal()), as a page reads a
// stream with one API. Two APIs reading the same token in one browser are not independent: on the
// bench's calibration, EventSource read 0.6 ms later when the WebSocket copy of its token arrived 1.5 ms
// before it than when it arrived after it (tokenfan_bench/clients/browser.py has the figures). Every stream
// of round r has seed r, so every arm's text can be compared for the same seed.

import { authHeaders, createStream, epochMs, samePath } from "./api.js";
import { readStream } from "./readstream.js";
import { SSEParser } from "./sse.js";
import { EventSourceSubscription, WebSocketSubscription } from "./transports.js";
import { WebTransportSubscription } from "./webtransport.js";

/** A fan-out stream read with fetch() and a ReadableStream reader (one stamp per read). */
class FetchSubscription {
  constructor({ onChunk, timeoutMs = 30000 }) {
    this.onChunk = onChunk;
    this.timeoutMs = timeoutMs;
    this.openMs = null;
    this.done = new Promise((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
  }

  subscribe(stream) {
    this.read(stream).then((reason) => this.resolve({ reason }), (err) => this.reject(err));
  }

  async read(stream) {
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), this.timeoutMs);
    try {
      const resp = await fetch(samePath(stream.events_url), { headers: authHeaders(), signal: ctrl.signal });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      this.openMs = epochMs();
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let recvMs = 0;
      let finished = false;
      const parser = new SSEParser((ev) => {
        if (ev.data === "[DONE]") finished = true;
        else if (!ev.event || ev.event === "message") this.onChunk(JSON.parse(ev.data), recvMs);
      });
      while (!finished) {
        const { value, done } = await reader.read();
        recvMs = epochMs();
        if (done) throw new Error("the stream ended before [DONE]");
        parser.feed(decoder.decode(value, { stream: true }));
      }
      ctrl.abort(); // the response is complete: release the connection's stream
      return "done";
    } finally {
      clearTimeout(timer);
    }
  }
}

const SUBSCRIPTIONS = { es: EventSourceSubscription, fetch: FetchSubscription, ws: WebSocketSubscription,
  wt: WebTransportSubscription };
let wtEndpoint; // cfg.wt of the current run

async function subscribeOne(arm, index, stream, id, seed, postMs, timeoutMs, wsOrigin) {
  const origin = arm === "ws" ? wsOrigin : arm === "wt" ? wtEndpoint : undefined;
  const r = await readStream(SUBSCRIPTIONS[arm], stream, { timeoutMs, origin });
  const error = r.error ? String(r.error.message || r.error) : r.reason !== "done" ? `ended: ${r.reason}` : null;
  return { arm: index, stream: id, seed, postMs, openMs: r.openMs, rows: r.rows, text: r.text, error };
}

/**
 * Stream id -> arm for `separate` runs: every block of `arms` consecutive ids gets each arm once, in a
 * shuffled order, so arms read equally many streams and no slot keeps one arm (a slot's streams keep
 * their timing relative to other slots' from round to round, a slot-level effect that would otherwise
 * go with one arm).
 */
function deal(arms, ids) {
  const out = [];
  while (out.length < ids) {
    const block = Array.from({ length: arms }, (_, k) => k);
    for (let k = arms - 1; k > 0; k--) {
      const j = Math.floor(Math.random() * (k + 1));
      [block[k], block[j]] = [block[j], block[k]];
    }
    out.push(...block);
  }
  return out;
}

/**
 * @param {{arms: string[], streams: number, rounds: number, maxTokens: number, timeoutMs: number, ramp: number,
 *   wsOrigins?: string[], separate?: boolean, wt?: {url: string, hash: string}}} cfg
 * @returns {Promise<object[]>} one record per subscriber
 */
export async function run(cfg) {
  const out = [];
  wtEndpoint = cfg.wt;
  const dealt = deal(cfg.arms.length, cfg.streams * cfg.rounds);
  const slot = async (i) => {
    await new Promise((r) => setTimeout(r, Math.random() * cfg.ramp * 1000));
    for (let r = 0; r < cfg.rounds; r++) {
      const id = i + cfg.streams * r;
      const postMs = epochMs();
      let stream;
      try {
        stream = await createStream({ endpoint: "chat.completions", max_tokens: cfg.maxTokens, ignore_eos: true,
          seed: r, messages: [{ role: "user", content: "tokenfan bench" }] });
      } catch (err) {
        cfg.arms.forEach((_, k) => out.push({ arm: k, stream: id, seed: r, postMs, openMs: null, rows: [], text: "",
          error: `POST /v1/streams: ${err.message || err}` }));
        continue;
      }
      const order = cfg.separate
        ? [[cfg.arms[dealt[id]], dealt[id]]] // one arm per stream
        : cfg.arms.map((arm, k) => [arm, k]).sort(() => Math.random() - 0.5); // no arm always first
      const wsOrigin = cfg.wsOrigins && cfg.wsOrigins.length ? cfg.wsOrigins[i % cfg.wsOrigins.length] : undefined;
      out.push(...await Promise.all(order.map(([arm, k]) => subscribeOne(arm, k, stream, id, r, postMs,
        cfg.timeoutMs, wsOrigin))));
    }
  };
  await Promise.all(Array.from({ length: cfg.streams }, (_, i) => slot(i)));
  return out;
}
