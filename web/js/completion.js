// Folding chat completion chunks into choices, the way the OpenAI SDKs do (pure: chunks in, state out).
//
// Every chat transport hands its chunks to one ChatAccumulator, so the page renders the same thing
// whichever way the chunks came. Per choice (keyed by `choices[i].index`): `delta.content` and
// `delta.reasoning` (vLLM's reasoning parsers) are appended; a tool call is keyed by its own `index`,
// its `id` and `type` are kept when a delta carries them, `function.name` is set when present and
// `function.arguments` fragments are appended — openai-node's ChatCompletionStream accumulates the same
// way. `finish_reason` is kept once seen; the chunk that carries `usage` (stream_options.include_usage)
// has no choices.

/** @typedef {{index: number, id: string, type: string, name: string, arguments: string}} ToolCall */

export class ChoiceState {
  constructor(index) {
    this.index = index;
    this.content = "";
    this.reasoning = "";
    /** @type {ToolCall[]} */
    this.toolCalls = []; // by the call's index; sparse only if the server skips one
    this.finishReason = null;
  }

  /** The assistant message this choice amounts to, for the next turn of the conversation. */
  message() {
    const msg = { role: "assistant", content: this.content || null };
    const calls = this.toolCalls.filter(Boolean);
    if (calls.length) {
      msg.tool_calls = calls.map((c) => ({ id: c.id, type: c.type, function: { name: c.name, arguments: c.arguments } }));
    }
    return msg;
  }
}

export class ChatAccumulator {
  constructor() {
    /** @type {Map<number, ChoiceState>} */
    this.choices = new Map();
    this.usage = null;
  }

  /** Fold one chunk in; returns the choices whose content, reasoning or tool calls grew. */
  add(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    const grown = [];
    for (const c of chunk.choices || []) {
      let choice = this.choices.get(c.index);
      if (!choice) this.choices.set(c.index, (choice = new ChoiceState(c.index)));
      if (c.finish_reason) choice.finishReason = c.finish_reason;
      if (foldDelta(choice, c.delta || {})) grown.push(choice);
    }
    return grown;
  }

  /** The choices in index order. */
  list() {
    return [...this.choices.values()].sort((a, b) => a.index - b.index);
  }
}

function foldDelta(choice, delta) {
  let grew = false;
  if (delta.content) {
    choice.content += delta.content;
    grew = true;
  }
  if (delta.reasoning) {
    choice.reasoning += delta.reasoning;
    grew = true;
  }
  for (const d of delta.tool_calls || []) {
    const call = (choice.toolCalls[d.index] ??= { index: d.index, id: "", type: "", name: "", arguments: "" });
    if (d.id) call.id = d.id;
    if (d.type) call.type = d.type;
    if (d.function?.name) call.name = d.function.name;
    if (d.function?.arguments) call.arguments += d.function.arguments;
    grew = true;
  }
  return grew;
}

/** `text` pretty-printed with two-space indents if it is one complete JSON value, else null. */
export function prettyJSON(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return null;
  }
}
