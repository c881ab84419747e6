// A useChat page for tests/e2e/test_ui_chat.py, bundled by build.mjs (esbuild) and served under tokenfan's
// origin, so the transport's default paths (/api/chat, /api/chat/{id}/stream) reach tokenfan unchanged.
// URL parameters: chat (the chat id), resume=1 (useChat's resume), settings (JSON: the transport's body,
// i.e. chat completions settings; its "after_tool" entry, if any, replaces it once a tool has run). The page
// shows the messages in #messages and mirrors the chat's state on window.chatState for the test;
// window.send(text) and window.stop() (the SDK's stop, then tokenfan's cancel endpoint) drive it.
import { useChat } from "@ai-sdk/react";
import { DefaultChatTransport, lastAssistantMessageIsCompleteWithToolCalls } from "ai";
import { useEffect } from "react";
import { createRoot } from "react-dom/client";

const params = new URLSearchParams(location.search);
const { after_tool: afterTool, ...settings } = JSON.parse(params.get("settings") || "{}");
const chatId = params.get("chat") || undefined;

// The client-side tool: what onToolCall runs.
function getWeather({ city }) {
  return { city, celsius: 18 };
}

function App() {
  const { messages, status, error, sendMessage, stop, addToolResult } = useChat({
    id: chatId,
    resume: params.get("resume") === "1",
    // body may be a function: resolved for every request
    transport: new DefaultChatTransport({ api: "/api/chat",
                                          body: () => (afterTool && window.toolCalls.length ? afterTool : settings) }),
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithToolCalls,
    onToolCall: ({ toolCall }) => {
      window.toolCalls.push({ name: toolCall.toolName, input: toolCall.input });
      if (toolCall.toolName === "get_weather") {
        // not awaited, as the SDK asks (onToolCall runs inside its job queue)
        addToolResult({ tool: "get_weather", toolCallId: toolCall.toolCallId, output: getWeather(toolCall.input) });
      }
    },
  });
  useEffect(() => {
    window.chatState = { status, error: error ? String(error.message || error) : null, messages };
    const last = messages[messages.length - 1];
    if (status === "streaming" && last?.role === "assistant") {
      window.renderedTexts.add(last.parts.filter((p) => p.type === "text").map((p) => p.text).join(""));
    }
    window.send = (text) => sendMessage({ text });
    // In resume mode stop() only disconnects: the cancel endpoint ends the generation in the engine.
    window.stop = async () => {
      await stop();
      return (await fetch(`/api/chat/${encodeURIComponent(chatId)}/stream`, { method: "DELETE" })).json();
    };
  }, [messages, status, error, sendMessage, stop]);
  return (
    <div>
      <p id="status">{status}</p>
      {error && <p id="error">{String(error.message || error)}</p>}
      <ol id="messages">
        {messages.map((m) => (
          <li key={m.id} className={m.role} data-id={m.id}>
            {m.parts.map((part, i) => {
              if (part.type === "text") return <span key={i} className="text">{part.text}</span>;
              if (part.type === "reasoning") return <i key={i} className="reasoning">{part.text}</i>;
              if (part.type.startsWith("tool-")) return <code key={i} className="tool">{part.type} {part.state}</code>;
              return null;
            })}
          </li>
        ))}
      </ol>
    </div>
  );
}

window.toolCalls = [];
window.renderedTexts = new Set(); // the answer's texts the page rendered while it streamed
createRoot(document.getElementById("root")).render(<App />);
