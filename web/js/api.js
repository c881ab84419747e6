// Talking to the tokenfan gateway: URLs, JSON requests, and OpenAI-shaped errors.
//
//   ApiError            what the pages show; `status` 0 when no HTTP status is known
//   ├── from a response  errorFromResponse(): the gateway's {"error": {message, type, param, code}}
//   ├── from the wire    apiErrorFromBody(): an SSE `event: error` or a WebSocket error message
//   ├── network          TypeError from fetch → status 0, code "network_error"
//   └── timeout          code "timeout" (the page's own watchdog)

export class ApiError extends Error {
  constructor(status, message, { type = null, code = null, param = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.type = type;
    this.code = code;
    this.param = param;
  }
}

/** Browser wall clock in epoch milliseconds, with sub-millisecond resolution where allowed. */
export function epochMs() {
  return performance.timeOrigin + performance.now();
}

/** `{"error": {...}}` (or the inner object) → ApiError. */
// Errors that arrive over a WebSocket carry no HTTP status: recover it from the error code.
const STATUS_OF_CODE = {
  missing_api_key: 401, invalid_api_key: 401, origin_not_allowed: 403, stream_not_found: 404,
  stream_expired: 410, too_many_requests: 429, too_many_subscribers: 429, engine_unavailable: 503,
  server_shutdown: 503,
};

export function apiErrorFromBody(body, status = 0) {
  const e = (body && body.error) || body || {};
  return new ApiError(status || STATUS_OF_CODE[e.code] || 0, e.message || "Unknown error",
    { type: e.type, code: e.code, param: e.param });
}

export async function errorFromResponse(resp) {
  const text = await resp.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    if (body && body.error) return apiErrorFromBody(body, resp.status);
  } catch {
    // not JSON: fall through to the status line
  }
  return new ApiError(resp.status, text.trim().slice(0, 300) || `${resp.status} ${resp.statusText}`);
}

/** A one-line explanation of any error, for the error banner. */
export function describeError(err) {
  if (!(err instanceof ApiError)) {
    if (err instanceof TypeError) return `Cannot reach the gateway (${err.message}).`;
    return String((err && err.message) || err);
  }
  const s = err.status;
  if (s === 401 || s === 403) return `Authentication failed (${s}): ${err.message}`;
  if (s === 503 || err.code === "engine_unavailable") return `Engine unavailable (503): ${err.message}`;
  if (s === 410 || err.code === "stream_expired") return `Stream gone (410): ${err.message}`;
  if (err.code === "stream_not_found") return `Stream gone (404): ${err.message}`;
  if (err.code === "timeout") return `Timed out: ${err.message}`;
  return s ? `Error ${s}: ${err.message}` : err.message;
}

// -- API key --------------------------------------------------------------------------------
// Optional; kept in localStorage. fetch sends it as `Authorization: Bearer`; WebSockets cannot set
// headers, so /v1/ws gets `?api_key=`; EventSource and stream WebSockets use the stream-scoped
// token the gateway puts in `events_url` / `ws_url`.

const KEY_STORAGE = "tokenfan.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export function authHeaders(headers = {}) {
  const key = apiKey();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

/** Same-origin URL for a path, as http(s) or ws(s). */
export function gatewayURL(path, { ws = false } = {}) {
  const url = new URL(path, location.href);
  if (ws) url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  return url.toString();
}

/**
 * The gateway's absolute URLs (`events_url`, `ws_url`) are built from the Host it saw; behind a
 * TLS-terminating proxy that may be the wrong scheme, so the pages keep only the path.
 */
export function samePath(absoluteURL, { ws = false } = {}) {
  const u = new URL(absoluteURL, location.href);
  return gatewayURL(u.pathname + u.search, { ws });
}

/** fetch + JSON, throwing ApiError for non-2xx answers. */
export async function requestJSON(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: authHeaders() };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const resp = await fetch(gatewayURL(path), init);
  if (!resp.ok) throw await errorFromResponse(resp);
  return resp.status === 204 ? null : resp.json();
}

/** The served model id (first entry of /v1/models). */
export async function getModelId() {
  const body = await requestJSON("/v1/models");
  const id = body && body.data && body.data[0] && body.data[0].id;
  if (!id) throw new ApiError(503, "The gateway lists no model.");
  return id;
}

/** POST /v1/streams → {id, events_url, ws_url, ...}; the generation starts at once. */
export function createStream(body, { signal } = {}) {
  return requestJSON("/v1/streams", { method: "POST", body, signal });
}

export function deleteStream(id) {
  return requestJSON(`/v1/streams/${encodeURIComponent(id)}`, { method: "DELETE" });
}

/** Why a connection that the browser hides the status of (EventSource, WebSocket) failed. */
export async function diagnose(path = "/v1/models") {
  try {
    const resp = await fetch(gatewayURL(path), { cache: "no-store", headers: authHeaders() });
    return resp.ok ? null : await errorFromResponse(resp);
  } catch (err) {
    return new ApiError(0, `Cannot reach the gateway (${err.message}).`, { code: "network_error" });
  }
}

/** Query-string settings shared by the pages (e.g. `?timeout_ms=2000` in tests). */
export function pageParam(name, fallback) {
  const v = new URLSearchParams(location.search).get(name);
  return v === null ? fallback : v;
}
