// The Responses API with the official `openai` npm package (unmodified) and `ws` for its WebSocket mode.
//
//   node tests/node/responses_sdk.mjs http://127.0.0.1:8000 [stream resume ws cancel unsupported]
//
// Prints one JSON object {scenario: result} on stdout, with the same fields as the Python harness in
// tests/e2e/test_responses_sdk.py, whose checks pytest applies to it. Exits non-zero on a failure.
import OpenAI from "openai";
import { ResponsesWS } from "openai/resources/responses/ws";

const TERMINAL = new Set(["response.completed", "response.incomplete", "response.failed", "error"]);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const clientFor = (url) =>
  new OpenAI({ baseURL: url.replace(/\/$/, "") + "/v1", apiKey: process.env.TOKENFAN_API_KEY ?? "unused",
               maxRetries: 0, timeout: 60_000 });

async function modelOf(client) {
  const page = await client.models.list();
  return page.data[0].id;
}

// Response.output_text as the Python SDK computes it (the Node SDK adds it only to create()'s result).
function outputText(response) {
  return (response.output ?? [])
    .flatMap((item) => (item.type === "message" ? item.content : []))
    .filter((part) => part.type === "output_text")
    .map((part) => part.text)
    .join("");
}

function summarize(events) {
  const out = {
    types: events.map((e) => e.type),
    seqs: events.map((e) => e.sequence_number),
    text: events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join(""),
  };
  const last = events.at(-1);
  if (last?.response) {
    out.status = last.response.status;
    out.id = last.response.id;
    out.output_text = outputText(last.response);
    out.usage = last.response.usage ?? null;
  }
  const lanes = [...new Set(events.map((e) => e.stream_id).filter((s) => s != null))].sort();
  if (lanes.length) out.stream_ids = lanes;
  if (last?.type === "error") out.error_code = last.error ? last.error.code : last.code;
  return out;
}

// An SSE stream's events. The SDK throws on an `event: error` frame; that error's body is the event.
async function collect(stream, stopAfterDeltas = Infinity) {
  const events = [];
  let deltas = 0;
  try {
    for await (const ev of stream) {
      events.push(ev);
      if (ev.type === "response.output_text.delta" && ++deltas === stopAfterDeltas) break; // drops the connection
    }
  } catch (err) {
    if (!(err instanceof OpenAI.APIError) || err.error?.type !== "error") throw err;
    events.push(err.error);
  }
  return events;
}

async function scenarioStream(url) {
  const client = clientFor(url);
  const model = await modelOf(client);
  const events = await collect(await client.responses.create({ model, input: "Say hello.", max_output_tokens: 12,
                                                               stream: true }));
  // the SDK's stream helper; a synthetic engine never stops by itself, so it may end incomplete
  const helper = client.responses.stream({ model, input: [{ role: "user", content: "Hi" }],
                                          instructions: "Be brief.", max_output_tokens: 60 });
  const helperEvents = await collect(helper);
  const last = helperEvents.at(-1).response;
  const finalText = last.status === "completed" ? (await helper.finalResponse()).output_text : outputText(last);
  return {
    events: summarize(events),
    helper: { text: summarize(helperEvents).text, output_text: outputText(last), status: last.status,
              final_text: finalText },
  };
}

async function scenarioResume(url, dropAfter = 3, maxOutputTokens = 30) {
  const client = clientFor(url);
  const model = await modelOf(client);
  const stream = await client.responses.create({ model, input: "Count.", background: true, stream: true,
                                                 max_output_tokens: maxOutputTokens });
  const first = await collect(stream, dropAfter);
  const id = first[0].response.id;
  const rest = await collect(await client.responses.retrieve(id, { stream: true,
                                                                  starting_after: first.at(-1).sequence_number }));
  const final = await client.responses.retrieve(id);
  return { id, first: summarize(first), rest: summarize(rest), final_status: final.status,
           final_text: outputText(final), background: final.background };
}

