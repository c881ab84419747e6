// Where the time goes between the socket and the page's handler, per browser API
// (tokenfan_bench/page_levels.py drives it through Playwright; `tokenfan bench page-levels`).
//
// Every fan-out stream is read at once by three readers in this page, each stamping a token's arrival at
// the lowest level its API lets page code see it:
//   "es"     EventSource: performance.now() first thing in onmessage, and the event's own timeStamp
//            (set when the browser created the MessageEvent, before it was queued for this handler);
//   "fetch"  fetch() of the same events_url read with a ReadableStream reader: performance.now() when
//            read() resolves, before any decoding; the SSE is parsed here (sse.js). This is the earliest
//            moment page code can see the bytes of an HTTP response;
//   "ws"     WebSocket: performance.now() first thing in onmessage, and the event's timeStamp.
// ES and fetch read the same bytes on the page's one HTTP connection (HTTP/2 over TLS), so es − fetch is
// EventSource's own cost between the network and its handler; ws − fetch is the transport's difference at
// the lowest level each API allows. Each of the three subscribes first equally often (shuffled per
// stream). Rows are [seq, emit_ns, sent_ns, now_ms, ts_ms, events_in_read]: the chunk's `tokenfan` stamps,
// the page's stamps on performance.now()'s clock (ts_ms −1 where the API has no event), and for "fetch"
// how many SSE events the read carried (1 elsewhere).

import { authHeaders, createStream, samePath } from "./api.js";
import { SSEParser } from "./sse.js";

/** Settle a reader: `done` resolves with the rows, or rejects with the first error. */
class Reader {
  constructor(name, timeoutMs) {
    this.name = name;
    this.rows = [];
    this.openMs = null;
    this.done = new Promise((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
    this.timer = setTimeout(() => this.fail(new Error(`${name}: no end after ${timeoutMs} ms`)), timeoutMs);
  }

  stamp(chunk, nowMs, tsMs, batch) {
    const tf = chunk.tokenfan || {};
    this.rows.push([tf.seq ?? -1, tf.emit_ns ?? 0, tf.sent_ns ?? 0, nowMs, tsMs, batch]);
  }

  finish() {
    clearTimeout(this.timer);
    this.close();
    this.resolve(this.rows);
  }

  fail(err) {
    clearTimeout(this.timer);
    this.close();
    this.reject(err);
  }

  close() {}
}

class EventSourceReader extends Reader {
  open(stream) {
    const es = (this.es = new EventSource(samePath(stream.events_url)));
    es.onopen = () => (this.openMs = performance.now());
    es.onmessage = (e) => {
      const now = performance.now();
      if (e.data === "[DONE]") this.finish();
      else this.stamp(JSON.parse(e.data), now, e.timeStamp, 1);
    };
    es.onerror = () => this.fail(new Error("es: the event stream failed"));
  }

  close() {
    if (this.es) this.es.close();
  }
}

class FetchReader extends Reader {
  open(stream) {
    this.ctrl = new AbortController();
    this.read(stream).catch((err) => this.fail(err));
  }

  async read(stream) {
    const resp = await fetch(samePath(stream.events_url), { headers: authHeaders(), signal: this.ctrl.signal });
    if (!resp.ok) throw new Error(`fetch: HTTP ${resp.status}`);
    this.openMs = performance.now();
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let pending = [];
    const parser = new SSEParser((ev) => pending.push(ev));
    for (;;) {
      const { value, done } = await reader.read();
      const now = performance.now();
      if (done) throw new Error("fetch: the body ended before [DONE]");
      parser.feed(decoder.decode(value, { stream: true }));
      const events = pending.filter((ev) => ev.event === "message");
      pending = [];
      for (const ev of events) {
        if (ev.data === "[DONE]") return this.finish();
        this.stamp(JSON.parse(ev.data), now, -1, events.length);
      }
    }
  }

  close() {
    if (this.ctrl) this.ctrl.abort();
  }
}

class WebSocketReader extends Reader {
  open(stream) {
    const ws = (this.ws = new WebSocket(samePath(stream.ws_url, { ws: true })));
    ws.onopen = () => (this.openMs = performance.now());
    ws.onmessage = (e) => {
      const now = performance.now();
      const msg = JSON.parse(e.data);
      if (msg.type === "chunk") this.stamp(msg.data, now, e.timeStamp, 1);
      else if (msg.type === "done") this.finish();
      else if (msg.type === "error") this.fail(new Error(`ws: ${JSON.stringify(msg.error)}`));
    };
    ws.onclose = () => this.fail(new Error("ws: closed before done"));
  }

  close() {
    if (this.ws) {
      this.ws.onclose = null;
      this.ws.close();
    }
  }
}

const READERS = { es: EventSourceReader, fetch: FetchReader, ws: WebSocketReader };

function shuffled(xs) {
  const out = [...xs];
  for (let k = out.length - 1; k > 0; k--) {
    const j = Math.floor(Math.random() * (k + 1));
    [out[k], out[j]] = [out[j], out[k]];
  }
  return out;
}

async function readAll(stream, id, readers, timeoutMs) {
  const subs = shuffled(readers).map((name) => new READERS[name](name, timeoutMs));
  subs.forEach((s) => s.open(stream));
  return Promise.all(subs.map(async (s) => {
    let rows = [];
    let error = null;
    try {
      rows = await s.done;
    } catch (err) {
      error = String(err.message || err);
    }
    return { stream: id, reader: s.name, openMs: s.openMs, rows, error };
  }));
}

/**
 * @param {{streams: number, rounds: number, maxTokens: number, timeoutMs: number, readers?: string[]}} cfg
 * @returns {Promise<{timeOriginMs: number, records: object[]}>} one record per reader and stream
 */
export async function run(cfg) {
  const readers = cfg.readers || Object.keys(READERS);
  const records = [];
  const slot = async (i) => {
    for (let r = 0; r < cfg.rounds; r++) {
      const id = i + cfg.streams * r;
      let stream;
      try {
        stream = await createStream({ endpoint: "chat.completions", max_tokens: cfg.maxTokens, ignore_eos: true,
          seed: r, messages: [{ role: "user", content: "tokenfan bench" }] });
      } catch (err) {
        readers.forEach((reader) => records.push({ stream: id, reader, openMs: null, rows: [],
          error: `POST /v1/streams: ${err.message || err}` }));
        continue;
      }
      records.push(...await readAll(stream, id, readers, cfg.timeoutMs));
    }
  };
  await Promise.all(Array.from({ length: cfg.streams }, (_, i) => slot(i)));
  return { timeOriginMs: performance.timeOrigin, records };
}
