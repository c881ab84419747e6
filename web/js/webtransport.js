// Fan-out streams over WebTransport (the gateway's --http3-port, session path /v1/wt).
//
// One WebTransport session per endpoint for the whole page, one bidirectional stream per subscription: the
// page writes a JSON head line ({"method", "path", "headers"}) and closes its side; the gateway answers a
// JSON head line ({"status", "headers"}) and then the same SSE bytes an EventSource reads, ending the
// stream after `data: [DONE]`. A subscription whose stream or session is lost resumes as EventSource does:
// a new stream (on a new session if need be) with a `last-event-id` header, up to MAX_RESUMES times.
//
// `endpoint`: {url: "https://HOST:PORT/v1/wt", hash: "<sha-256 of the certificate, hex>"}; with a hash the
// browser accepts a self-signed certificate valid for at most 14 days (`tokenfan certs --days 13`), as
// WebTransport's serverCertificateHashes allows.

import { authHeaders, epochMs } from "./api.js";
import { SSEParser } from "./sse.js";

const sessions = new Map(); // url -> Promise<WebTransport>
const MAX_RESUMES = 3;

function hexBytes(hex) {
  return new Uint8Array(hex.match(/../g).map((b) => parseInt(b, 16)));
}

/** The page's session to `endpoint` (opened on first use, again after it closed). */
export function session(endpoint) {
  let s = sessions.get(endpoint.url);
  if (!s) {
    const opts = endpoint.hash
      ? { serverCertificateHashes: [{ algorithm: "sha-256", value: hexBytes(endpoint.hash) }] }
      : {};
    const wt = new WebTransport(endpoint.url, opts);
    s = wt.ready.then(() => wt);
    wt.closed.finally(() => sessions.delete(endpoint.url));
    s.catch(() => sessions.delete(endpoint.url));
    sessions.set(endpoint.url, s);
  }
  return s;
}

/** Has the shape readstream.js expects: new WebTransportSubscription({onChunk, timeoutMs, origin}). */
export class WebTransportSubscription {
  constructor({ onChunk, timeoutMs = 30000, origin }) {
    this.onChunk = onChunk;
    this.timeoutMs = timeoutMs;
    this.endpoint = origin;
    this.openMs = null;
    this.reconnects = 0;
    this.stream = null;
    this.done = new Promise((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
  }

  subscribe(stream) {
    this.follow(stream).then((reason) => this.resolve({ reason }), (err) => this.reject(err));
  }

  async follow(stream) {
    this.lastSeq = null;
    for (;;) {
      try {
        return await this.read(stream, this.lastSeq);
      } catch (err) {
        if (this.stopped || err.httpStatus || this.reconnects >= MAX_RESUMES) throw err;
        this.reconnects += 1; // the stream or its session was lost: resume after the last event seen
      }
    }
  }

  async read(stream, lastEventId = null) {
    const wt = await session(this.endpoint);
    const bidi = await wt.createBidirectionalStream();
    this.stream = bidi;
    const timer = setTimeout(() => bidi.readable.cancel("timeout").catch(() => {}), this.timeoutMs);
    try {
      const headers = authHeaders({ accept: "text/event-stream" });
      if (lastEventId !== null) headers["last-event-id"] = String(lastEventId);
      const path = new URL(stream.events_url, location.href);
      const writer = bidi.writable.getWriter();
      await writer.write(new TextEncoder().encode(
        JSON.stringify({ method: "GET", path: path.pathname + path.search, headers }) + "\n"));
      await writer.close();
      const reader = bidi.readable.getReader();
      const decoder = new TextDecoder();
      let head = null;
      let pending = "";
      let recvMs = 0;
      let finished = false;
      let failure = null;
      const parser = new SSEParser((ev) => {
        if (ev.data === "[DONE]") finished = true;
        else if (ev.event === "error") failure = Object.assign(new Error(`WebTransport stream: ${ev.data}`), { httpStatus: 200 });
        else if (ev.event === "message") {
          const chunk = JSON.parse(ev.data);
          if (chunk.tokenfan) this.lastSeq = chunk.tokenfan.seq;
          this.onChunk(chunk, recvMs);
        }
      });
      while (!finished) {
        const { value, done } = await reader.read();
        recvMs = epochMs();
        if (done) throw new Error("the WebTransport stream ended before [DONE]");
        let text = decoder.decode(value, { stream: true });
        if (head === null) {
          pending += text;
          const nl = pending.indexOf("\n");
          if (nl < 0) continue;
          head = JSON.parse(pending.slice(0, nl));
          text = pending.slice(nl + 1);
          if (head.status !== 200) {
            throw Object.assign(new Error(`WebTransport stream: HTTP ${head.status} ${text}`), { httpStatus: head.status });
          }
          if (this.openMs === null) this.openMs = recvMs;
        }
        parser.feed(text);
        if (failure) throw failure;
      }
      return "done";
    } finally {
      clearTimeout(timer);
    }
  }

  async stop() {
    this.stopped = true;
    if (this.stream) await this.stream.readable.cancel("stopped").catch(() => {});
    this.resolve({ reason: "cancelled" });
  }
}
