// The three ways a page can receive a generation, behind one small contract.
//
//   const g = openChat("sse" | "fetch" | "ws", body, { onChunk, onState, timeoutMs });
//   g.done   → Promise<{reason: "done" | "cancelled"}>, rejects with an ApiError
//   g.stop() → aborts the generation on the server (DELETE the stream, abort the fetch, or send
//              a WebSocket cancel), then settles `done` as "cancelled"
//
// onChunk(chunk, recvMs) gets every OpenAI chunk (fan-out chunks also carry `tokenfan`) with the
// browser receive time in epoch ms, taken before parsing. onState(s) reports "connecting",
// "streaming" and "reconnecting". A watchdog fails the generation when nothing arrives for
// `timeoutMs`, so a connection that never delivers ends in an error rather than a spinner.
//
// Fan-out subscribers (EventSourceSubscription, WebSocketSubscription) are also used on their own
// by the A/B page and the bench's browser arm (readstream.js: one API per stream).

import {
  ApiError, apiErrorFromBody, apiKey, authHeaders, createStream, deleteStream, diagnose, epochMs,
  errorFromResponse, gatewayURL, samePath,
} from "./api.js";
import { readEventStream } from "./sse.js";

export const TRANSPORTS = {
  sse: "EventSource (/v1/streams)",
  fetch: "fetch stream (POST /v1/chat/completions)",
  ws: "WebSocket (/v1/ws)",
  "responses-sse": "Responses API · SSE (POST /v1/responses)",
  "responses-ws": "Responses API · WebSocket mode (/v1/responses)",
};

const MAX_RECONNECT_ATTEMPTS = 5;
const noop = () => {};

