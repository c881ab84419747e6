// Agent SDKs, unmodified, against a gateway that runs vLLM's Hermes tool parser and xgrammar structured
// outputs (the `parser_gateway` fixture): the official `openai` npm package (chat completions) and the
// Vercel AI SDK (`ai` + `@ai-sdk/openai-compatible`, zod schemas).
//
//   node tests/node/agent_sdks.mjs http://127.0.0.1:8000 [scenario ...]
//
// Prints one JSON object {scenario: result}; tests/e2e/test_agent_sdks.py checks the results. A scenario
// that throws reports {error: <stack>}, so the others still report. The served model has random weights: it writes a tool call only because vLLM's
// `structured_outputs` regex (an extra body field) forces a Hermes <tool_call> block, and which city and
// unit the block holds is still the model's (greedy) choice; a json_schema response format constrains the
// structured answers the same way. Every request turns the chat template's thinking off, as the parity
// suite does, so the constraint applies from the first token.
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateObject, generateText, Output, stepCountIs, streamText, tool } from "ai";
import OpenAI from "openai";
import { zodResponseFormat } from "openai/helpers/zod";
import { z } from "zod";

globalThis.AI_SDK_LOG_WARNINGS = false; // the scenarios report the SDK's warnings instead

const QUESTION = "What is the weather in Paris?";
const NO_THINK = { chat_template_kwargs: { enable_thinking: false } };
const HERMES_CALL = String.raw`<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)", "unit": "(c|f)"\}\}</tool_call>`;
const FORCED_CALL = { ...NO_THINK, structured_outputs: { regex: HERMES_CALL } };
const TOOL_TOKENS = 120; // the forced block is ~75 tokens of the tiny model's tokenizer

const Weather = z.object({ city: z.enum(["Paris", "Rome", "Oslo"]), unit: z.enum(["c", "f"]) });
const Verdict = z.object({ answer: z.enum(["yes", "no"]), confidence: z.number().int().min(0).max(9) });
const WEATHER_TOOL = {
  type: "function",
  function: { name: "get_weather", description: "Current weather of a city", parameters: z.toJSONSchema(Weather) },
};

const valid = (schema, value) => schema.safeParse(value).success;

// -- the official openai package -------------------------------------------------------------------------

const clientFor = (url) =>
  new OpenAI({ baseURL: url.replace(/\/$/, "") + "/v1", apiKey: "unused", maxRetries: 0, timeout: 60_000 });

async function modelOf(client) {
  return (await client.models.list()).data[0].id;
}

async function openaiParse(url) {
  const client = clientFor(url);
  const completion = await client.chat.completions.parse({
    model: await modelOf(client), messages: [{ role: "user", content: QUESTION }], max_tokens: 64, temperature: 0,
    response_format: zodResponseFormat(Verdict, "verdict"), ...NO_THINK,
  });
  const choice = completion.choices[0];
  return { finish_reason: choice.finish_reason, content: choice.message.content, parsed: choice.message.parsed,
           valid: valid(Verdict, choice.message.parsed) };
}

async function openaiTools(url) {
  const client = clientFor(url);
  const body = { model: await modelOf(client), messages: [{ role: "user", content: QUESTION }],
                 tools: [WEATHER_TOOL], tool_choice: "auto", max_tokens: TOOL_TOKENS, temperature: 0, ...FORCED_CALL };
  const stream = client.chat.completions.stream({ ...body, stream_options: { include_usage: true } });
  const deltas = [];
  const done = [];
  stream.on("tool_calls.function.arguments.delta", (e) => deltas.push({ name: e.name, index: e.index,
                                                                         delta: e.arguments_delta }));
  stream.on("tool_calls.function.arguments.done", (e) => done.push({ name: e.name, index: e.index,
                                                                      arguments: e.arguments }));
  const final = await stream.finalChatCompletion();
  const created = await client.chat.completions.create(body);
  const calls = (message) => (message.tool_calls ?? []).map((c) => ({ id: c.id, type: c.type, name: c.function.name,
                                                                      arguments: c.function.arguments }));
  return {
    stream: { deltas, done, finish_reason: final.choices[0].finish_reason, tool_calls: calls(final.choices[0].message),
              usage: final.usage },
    create: { finish_reason: created.choices[0].finish_reason, tool_calls: calls(created.choices[0].message),
              content: created.choices[0].message.content, usage: created.usage },
  };
}

// -- the Vercel AI SDK -----------------------------------------------------------------------------------

function modelFor(url) {
  const provider = createOpenAICompatible({ name: "tokenfan", baseURL: url.replace(/\/$/, "") + "/v1",
                                            apiKey: "unused", includeUsage: true, supportsStructuredOutputs: true });
  return provider.chatModel("tiny");
}

