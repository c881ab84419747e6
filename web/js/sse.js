// Server-Sent Events parsing for `fetch` response bodies (EventSource parses for itself).
//
// SSEParser is pure: text in, events out, no I/O. It follows the WHATWG "event stream
// interpretation" rules: lines end in CRLF, LF or CR; a blank line dispatches the event; lines
// starting with ":" are comments (keep-alives); an event without data is not dispatched; an
// incomplete event at the end of the stream is discarded.

/** @typedef {{event: string, data: string, id: string | null, retry: number | null}} SSEEvent */

export class SSEParser {
  /** @param {(ev: SSEEvent) => void} onEvent */
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.buffer = "";
    this.skipLF = false; // the previous chunk ended in CR: a leading LF belongs to that line end
    this.reset();
  }

  reset() {
    this.event = "";
    this.data = [];
    this.id = null;
    this.retry = null;
  }

  /** Feed decoded text (any split, even mid-line or between CR and LF). */
  feed(text) {
    if (this.skipLF && text.startsWith("\n")) text = text.slice(1);
    this.skipLF = false;
    this.buffer += text;
    const eol = /\r\n|\r|\n/g;
    let start = 0;
    let m;
    while ((m = eol.exec(this.buffer)) !== null) {
      this.line(this.buffer.slice(start, m.index));
      start = eol.lastIndex;
      // A CR at the very end may be half of a CRLF split across chunks.
      if (m[0] === "\r" && start === this.buffer.length) this.skipLF = true;
    }
    this.buffer = this.buffer.slice(start);
  }

  line(line) {
    if (line === "") {
      if (this.data.length) {
        this.onEvent({ event: this.event || "message", data: this.data.join("\n"), id: this.id, retry: this.retry });
      }
      this.reset();
      return;
    }
    if (line.startsWith(":")) return;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.event = value;
    else if (field === "id" && !value.includes("\0")) this.id = value;
    else if (field === "retry" && /^\d+$/.test(value)) this.retry = Number(value);
  }
}

/**
 * The events of a `fetch` Response whose body is `text/event-stream`, in order.
 * Ends when the body ends; throws what the body reader throws (e.g. an AbortError).
 * @param {Response} response
 * @returns {AsyncGenerator<SSEEvent>}
 */
export async function* readEventStream(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const queue = [];
  const parser = new SSEParser((ev) => queue.push(ev));
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      parser.feed(value);
      while (queue.length) yield queue.shift();
    }
  } finally {
    reader.releaseLock();
  }
}