class Generation {
  constructor({ onChunk = noop, onState = noop, timeoutMs = 30000 } = {}) {
    this.onChunk = onChunk;
    this.onState = onState;
    this.timeoutMs = timeoutMs;
    this.settled = false;
    this.stopping = false;
    this.reconnects = 0; // successful re-opens after a dropped connection
    this.duplicates = 0; // events at or before the last seq seen (dropped, counted for tests)
    this.openMs = null; // browser time the (first) connection opened
    this.done = new Promise((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
    this.done.catch(noop); // callers await it; avoid an "unhandled rejection" before they do
    this.kick();
  }

  /** Restart the no-data watchdog. */
  kick() {
    clearTimeout(this.timer);
    if (!this.settled) this.timer = setTimeout(() => this.timedOut(), this.timeoutMs);
  }

  timedOut() {
    this.fail(new ApiError(0, `no data from the gateway for ${this.timeoutMs / 1000} s.`, { code: "timeout" }));
  }

  chunk(chunk, recvMs) {
    if (this.settled) return;
    this.kick();
    this.onChunk(chunk, recvMs);
  }

  finish(reason) {
    if (this.settled) return;
    this.settled = true;
    clearTimeout(this.timer);
    this.release();
    this.resolve({ reason });
  }

  fail(err) {
    if (this.settled) return;
    this.settled = true;
    clearTimeout(this.timer);
    this.release();
    this.reject(err);
  }

  /** Close the connection (subclasses). Called once, when the generation settles. */
  release() {}
}

// -- fan-out stream subscribers ------------------------------------------------------------

/** Subscribes to a fan-out stream with a plain EventSource (which resumes with Last-Event-ID). */
export class EventSourceSubscription extends Generation {
  constructor(opts) {
    super(opts);
    this.stream = null;
    this.lastSeq = -1;
    this.endReason = null;
    this.attempts = 0; // consecutive failed connection attempts
  }

  /** @param {{id: string, events_url: string}} stream */
  subscribe(stream) {
    if (this.settled) return;
    this.stream = stream;
    this.onState("connecting");
    const es = (this.es = new EventSource(samePath(stream.events_url)));
    es.onopen = () => this.opened();
    es.onmessage = (e) => this.message(e);
    es.addEventListener("end", (e) => {
      this.endReason = JSON.parse(e.data).reason;
    });
    es.addEventListener("error", (e) => this.error(e));
  }

  opened() {
    if (this.openMs === null) this.openMs = epochMs();
    else this.reconnects += 1;
    this.kick();
    this.onState("streaming");
  }

  message(e) {
    const recvMs = epochMs();
    this.attempts = 0;
    if (e.data === "[DONE]") {
      // Without close() EventSource would reconnect (and get 204).
      this.finish(this.endReason === "cancelled" ? "cancelled" : "done");
      return;
    }
    const chunk = JSON.parse(e.data);
    const seq = chunk.tokenfan ? chunk.tokenfan.seq : this.lastSeq + 1;
    if (seq <= this.lastSeq) {
      this.duplicates += 1;
      return;
    }
    this.lastSeq = seq;
    this.chunk(chunk, recvMs);
  }

  error(e) {
    if (this.settled || this.stopping) return;
    if (typeof e.data === "string") {
      // The server's own `event: error`, with an OpenAI error body.
      const err = apiErrorFromBody(JSON.parse(e.data));
      // A subscriber that fell behind is dropped and told to resume: EventSource reconnects with
      // Last-Event-ID by itself once the server closes the response.
      if (err.code !== "slow_consumer") this.fail(err);
      return;
    }
    if (this.es.readyState === EventSource.CONNECTING) {
      // Connection dropped; the browser retries after the server's `retry:` hint.
      this.attempts += 1;
      if (this.attempts > MAX_RECONNECT_ATTEMPTS) {
        this.fail(new ApiError(0, `lost the event stream; ${MAX_RECONNECT_ATTEMPTS} reconnects failed.`,
          { code: "network_error" }));
      } else {
        this.onState("reconnecting");
      }
      return;
    }
    // CLOSED: the server answered something other than 200 (EventSource hides the status).
    this.es.close();
    this.explainClose();
  }

  async explainClose() {
    try {
      const url = gatewayURL(`/v1/streams/${encodeURIComponent(this.stream.id)}`);
      const resp = await fetch(url, { cache: "no-store", headers: authHeaders() });
      if (!resp.ok) return this.fail(await errorFromResponse(resp));
      const state = (await resp.json()).state;
      // 204 on a resume past the end: everything was delivered except the final marker.
      if (state === "done" || state === "cancelled") return this.finish(state);
      this.fail(new ApiError(0, `the event stream closed (stream state: ${state}).`));
    } catch (err) {
      this.fail(new ApiError(0, `Cannot reach the gateway (${err.message}).`, { code: "network_error" }));
    }
  }

  /** Cancel the generation for every subscriber (DELETE), then settle as cancelled. */
  async stop() {
    if (this.settled) return;
    this.stopping = true;
    if (this.es) this.es.close();
    if (this.stream) await deleteStream(this.stream.id).catch(noop);
    this.finish("cancelled");
  }

  release() {
    if (this.es) this.es.close();
  }
}

/**
 * Subscribes to a fan-out stream over WebSocket, resuming with `?after=<last seq>` on a drop. `origin`
 * (optional, e.g. "https://127.0.0.1:8443") sends the socket to another host:port than the page's (the
 * bench's browser arm: one port per stream slot, as Chromium opens one WebSocket per host:port at a time).
 */
export class WebSocketSubscription extends Generation {
  constructor(opts = {}) {
    super(opts);
    this.origin = opts.origin || null;
    this.stream = null;
    this.lastSeq = -1;
    this.attempts = 0;
  }

  subscribe(stream) {
    if (this.settled) return;
    this.stream = stream;
    this.connect();
  }

  connect() {
    this.onState(this.openMs === null ? "connecting" : "reconnecting");
    const url = new URL(samePath(this.stream.ws_url, { ws: true }));
    if (this.origin) url.host = new URL(this.origin).host;
    if (this.lastSeq >= 0) url.searchParams.set("after", String(this.lastSeq));
    const ws = (this.ws = new WebSocket(url));
    let opened = false;
    ws.onopen = () => {
      opened = true;
      if (this.openMs === null) this.openMs = epochMs();
      else this.reconnects += 1;
      this.kick();
      this.onState("streaming");
    };
    ws.onmessage = (e) => this.message(e);
    ws.onclose = (e) => this.closed(e, opened);
  }

  message(e) {
    const recvMs = epochMs();
    this.attempts = 0;
    const msg = JSON.parse(e.data);
    if (msg.type === "chunk") {
      if (msg.seq <= this.lastSeq) {
        this.duplicates += 1;
        return;
      }
      this.lastSeq = msg.seq;
      this.chunk(msg.data, recvMs);
    } else if (msg.type === "done") {
      this.finish(msg.reason === "cancelled" ? "cancelled" : "done");
    } else if (msg.type === "error") {
      this.fail(apiErrorFromBody(msg.error));
    }
  }

  closed(e, opened) {
    if (this.settled || this.stopping) return;
    this.attempts += 1;
    if (opened && this.attempts <= MAX_RECONNECT_ATTEMPTS) {
      setTimeout(() => this.settled || this.connect(), 250 * this.attempts);
      return;
    }
    diagnose(`/v1/streams/${encodeURIComponent(this.stream.id)}`).then((err) =>
      this.fail(err || new ApiError(0, `WebSocket closed (code ${e.code}${e.reason ? ": " + e.reason : ""}).`,
        { code: "network_error" })));
  }

  async stop() {
    if (this.settled) return;
    this.stopping = true;
    if (this.stream) await deleteStream(this.stream.id).catch(noop);
    this.finish("cancelled");
  }

  release() {
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
  }
}

// -- chat over each transport ---------------------------------------------------------------

/** POST /v1/streams, then follow the stream with EventSource. */
class EventSourceChat extends EventSourceSubscription {
  constructor(body, opts) {
    super(opts);
    this.post = new AbortController();
    this.onState("connecting");
    createStream({ ...body, endpoint: "chat.completions" }, { signal: this.post.signal }).then(
      (stream) => (this.stopping ? deleteStream(stream.id).catch(noop) : this.subscribe(stream)),
      (err) => this.stopping || this.fail(err),
    );
  }

  async stop() {
    if (!this.stream) this.post.abort();
    return super.stop();
  }
}

/** POST /v1/chat/completions with stream:true, read with a ReadableStream SSE parser. */
class FetchChat extends Generation {
  constructor(body, opts) {
    super(opts);
    this.abort = new AbortController();
    this.run(body).catch((err) => {
      if (this.stopping || this.settled) return;
      this.fail(err instanceof ApiError ? err : new ApiError(0, `Cannot reach the gateway (${err.message}).`,
        { code: "network_error" }));
    });
  }

  get path() { return "/v1/chat/completions"; }

  requestBody(body) { return { ...body, stream: true }; }

  /** One SSE event of the response; true once the generation ended. */
  event(ev, recvMs) {
    if (ev.event === "error") throw apiErrorFromBody(JSON.parse(ev.data));
    if (ev.data === "[DONE]") {
      this.finish("done");
      return true;
    }
    this.chunk(JSON.parse(ev.data), recvMs);
    return false;
  }

  async run(body) {
    this.onState("connecting");
    const resp = await fetch(gatewayURL(this.path), {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify(this.requestBody(body)),
      signal: this.abort.signal,
    });
    if (!resp.ok) throw await errorFromResponse(resp);
    this.openMs = epochMs();
    this.onState("streaming");
    for await (const ev of readEventStream(resp)) {
      if (this.event(ev, epochMs())) return;
    }
    throw new ApiError(0, "the connection closed before the answer was complete.", { code: "network_error" });
  }

  timedOut() {
    this.abort.abort();
    super.timedOut();
  }

  async stop() {
    if (this.settled) return;
    this.stopping = true;
    this.abort.abort(); // the gateway sees the disconnect and aborts the engine request
    this.finish("cancelled");
  }
}

/** A chat WebSocket closed: a stop, a cut (1013), a drop mid-answer, or a connection that never opened. */
function wsClosed(gen, e, opened) {
  if (gen.settled) return;
  if (gen.stopping) return gen.finish("cancelled");
  if (opened) {
    const why = e.code === 1013 ? "the gateway cut this reader as too slow (close 1013)" : `code ${e.code}`;
    gen.fail(new ApiError(0, `WebSocket closed mid-answer (${why}).`, { code: "network_error" }));
    return;
  }
  diagnose().then((err) => gen.fail(err || new ApiError(0, "WebSocket connection failed.",
    { code: "network_error" })));
}

/** A generation over its own WebSocket: sends `first` once open, hands each message to `message(e)`,
 *  reports the close (wsClosed), and closes the socket on release. */
class SocketChat extends Generation {
  constructor(path, first, opts) {
    super(opts);
    this.onState("connecting");
    const url = new URL(gatewayURL(path, { ws: true }));
    if (apiKey()) url.searchParams.set("api_key", apiKey()); // browsers cannot set WebSocket headers
    const ws = (this.ws = new WebSocket(url));
    let opened = false;
    ws.onopen = () => {
      opened = true;
      this.openMs = epochMs();
      this.onState("streaming");
      ws.send(JSON.stringify(first));
    };
    ws.onmessage = (e) => this.message(e);
    ws.onclose = (e) => wsClosed(this, e, opened);
  }

  release() {
    if (this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
  }
}

let wsRequestCounter = 0;

/** One request over /v1/ws; Stop sends a cancel message and waits for the server's "done". */
class WebSocketChat extends SocketChat {
  constructor(body, opts) {
    const cid = `chat-${Date.now().toString(36)}-${++wsRequestCounter}`;
    super("/v1/ws", { type: "request", id: cid, endpoint: "chat.completions", body }, opts);
    this.cid = cid;
  }

  message(e) {
    const recvMs = epochMs();
    const msg = JSON.parse(e.data);
    if (msg.id !== this.cid && msg.id !== null) return; // id null: an error about the connection itself
    if (msg.type === "chunk") this.chunk(msg.data, recvMs);
    else if (msg.type === "done") this.finish(msg.cancelled ? "cancelled" : "done");
    // A cancel that crossed the end of the answer gets "no active request": still a stop.
    else if (msg.type === "error") this.stopping ? this.finish("cancelled") : this.fail(apiErrorFromBody(msg.error));
  }

  stop() {
    if (this.settled) return;
    this.stopping = true;
    if (this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ type: "cancel", id: this.cid }));
      // The server answers {"type":"done","cancelled":true}; don't wait forever for it.
      setTimeout(() => this.finish("cancelled"), 2000);
    } else {
      this.finish("cancelled");
    }
  }
}

