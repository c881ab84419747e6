// One assistant answer on the page: a section per choice with its reasoning (dimmed, collapsible), its
// text, a card per tool call and its finish reason, drawn from a ChatAccumulator's choices.
//
// Model output only ever goes in as text (Text nodes, textContent), never as HTML: tool names,
// arguments and reasoning come from the model as much as the answer does.

import { prettyJSON } from "./completion.js";

function el(tag, className, text) {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export class AnswerView {
  /**
   * @param {HTMLElement} root where the choices go
   * @param {{n?: number, json?: boolean}} opts choices asked for (labels them when > 1); whether a JSON
   *   response format was asked for (then text that does not parse is flagged)
   */
  constructor(root, { n = 1, json = false } = {}) {
    this.root = root;
    this.json = json;
    this.views = new Map();
    root.classList.toggle("many", n > 1);
  }

  /** Draw what grew in these choices (ChatAccumulator.add's result). */
  update(choices) {
    for (const c of choices) this.view(c.index).sync(c);
  }

  /** The answer ended: finish reasons, and JSON text pretty-printed. */
  end(choices) {
    if (choices.length > 1) this.root.classList.add("many");
    for (const c of choices) {
      const v = this.view(c.index);
      v.sync(c);
      v.end(c, this.json);
    }
  }

  view(index) {
    let v = this.views.get(index);
    if (v) return v;
    v = new ChoiceView(index);
    this.views.set(index, v);
    const after = [...this.views.values()].find((o) => o.index > index);
    this.root.insertBefore(v.el, after ? after.el : null); // choices can start out of order
    return v;
  }
}

class ChoiceView {
  constructor(index) {
    this.index = index;
    this.el = el("section", "choice");
    this.el.dataset.index = String(index);
    this.reasoning = el("details", "reasoning");
    this.reasoning.open = true;
    this.reasoning.hidden = true;
    this.reasoningText = document.createTextNode("");
    this.reasoning.append(el("summary", "", "Reasoning"), el("div", "reasoning-text"));
    this.reasoning.lastChild.append(this.reasoningText);
    this.text = el("div", "text");
    this.textNode = document.createTextNode("");
    this.text.append(this.textNode);
    this.tools = el("div", "tool-calls");
    this.cards = [];
    this.finish = el("footer", "finish");
    this.finish.hidden = true;
    this.el.append(el("header", "choice-label", `choice ${index}`), this.reasoning, this.text, this.tools,
      this.finish);
  }

  /** Append the new text, redraw the tool calls that grew. */
  sync(c) {
    if (c.reasoning.length > this.reasoningText.length) {
      this.reasoningText.appendData(c.reasoning.slice(this.reasoningText.length));
      this.reasoning.hidden = false;
    }
    if (c.content.length > this.textNode.length) this.textNode.appendData(c.content.slice(this.textNode.length));
    c.toolCalls.forEach((call, i) => {
      if (call) (this.cards[i] ??= this.card()).draw(call);
    });
  }

  card() {
    const card = new ToolCard();
    this.tools.append(card.el);
    return card;
  }

  end(c, json) {
    if (c.finishReason) {
      this.finish.textContent = `finish: ${c.finishReason}`;
      this.finish.hidden = false;
      this.el.dataset.finish = c.finishReason;
    }
    // Without a JSON response format only an object or array counts: a bare "42" or "true" stays text.
    const pretty = json || /^\s*[[{]/.test(c.content) ? prettyJSON(c.content) : null;
    if (pretty !== null) {
      this.textNode.data = pretty;
      this.text.dataset.json = "valid";
    } else if (json && c.content) {
      this.text.dataset.json = "invalid"; // asked for JSON, got something else (cut by max tokens?)
      this.text.title = "not valid JSON";
    }
    if (c.content || this.cards.length) this.reasoning.open = false;
  }
}

/** A tool call: its name, and its arguments as streamed text until they parse, then pretty-printed. */
class ToolCard {
  constructor() {
    this.el = el("div", "tool-call");
    this.name = el("b", "tool-name");
    this.id = el("span", "tool-id");
    this.args = el("pre", "tool-args");
    const head = el("div", "tool-head", "tool call ");
    head.append(this.name, this.id);
    this.el.append(head, this.args);
  }

  draw(call) {
    this.name.textContent = call.name;
    this.id.textContent = call.id;
    const pretty = prettyJSON(call.arguments);
    this.args.textContent = pretty ?? call.arguments;
    this.el.dataset.complete = String(pretty !== null);
  }
}
