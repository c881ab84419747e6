// The chat page: a conversation with the served model over a chosen transport.
//
// Model output is only ever put in the page as text (Text nodes / textContent), never as HTML.
// Every transport's chunks go through one ChatAccumulator (completion.js) and one AnswerView (answer.js),
// so reasoning, tool calls, JSON and n > 1 choices look the same whichever way they came.
// `window.__tokenfan` exposes counters for the browser tests (reconnects, duplicates, stream id) and
// the last answer as accumulated (`choices`: one assistant message per choice, with its finish reason).

import { AnswerView } from "./answer.js";
import { apiKey, describeError, epochMs, getModelId, pageParam, setApiKey } from "./api.js";
import { ChatAccumulator } from "./completion.js";
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
  n: $("#n"),
  toolChoice: $("#tool-choice"),
  parallelCalls: $("#parallel-calls"),
  thinking: $("#thinking"),
  tools: $("#tools"),
  responseFormat: $("#response-format"),
  jsonSchema: $("#json-schema"),
  apiKey: $("#api-key"),
  template: $("#message-template"),
};

const TIMEOUT_MS = Number(pageParam("timeout_ms", 30000));

const state = { model: null, messages: [], current: null };
const debug = (window.__tokenfan = {
  page: "chat", transport: null, state: "idle", answers: 0, reconnects: 0, duplicates: 0, streamId: null,
  choices: [],
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

/** One message in the log (the user's text, or the assistant's choices), with its metrics. */
class MessageView {
  constructor(role) {
    this.el = els.template.content.firstElementChild.cloneNode(true);
    this.el.classList.add(role);
    $(".who", this.el).textContent = role === "user" ? "You" : "Assistant";
    this.body = $(".choices", this.el);
    $(".empty", els.log)?.remove();
    els.log.append(this.el);
  }

  /** Run `draw` and keep the log scrolled to the bottom if it was there. */
  grow(draw) {
    const stick = els.log.scrollHeight - els.log.scrollTop - els.log.clientHeight < 40;
    draw();
    if (stick) els.log.scrollTop = els.log.scrollHeight;
  }

  /** The user's message: plain text. */
  setText(text) {
    const div = document.createElement("div");
    div.className = "text";
    div.textContent = text;
    this.body.replaceWith(div);
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

/** The settings' tools, tool_choice, parallel_tool_calls, response_format, thinking and n, as chat request
 *  fields (none when unset). Throws an Error naming the setting whose JSON does not parse, or n > 1 on the
 *  Responses API, which has no n. */
function outputOptions(transport) {
  const out = {};
  const choice = els.toolChoice.value;
  if (choice) {
    out.tools = settingJSON(els.tools, "Tools");
    if (!Array.isArray(out.tools) || !out.tools.length) throw new Error("Tools: expected a JSON array of tools.");
    out.tool_choice = choice === "named" ? { type: "function", function: { name: firstToolName() } } : choice;
    if (!els.parallelCalls.checked) out.parallel_tool_calls = false;
  }
  if (els.thinking.value) {
    out.chat_template_kwargs = { enable_thinking: els.thinking.value === "on" };
  }
  const format = els.responseFormat.value;
  if (format === "json_object") out.response_format = { type: "json_object" };
  if (format === "json_schema") {
    out.response_format = { type: "json_schema",
      json_schema: { name: "answer", strict: true, schema: settingJSON(els.jsonSchema, "JSON schema") } };
  }
  const n = Number(els.n.value) || 1;
  if (n > 1 && transport.startsWith("responses")) {
    throw new Error("Choices (n): the Responses API has no n; pick a chat transport for n > 1.");
  }
  if (n > 1) out.n = n;
  return out;
}

function settingJSON(textarea, name) {
  try {
    return JSON.parse(textarea.value);
  } catch (err) {
    throw new Error(`${name}: not valid JSON (${err.message}).`);
  }
}

function firstToolName() {
  try {
    return JSON.parse(els.tools.value)[0].function.name || null;
  } catch {
    return null;
  }
}

/** The "named" tool choice is labelled with the first tool's name; the JSON fields show when used. */
function syncOutputSettings() {
  const named = $('option[value="named"]', els.toolChoice);
  named.textContent = `named: ${firstToolName() ?? "(first tool)"}`;
  els.tools.closest("label").hidden = !els.toolChoice.value;
  els.parallelCalls.closest("label").hidden = !els.toolChoice.value;
  els.jsonSchema.closest("label").hidden = els.responseFormat.value !== "json_schema";
}

function setBusy(busy) {
  els.send.disabled = busy;
  els.stop.disabled = !busy;
  debug.state = busy ? "streaming" : "idle";
}

async function send() {
  const text = els.prompt.value.trim();
  if (!text || state.current) return;
  const transport = selectedTransport();
  let options;
  try {
    options = outputOptions(transport);
  } catch (err) {
    showBanner(err.message);
    return;
  }
  hideBanner();
  if (state.model === null) await loadModel();
  new MessageView("user").setText(text);
  els.prompt.value = "";
  state.messages.push({ role: "user", content: text });

  const view = new MessageView("assistant");
  view.showMeta(transport);
  view.setState("connecting");
  const body = {
    messages: state.messages.slice(),
    max_tokens: Number(els.maxTokens.value) || 128,
    temperature: Number(els.temperature.value),
    ...options,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (state.model) body.model = state.model;

  const m = new AnswerMetrics();
  const acc = new ChatAccumulator();
  const answer = new AnswerView(view.body, { n: options.n, json: Boolean(options.response_format) });
  const g = openChat(transport, body, {
    timeoutMs: TIMEOUT_MS,
    onState: (s) => view.setState(s),
    onChunk: (chunk, recvMs) => {
      const grown = acc.add(chunk);
      if (acc.usage) m.usageTokens = acc.usage.completion_tokens;
      if (!grown.length) return;
      m.add(recvMs);
      view.grow(() => answer.update(grown));
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
    const choices = acc.list();
    view.grow(() => answer.end(choices));
    view.metric("tokens", String(m.tokens));
    if (m.tokensPerS !== null) view.metric("tps", m.tokensPerS.toFixed(1));
    Object.assign(debug, { reconnects: g.reconnects, duplicates: g.duplicates, streamId: g.stream?.id ?? null,
      choices: choices.map((c) => ({ ...c.message(), reasoning: c.reasoning, finish_reason: c.finishReason })) });
    debug.answers += 1;
    // The conversation goes on from the first choice.
    const reply = choices[0]?.message();
    if (reply && (reply.content || reply.tool_calls)) state.messages.push(reply);
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

for (const input of [els.toolChoice, els.tools, els.responseFormat]) {
  input.addEventListener("input", syncOutputSettings);
}
syncOutputSettings();

els.apiKey.value = apiKey();
els.apiKey.addEventListener("change", () => {
  setApiKey(els.apiKey.value.trim());
  loadModel();
});

restoreTransport();
loadModel();
els.prompt.focus();