// -- the Responses API over both transports --------------------------------------------------

/** The Responses request for a chat body (messages -> input items, max_tokens -> max_output_tokens, tools,
 *  tool_choice and response_format in the Responses API's shapes, vLLM's chat_template_kwargs as is). */
function responsesBody(body) {
  const out = { input: responsesInput(body.messages), stream: true };
  if (body.max_tokens != null) out.max_output_tokens = body.max_tokens;
  for (const k of ["model", "temperature", "top_p", "chat_template_kwargs"]) if (body[k] != null) out[k] = body[k];
  if (body.parallel_tool_calls != null) out.parallel_tool_calls = body.parallel_tool_calls;
  if (body.tools) out.tools = body.tools.map((t) => (t.function ? { type: t.type, ...t.function } : t));
  if (body.tool_choice) {
    const c = body.tool_choice;
    out.tool_choice = c.function ? { type: "function", name: c.function.name } : c;
  }
  const format = body.response_format;
  if (format && format.type === "json_schema") out.text = { format: { type: "json_schema", ...format.json_schema } };
  else if (format) out.text = { format };
  return out;
}

/** Chat messages as Responses input items: an assistant's tool calls become function_call items. */
function responsesInput(messages) {
  return messages.flatMap((m) => [
    ...(m.content != null ? [{ role: m.role, content: m.content }] : []),
    ...(m.tool_calls || []).map((c) =>
      ({ type: "function_call", call_id: c.id, name: c.function.name, arguments: c.function.arguments })),
  ]);
}

