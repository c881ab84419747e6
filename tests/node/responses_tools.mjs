// A Responses tool loop with the official `openai` npm package (unmodified) and `ws` for its WebSocket mode,
// against gateways whose engine runs vLLM's Hermes tool parser on a scripted model (the scripted engine of
// tests/e2e/test_responses_tools_scaleout.py: it writes a get_weather call for "What is the weather in
// Paris?" and answers the tool's result only when the prompt holds that call).
//
//   node tests/node/responses_tools.mjs URL_A [URL_B] [scenario ...]
//
// Scenarios run on gateway A; where one says so, the follow-up turn goes to gateway B (another replica on
// the same broker; B defaults to A). Prints one JSON object {scenario: result} that pytest checks; a scenario
// that throws reports {error: <stack>}, so the others still report.
import OpenAI from "openai";
import { zodTextFormat } from "openai/helpers/zod";
import { ResponsesWS } from "openai/resources/responses/ws";
import { z } from "zod";

const QUESTION = "What is the weather in Paris?";
const RESULT = "tool says 18 C, sunny";
const WEATHER = { type: "function", name: "get_weather", description: "Current weather of a city",
                  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } };
const TERMINAL = new Set(["response.completed", "response.incomplete", "response.failed", "error"]);
const Verdict = z.object({ answer: z.enum(["yes", "no"]) });

const clientFor = (url) =>
  new OpenAI({ baseURL: url.replace(/\/$/, "") + "/v1", apiKey: "unused", maxRetries: 0, timeout: 60_000 });

// Response.output_text as the Python SDK computes it (the Node SDK adds it only to create()'s result).
const outputText = (response) =>
  response.output.flatMap((item) => (item.type === "message" ? item.content : []))
    .filter((part) => part.type === "output_text").map((part) => part.text).join("");

const toolOutput = (call) => ({ type: "function_call_output", call_id: call.call_id, output: RESULT });

function theCall(response) {
  const calls = response.output.filter((item) => item.type === "function_call");
  if (calls.length !== 1) throw new Error(`one function_call expected: ${JSON.stringify(response.output)}`);
  const { type, name, arguments: args, call_id, status } = calls[0];
  return { type, name, arguments: args, call_id, status };
}

const summary = (response) => ({
  id: response.id, status: response.status, output_types: response.output.map((item) => item.type),
  output_text: outputText(response), previous_response_id: response.previous_response_id ?? null,
});

// The events of one response: order, the function_call item as added, its argument deltas, the final call.
function callEvents(events) {
  const last = events.at(-1);
  const added = events.find((e) => e.type === "response.output_item.added" && e.item.type === "function_call");
  return {
    types: events.map((e) => e.type), seqs: events.map((e) => e.sequence_number), id: last.response?.id,
    added: added && { type: added.item.type, name: added.item.name, arguments: added.item.arguments },
    argument_deltas: events.filter((e) => e.type === "response.function_call_arguments.delta").map((e) => e.delta),
    arguments_done: events.find((e) => e.type === "response.function_call_arguments.done")?.arguments,
    call: last.response && theCall(last.response),
  };
}

const answerEvents = (events) => ({
  seqs: events.map((e) => e.sequence_number),
  text: events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join(""),
  response: summary(events.at(-1).response),
});

async function collect(stream) {
  const events = [];
  for await (const ev of stream) events.push(ev);
  return events;
}

async function modelOf(client) {
  return (await client.models.list()).data[0].id;
}

// responses.create with tools, not streamed; the tool result sent back by previous_response_id.
async function scenarioCreate(urlA) {
  const a = clientFor(urlA);
  const model = await modelOf(a);
  const first = await a.responses.create({ model, input: QUESTION, tools: [WEATHER] });
  const call = theCall(first);
  const answered = await a.responses.create({ model, tools: [WEATHER], previous_response_id: first.id,
                                              input: [toolOutput(call)] });
  return { ...summary(first), output_text: first.output_text, call, answered: summary(answered) };
}

// responses.create with tools, streamed (and the SDK's responses.stream helper); the follow-up streamed on B.
async function scenarioStream(urlA, urlB) {
  const a = clientFor(urlA);
  const model = await modelOf(a);
  const first = callEvents(await collect(await a.responses.create({ model, input: QUESTION, tools: [WEATHER],
                                                                     stream: true })));
  const helper = a.responses.stream({ model, input: QUESTION, tools: [WEATHER] });
  const final = await helper.finalResponse();
  const answered = await collect(await clientFor(urlB).responses.create({
    model, tools: [WEATHER], previous_response_id: first.id, input: [toolOutput(first.call)], stream: true }));
  return { first, final_call: theCall(final), answered: answerEvents(answered) };
}

// WebSocket mode (ResponsesWS over `ws`): the call and its answer on one socket, then the same first
// response continued over a socket to gateway B.
async function scenarioWs(urlA, urlB) {
  const model = await modelOf(clientFor(urlA));
  async function untilTerminal(records) {
    const events = [];
    for (;;) {
      const { value: rec, done } = await records.next();
      if (done || rec.type === "close") throw new Error("socket closed before the terminal event");
      if (rec.type === "error") throw rec.error;
      if (rec.type !== "message") continue;
      events.push(rec.message);
      if (TERMINAL.has(rec.message.type)) return events;
    }
  }
  const out = {};
  const ws = new ResponsesWS(clientFor(urlA));
  try {
    const records = ws.stream();
    ws.send({ type: "response.create", model, input: QUESTION, tools: [WEATHER] });
    out.first = callEvents(await untilTerminal(records));
    ws.send({ type: "response.create", model, tools: [WEATHER], previous_response_id: out.first.id,
              input: [toolOutput(out.first.call)] });
    out.answered = answerEvents(await untilTerminal(records));
  } finally {
    ws.close();
  }
  const other = new ResponsesWS(clientFor(urlB));
  try {
    const records = other.stream();
    other.send({ type: "response.create", model, tools: [WEATHER], previous_response_id: out.first.id,
                 input: [toolOutput(out.first.call)] });
    out.other_replica = answerEvents(await untilTerminal(records));
  } finally {
    other.close();
  }
  return out;
}

// responses.parse with a zod text format, and the streamed helper's parsed final response.
async function scenarioParse(urlA) {
  const a = clientFor(urlA);
  const body = { model: await modelOf(a), input: "Is it sunny?", text: { format: zodTextFormat(Verdict, "verdict") } };
  const parsed = await a.responses.parse(body);
  const streamed = await a.responses.stream(body).finalResponse();
  return { status: parsed.status, output_types: parsed.output.map((item) => item.type),
           parsed: parsed.output_parsed, streamed_parsed: streamed.output_parsed,
           format_type: parsed.text?.format?.type, format_name: parsed.text?.format?.name };
}

const SCENARIOS = { create: scenarioCreate, stream: scenarioStream, ws: scenarioWs, parse: scenarioParse };

const [urlA, ...rest] = process.argv.slice(2);
if (!urlA) {
  console.error("usage: node responses_tools.mjs URL_A [URL_B] [scenario ...]");
  process.exit(2);
}
const urlB = rest[0]?.startsWith("http") ? rest.shift() : urlA;
const results = {};
for (const name of rest.length ? rest : Object.keys(SCENARIOS)) {
  if (!SCENARIOS[name]) throw new Error(`unknown scenario ${name}`);
  try {
    results[name] = await SCENARIOS[name](urlA, urlB);
  } catch (err) {
    results[name] = { error: String(err?.stack ?? err) };
  }
}
process.stdout.write(JSON.stringify(results) + "\n");
