// The chat page: a conversation with the served model over a chosen transport.
//
// Model output is only ever put in the page as text (Text nodes / textContent), never as HTML.
// `window.__tokenfan` exposes counters for the browser tests (reconnects, duplicates, stream id).

import { apiKey, describeError, epochMs, getModelId, pageParam, setApiKey } from "./api.js";
import { openChat, TRANSPORTS } from "./transports.js";

const $ = (sel, root = document) => root.querySelector(sel);

const els = {
  model: $("#model"),
  banner: $("#banner"),
  log: $("#log"),
  form: $("#composer"),
  prompt: $("#prompt"),
  send: $("#send"),
  stop: $("#stop"),
  clear: $("#clear"),
  maxTokens: $("#max-tokens"),
  temperature: $("#temperature"),
  apiKey: $("#api-key"),
  template: $("#message-template"),
};

const TIMEOUT_MS = Number(pageParam("timeout_ms", 30000));

const state = { model: null, messages: [], current: null };
const debug = (window.__tokenfan = {
  page: "chat", transport: null, state: "idle", answers: 0, reconnects: 0, duplicates: 0, streamId: null,
});

function showBanner(text) {
  els.banner.textContent = text;
  els.banner.hidden = false;
}

function hideBanner() {
  els.banner.hidden = true;
}

async function loadModel() {
  try {
    state.model = await getModelId();
    els.model.textContent = state.model;
    hideBanner();
  } catch (err) {
    els.model.textContent = "unavailable";
    showBanner(describeError(err));
  }
}

function selectedTransport() {
  return $('input[name="transport"]:checked').value;
}

/** One message in the log, with helpers to stream text and metrics into it. */
class MessageView {
  constructor(role) {
    this.el = els.template.content.firstElementChild.cloneNode(true);
    this.el.classList.add(role);
    $(".who", this.el).textContent = role === "user" ? "You" : "Assistant";
    this.textNode = document.createTextNode("");
    $(".text", this.el).append(this.textNode);
    $(".empty", els.log)?.remove();
    els.log.append(this.el);
  }

  append(text) {
    const stick = els.log.scrollHeight - els.log.scrollTop - els.log.clientHeight < 40;
    this.textNode.appendData(text);
    if (stick) els.log.scrollTop = els.log.scrollHeight;
  }

  setState(s) {
    this.el.dataset.state = s;
    $(".state", this.el).textContent = s;
  }

  showMeta(transport) {
    $(".meta", this.el).hidden = false;
    this.el.dataset.transport = transport;
    $('[data-metric="transport"]', this.el).textContent = transport;
    $('[data-metric="transport"]', this.el).title = TRANSPORTS[transport];
  }

  metric(name, value) {
    $(`[data-metric="${name}"]`, this.el).textContent = value;
  }

  error(text) {
    const box = $(".error", this.el);
    box.textContent = text;
    box.hidden = false;
  }
}

/** Time to first token and decode rate of one answer. */
class AnswerMetrics {
  constructor() {
    this.t0 = epochMs();
    this.tFirst = null;
    this.tLast = null;
    this.chunks = 0;
    this.usageTokens = null;
  }

  add(recvMs) {
    if (this.tFirst === null) this.tFirst = recvMs;
    this.tLast = recvMs;
    this.chunks += 1;
  }

  get tokens() {
    return this.usageTokens ?? this.chunks;
  }

  get ttftMs() {
    return this.tFirst === null ? null : this.tFirst - this.t0;
  }

  /** Tokens after the first, per second since the first arrived. */
  get tokensPerS() {
    const s = (this.tLast - this.tFirst) / 1000;
    return this.tFirst === null || s <= 0 ? null : (this.tokens - 1) / s;
  }
}

function chunkText(chunk) {
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return "";
  return (choice.delta ? choice.delta.content : choice.text) || "";
}

function setBusy(busy) {
  els.send.disabled = busy;
  els.stop.disabled = !busy;
  debug.state = busy ? "streaming" : "idle";
}

async function send() {
  const text = els.prompt.value.trim();
  if (!text || state.current) return;
  if (state.model === null) await loadModel();
  new MessageView("user").append(text);
  els.prompt.value = "";
  state.messages.push({ role: "user", content: text });

  const transport = selectedTransport();
  const view = new MessageView("assistant");
  view.showMeta(transport);
  view.setState("connecting");
  const body = {
    messages: state.messages.slice(),
    max_tokens: Number(els.maxTokens.value) || 128,
    temperature: Number(els.temperature.value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (state.model) body.model = state.model;

  const m = new AnswerMetrics();
  let answer = "";
  const g = openChat(transport, body, {
    timeoutMs: TIMEOUT_MS,
    onState: (s) => view.setState(s),
    onChunk: (chunk, recvMs) => {
      if (chunk.usage) m.usageTokens = chunk.usage.completion_tokens;
      const piece = chunkText(chunk);
      if (!piece) return;
      m.add(recvMs);
      answer += piece;
      view.append(piece);
      view.metric("ttft", m.ttftMs.toFixed(0));
      view.metric("tokens", String(m.tokens));
      if (m.tokensPerS !== null) view.metric("tps", m.tokensPerS.toFixed(1));
      debug.reconnects = g.reconnects;
      debug.duplicates = g.duplicates;
    },
  });
  state.current = g;
  Object.assign(debug, { transport, reconnects: 0, duplicates: 0, streamId: null });
  setBusy(true);
  try {
    const { reason } = await g.done;
    view.setState(reason === "cancelled" ? "stopped" : "done");
  } catch (err) {
    view.setState("error");
    view.error(describeError(err));
  } finally {
    view.metric("tokens", String(m.tokens));
    if (m.tokensPerS !== null) view.metric("tps", m.tokensPerS.toFixed(1));
    Object.assign(debug, { reconnects: g.reconnects, duplicates: g.duplicates, streamId: g.stream?.id ?? null });
    debug.answers += 1;
    if (answer) state.messages.push({ role: "assistant", content: answer });
    state.current = null;
    setBusy(false);
    els.prompt.focus();
  }
}

function stop() {
  if (state.current) state.current.stop();
}

function clear() {
  stop();
  state.messages = [];
  els.log.replaceChildren();
  els.prompt.focus();
}

function restoreTransport() {
  const wanted = pageParam("transport", localStorage.getItem("tokenfan.transport"));
  const input = wanted && $(`input[name="transport"][value="${CSS.escape(wanted)}"]`);
  if (input) input.checked = true;
}

els.form.addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
els.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    els.form.requestSubmit();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.current) {
    e.preventDefault();
    stop();
  }
});
els.stop.addEventListener("click", stop);
els.clear.addEventListener("click", clear);
for (const input of document.querySelectorAll('input[name="transport"]')) {
  input.addEventListener("change", () => localStorage.setItem("tokenfan.transport", selectedTransport()));
}

els.apiKey.value = apiKey();
els.apiKey.addEventListener("change", () => {
  setApiKey(els.apiKey.value.trim());
  loadModel();
});

restoreTransport();
loadModel();
els.prompt.focus();