/** One delta of choice 0 in a chat chunk's shape. */
function chunkOf(delta, tokenfan) {
  return { choices: [{ index: 0, delta }], tokenfan };
}

/** Feed one Responses event to a generation: text, reasoning and function-call deltas become chat
 *  chunks (a call's index is its output_index), so the page renders them like every other transport;
 *  the terminal event ends it. Returns true at the end. */
function responsesEvent(gen, ev, recvMs) {
  if (ev.type === "response.output_text.delta") {
    gen.chunk(chunkOf({ content: ev.delta }, ev.tokenfan), recvMs);
  } else if (ev.type === "response.reasoning_text.delta") {
    gen.chunk(chunkOf({ reasoning: ev.delta }, ev.tokenfan), recvMs);
  } else if (ev.type === "response.output_item.added" && ev.item.type === "function_call") {
    const call = { index: ev.output_index, id: ev.item.call_id, type: "function",
      function: { name: ev.item.name, arguments: ev.item.arguments || "" } };
    gen.chunk(chunkOf({ tool_calls: [call] }, ev.tokenfan), recvMs);
  } else if (ev.type === "response.function_call_arguments.delta") {
    const call = { index: ev.output_index, function: { arguments: ev.delta } };
    gen.chunk(chunkOf({ tool_calls: [call] }, ev.tokenfan), recvMs);
  } else if (ev.type === "response.completed" || ev.type === "response.incomplete") {
    const u = ev.response.usage;
    if (u) gen.chunk({ choices: [], usage: { prompt_tokens: u.input_tokens, completion_tokens: u.output_tokens,
      total_tokens: u.total_tokens } }, recvMs);
    gen.finish("done");
    return true;
  } else if (ev.type === "response.failed") {
    gen.fail(apiErrorFromBody({ error: ev.response.error || { message: "the response failed" } }));
    return true;
  } else if (ev.type === "error") {
    const e = ev.error || { message: ev.message, code: ev.code, param: ev.param };
    if (e.code === "response_cancelled") gen.finish("cancelled");
    else gen.fail(apiErrorFromBody({ error: e }, ev.status || 0));
    return true;
  } else {
    gen.kick();
  }
  return false;
}