const toolCalls = (calls) => calls.map((c) => ({ toolName: c.toolName, input: c.input, valid: valid(Weather, c.input),
                                                 hasId: Boolean(c.toolCallId) }));
const warnings = (list) => (list ?? []).map((w) => w.feature ?? w.setting ?? w.message ?? w.type);

async function vercelStreamText(url) {
  const result = streamText({
    model: modelFor(url), prompt: QUESTION, tools: { get_weather: tool({ description: "Current weather of a city",
                                                                           inputSchema: Weather }) },
    toolChoice: "auto", maxOutputTokens: TOOL_TOKENS, temperature: 0, maxRetries: 0,
    providerOptions: { tokenfan: FORCED_CALL },
  });
  const parts = [];
  for await (const part of result.fullStream) parts.push(part);
  const errors = parts.filter((p) => p.type === "error").map((p) => String(p.error));
  return {
    types: [...new Set(parts.map((p) => p.type))],
    started: parts.filter((p) => p.type === "tool-input-start").map((p) => p.toolName),
    input_text: parts.filter((p) => p.type === "tool-input-delta").map((p) => p.delta).join(""),
    tool_calls: toolCalls(await result.toolCalls), finish_reason: await result.finishReason,
    usage: await result.usage, text: await result.text, errors, warnings: warnings(await result.warnings),
  };
}

async function vercelGenerateText(url) {
  const result = await generateText({
    model: modelFor(url), prompt: QUESTION, tools: { get_weather: tool({ description: "Current weather of a city",
                                                                           inputSchema: Weather }) },
    toolChoice: "auto", maxOutputTokens: TOOL_TOKENS, temperature: 0, maxRetries: 0,
    providerOptions: { tokenfan: FORCED_CALL },
  });
  return { tool_calls: toolCalls(result.toolCalls), finish_reason: result.finishReason, usage: result.usage,
           text: result.text, warnings: warnings(result.warnings) };
}

async function vercelGenerateObject(url) {
  const common = { model: modelFor(url), prompt: "Is it sunny in Paris?", maxOutputTokens: 64, temperature: 0,
                   maxRetries: 0, providerOptions: { tokenfan: NO_THINK } };
  const object = await generateObject({ ...common, schema: Verdict });
  // generateObject's successor in ai 7: generateText with an output setting
  const output = await generateText({ ...common, output: Output.object({ schema: Verdict }) });
  return {
    generate_object: { object: object.object, valid: valid(Verdict, object.object), finish_reason: object.finishReason,
                       warnings: warnings(object.warnings) },
    output_object: { object: output.output, valid: valid(Verdict, output.output), finish_reason: output.finishReason,
                     warnings: warnings(output.warnings) },
  };
}

// An agent's loop: the model calls the tool, the SDK runs it and sends its result back in a second request
// (the assistant's tool call and a `tool` message), where the model answers in text.
async function vercelAgentLoop(url) {
  const executed = [];
  const result = streamText({
    model: modelFor(url), prompt: QUESTION, temperature: 0, maxRetries: 0, stopWhen: stepCountIs(2),
    include: { requestBody: true },
    tools: { get_weather: tool({ description: "Current weather of a city", inputSchema: Weather,
                                 execute: async (input) => { executed.push(input); return { celsius: 18 }; } }) },
    prepareStep: ({ stepNumber }) => (stepNumber === 0
      ? { maxOutputTokens: TOOL_TOKENS, providerOptions: { tokenfan: FORCED_CALL } }
      : { maxOutputTokens: 6, providerOptions: { tokenfan: NO_THINK } }),
  });
  await result.consumeStream();
  const steps = await result.steps;
  return {
    executed,
    steps: steps.map((s) => ({
      finish_reason: s.finishReason, tool_calls: toolCalls(s.toolCalls), tool_results: s.toolResults.map((r) => r.output),
      text: s.text, sent_roles: (s.request.body?.messages ?? []).map((m) => m.role),
      sent_tool_calls: (s.request.body?.messages ?? []).flatMap((m) => m.tool_calls ?? [])
        .map((c) => ({ name: c.function.name, arguments: JSON.parse(c.function.arguments) })),
    })),
  };
}

const SCENARIOS = {
  openai_parse: openaiParse, openai_tools: openaiTools, vercel_stream_text: vercelStreamText,
  vercel_generate_text: vercelGenerateText, vercel_generate_object: vercelGenerateObject,
  vercel_agent_loop: vercelAgentLoop,
};

const [url, ...names] = process.argv.slice(2);
const results = {};
for (const name of names.length ? names : Object.keys(SCENARIOS)) {
  try {
    results[name] = await SCENARIOS[name](url);
  } catch (err) {
    results[name] = { error: err?.stack ?? String(err) };
  }
}
console.log(JSON.stringify(results));
