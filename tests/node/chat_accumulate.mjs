// The chat page's ChatAccumulator (web/js/completion.js) against the openai package's own ChatCompletionStream:
// both fold the same chat completion chunks (a JSON array on stdin); prints {"page": ..., "sdk": ...}, each
// a list of choices {index, content, tool_calls: [{index, id, type, name, arguments}], finish_reason}.
//
//   node tests/node/chat_accumulate.mjs < chunks.json
//
// `reasoning` is not compared: it is vLLM's field, which the SDK does not know (it keeps the last delta's).

import { readFileSync } from "node:fs";
import { ChatCompletionStream } from "openai/lib/ChatCompletionStream";

// The page's module is a browser ES module in a folder without a package.json: load it as one.
const source = readFileSync(new URL("../../web/js/completion.js", import.meta.url), "utf8");
const { ChatAccumulator } = await import(`data:text/javascript;base64,${Buffer.from(source).toString("base64")}`);

const chunks = JSON.parse(readFileSync(0, "utf8"));

const acc = new ChatAccumulator();
for (const chunk of chunks) acc.add(chunk);
const page = acc.list().map((c) => ({
  index: c.index,
  content: c.content,
  tool_calls: c.toolCalls.filter(Boolean).map(({ index, id, type, name, arguments: args }) =>
    ({ index, id, type, name, arguments: args })),
  finish_reason: c.finishReason,
}));

// The SDK reads newline-delimited JSON chunks (what its toReadableStream() writes).
const ndjson = new ReadableStream({
  start(controller) {
    for (const chunk of chunks) controller.enqueue(new TextEncoder().encode(`${JSON.stringify(chunk)}\n`));
    controller.close();
  },
});
let snapshot = null;
const runner = ChatCompletionStream.fromReadableStream(ndjson);
runner.on("chunk", (_chunk, snap) => {
  snapshot = JSON.parse(JSON.stringify(snap));
});
await runner.done().catch(() => {}); // finalising may reject an unfinished turn; the last snapshot is what we compare
const sdk = (snapshot?.choices ?? []).map((c) => ({
  index: c.index,
  content: c.message.content ?? "",
  tool_calls: (c.message.tool_calls ?? []).map((t, index) =>
    ({ index, id: t.id ?? "", type: t.type ?? "", name: t.function?.name ?? "", arguments: t.function?.arguments ?? "" })),
  finish_reason: c.finish_reason ?? null,
})).sort((a, b) => a.index - b.index);

process.stdout.write(JSON.stringify({ page, sdk }));