/** POST /v1/responses with stream:true, read with the same streaming SSE parser as FetchChat. */
class ResponsesSseChat extends FetchChat {
  get path() { return "/v1/responses"; }

  requestBody(body) { return responsesBody(body); }

  event(ev, recvMs) {
    const data = JSON.parse(ev.data);
    if (ev.event === "error" && data.error && !data.type) throw apiErrorFromBody(data); // a cut reader
    return responsesEvent(this, data, recvMs);
  }
}

/** The Responses API's WebSocket mode: one response.create, its events back as JSON messages. */
class ResponsesWsChat extends SocketChat {
  constructor(body, opts) {
    const { stream, ...create } = responsesBody(body);
    super("/v1/responses", { type: "response.create", ...create }, opts);
  }

  message(e) {
    const recvMs = epochMs();
    responsesEvent(this, JSON.parse(e.data), recvMs);
  }

  stop() {
    if (this.settled) return;
    this.stopping = true; // closing the socket aborts its responses on the gateway
    this.finish("cancelled");
  }
}

/** Start a chat generation over the named transport (a key of TRANSPORTS). */
export function openChat(transport, body, opts) {
  if (transport === "sse") return new EventSourceChat(body, opts);
  if (transport === "fetch") return new FetchChat(body, opts);
  if (transport === "ws") return new WebSocketChat(body, opts);
  if (transport === "responses-sse") return new ResponsesSseChat(body, opts);
  if (transport === "responses-ws") return new ResponsesWsChat(body, opts);
  throw new Error(`unknown transport ${JSON.stringify(transport)}: use one of ${Object.keys(TRANSPORTS)}`);
}
