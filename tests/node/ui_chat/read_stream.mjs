// Reads tokenfan's /api/chat with the AI SDK's own client code (DefaultChatTransport + readUIMessageStream)
// and prints the final UI message as JSON: `node read_stream.mjs URL CHAT_ID SETTINGS_JSON QUESTION`.
// With QUESTION "-" it resumes the chat's running answer instead (GET URL/api/chat/CHAT_ID/stream).
import { DefaultChatTransport, readUIMessageStream } from "ai";

const [url, chatId, settingsJson, question] = process.argv.slice(2);
const transport = new DefaultChatTransport({ api: `${url}/api/chat`, body: JSON.parse(settingsJson) });
const chunks = [];
let stream;
if (question === "-") {
  stream = await transport.reconnectToStream({ chatId });
  if (stream === null) {
    console.log(JSON.stringify({ resumed: false }));
    process.exit(0);
  }
} else {
  stream = await transport.sendMessages({
    chatId, trigger: "submit-message", messageId: undefined, abortSignal: undefined,
    messages: [{ id: "u1", role: "user", parts: [{ type: "text", text: question }] }],
  });
}
const tee = stream.pipeThrough(new TransformStream({ transform(chunk, c) { chunks.push(chunk.type); c.enqueue(chunk); } }));
let last = null;
let snapshots = 0;
const errors = [];
for await (const message of readUIMessageStream({ stream: tee, onError: (e) => errors.push(String(e.message || e)) })) {
  last = message;
  snapshots += 1;
}
console.log(JSON.stringify({ message: last, snapshots, chunks, errors }));