async function scenarioWs(url) {
  const client = clientFor(url);
  const model = await modelOf(client);
  const ws = new ResponsesWS(client);
  const records = ws.stream();
  const out = {};
  // Events until `lanes` terminal events. Error events arrive as {type: "error", error} records whose
  // `error.error` is the protocol's error event.
  async function untilTerminal(lanes = 1) {
    const events = [];
    let done = 0;
    for (;;) {
      const { value: rec, done: closed } = await records.next();
      if (closed || rec.type === "close") throw new Error("socket closed before the terminal event");
      const ev = rec.type === "message" ? rec.message : rec.type === "error" ? rec.error.error : null;
      if (rec.type === "error" && !ev) throw rec.error;
      if (!ev) continue;
      events.push(ev);
      if (TERMINAL.has(ev.type) && ++done === lanes) return events;
    }
  }
  try {
    ws.send({ type: "response.create", model, input: "My name is Ada.", max_output_tokens: 8 });
    out.first = summarize(await untilTerminal());
    ws.send({ type: "response.create", model, input: "What is my name?", max_output_tokens: 8,
              previous_response_id: out.first.id });
    out.continued = summarize(await untilTerminal());
    ws.send({ type: "response.create", model, input: "x", previous_response_id: "resp_does_not_exist" });
    const err = (await untilTerminal()).at(-1);
    out.not_found = { type: err.type, code: err.error.code, param: err.error.param, status: err.status };
    ws.send({ type: "response.create", model, input: "Context to keep.", generate: false });
    out.warmup = summarize(await untilTerminal());
    ws.send({ type: "response.create", model, input: "lane a", max_output_tokens: 10, stream_id: "a" });
    ws.send({ type: "response.create", model, input: "lane b", max_output_tokens: 10, stream_id: "b" });
    const both = await untilTerminal(2);
    out.lanes = Object.fromEntries(["a", "b"].map((l) => [l, summarize(both.filter((e) => e.stream_id === l))]));
    const order = both.filter((e) => e.type === "response.output_text.delta").map((e) => e.stream_id);
    out.lanes_interleaved = order.some((x, i) => i > 0 && x !== order[i - 1]);
  } finally {
    ws.close();
  }
  return out;
}

async function scenarioCancel(url) {
  const client = clientFor(url);
  const model = await modelOf(client);
  const created = await client.responses.create({ model, input: "Write a long story.", background: true,
                                                  max_output_tokens: 2000 });
  await sleep(200);
  const cancelled = await client.responses.cancel(created.id);
  const again = await client.responses.retrieve(created.id);
  const tail = await collect(await client.responses.retrieve(created.id, { stream: true }));
  return { created_status: created.status, cancelled_status: cancelled.status, retrieved_status: again.status,
           stream: summarize(tail) };
}

async function scenarioUnsupported(url) {
  const client = clientFor(url);
  try {
    await client.responses.create({ model: await modelOf(client), input: "x",
                                    tools: [{ type: "web_search" }] });  // built-in tools are refused
  } catch (err) {
    if (err instanceof OpenAI.BadRequestError) return { status: err.status, param: err.param, code: err.code };
    throw err;
  }
  return { status: 200 };
}

const SCENARIOS = { stream: scenarioStream, resume: scenarioResume, ws: scenarioWs, cancel: scenarioCancel,
                    unsupported: scenarioUnsupported };

const [url, ...names] = process.argv.slice(2);
if (!url) {
  console.error("usage: node responses_sdk.mjs BASE_URL [scenario ...]");
  process.exit(2);
}
const results = {};
for (const name of names.length ? names : Object.keys(SCENARIOS)) {
  if (!SCENARIOS[name]) throw new Error(`unknown scenario ${name}`);
  results[name] = await SCENARIOS[name](url);
}
process.stdout.write(JSON.stringify(results) + "\n");
