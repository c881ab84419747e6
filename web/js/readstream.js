// One fan-out stream read by one browser API, recorded chunk by chunk: what the bench's browser arm
// (bencharm.js) and the /ab page (ab.js) both measure.
//
// A record keeps one row per chunk, ROW_FIELDS in order: the chunk's `tokenfan` stamps (seq, engine emit
// and gateway publish times in server-clock ns, deltas coalesced into it), the browser receive time in
// epoch ms (performance.timeOrigin + performance.now(), taken by the subscription before parsing) and
// whether it carried content. `tokenfan_bench/clients/browser.py` reads these rows as they are.
//
// A subscription (`Sub`) is EventSourceSubscription, WebSocketSubscription (transports.js) or anything
// with their shape: new Sub({onChunk, onState, timeoutMs, origin}), subscribe(stream), `done`, `openMs`,
// and stop() when a `signal` may cancel it.

import { createStream, deleteStream, epochMs } from "./api.js";

export const ROW_FIELDS = ["seq", "emit_ns", "sent_ns", "recv_ms", "deltas", "content"];
/** Column of each field in a row: row[ROW.recv_ms]. */
export const ROW = Object.freeze(Object.fromEntries(ROW_FIELDS.map((f, i) => [f, i])));

/** The text a chat or completion chunk adds to choice 0 ("" for a role-only, usage or final chunk). */
export function chunkText(chunk) {
  const choice = chunk.choices && chunk.choices[0];
  return choice ? (choice.delta ? choice.delta.content : choice.text) || "" : "";
}

/**
 * Read an existing stream with one subscription until it ends. Never rejects: the outcome is in the record,
 * `reason` ("done" | "cancelled") or `error` (what `done` rejected with).
 * `onChunk(row, text)` and `onState(state)` follow the reading live; `onSubscribed(sub)` gets the
 * subscription as soon as it exists (to stop it).
 * @returns {Promise<{openMs: number | null, rows: number[][], text: string, reason: string | null,
 *   error: unknown, reconnects: number}>}
 */
export async function readStream(Sub, stream, { timeoutMs, origin, onChunk, onState, onSubscribed } = {}) {
  const rec = { openMs: null, rows: [], text: "", reason: null, error: null, reconnects: 0 };
  const sub = new Sub({
    timeoutMs,
    origin,
    onState,
    onChunk: (chunk, recvMs) => {
      const tf = chunk.tokenfan || {};
      const text = chunkText(chunk);
      const row = [tf.seq ?? -1, tf.emit_ns ?? 0, tf.sent_ns ?? 0, recvMs, tf.coalesced || 1, text ? 1 : 0];
      rec.rows.push(row);
      rec.text += text;
      if (onChunk) onChunk(row, text);
    },
  });
  if (onSubscribed) onSubscribed(sub);
  sub.subscribe(stream);
  try {
    rec.reason = (await sub.done).reason;
  } catch (err) {
    rec.error = err;
  }
  rec.openMs = sub.openMs;
  rec.reconnects = sub.reconnects || 0;
  return rec;
}

/**
 * POST /v1/streams with `body`, then read that stream (and only that one) with one subscription, as a page
 * that uses one API does. Never rejects. `streamId` stays null when the POST failed (its error in `error`).
 * Aborting `signal` cancels: before the stream exists it aborts the POST, after it stops the subscription,
 * which DELETEs the stream; the record then ends "cancelled". `onStream(stream)` gets the created stream
 * before it is read; the other options are readStream's.
 * @returns {Promise<{streamId: string | null, postMs: number, openMs: number | null, rows: number[][],
 *   text: string, reason: string | null, error: unknown, reconnects: number}>}
 */
export async function readOwnStream(Sub, body, { signal, onStream, ...opts } = {}) {
  const postMs = epochMs();
  const cancelled = { streamId: null, postMs, openMs: null, rows: [], text: "", reason: "cancelled", error: null,
    reconnects: 0 };
  let stream;
  try {
    stream = await createStream(body, { signal });
  } catch (err) {
    return signal && signal.aborted ? cancelled : { ...cancelled, reason: null, error: err };
  }
  if (signal && signal.aborted) {
    // The POST was answered as the stop came: nobody will read this stream.
    await deleteStream(stream.id).catch(() => {});
    return { ...cancelled, streamId: stream.id };
  }
  if (onStream) onStream(stream);
  let sub = null;
  const stop = () => sub.stop();
  if (signal) signal.addEventListener("abort", stop, { once: true });
  try {
    const rec = await readStream(Sub, stream, { ...opts, onSubscribed: (s) => (sub = s) });
    return { streamId: stream.id, postMs, ...rec };
  } finally {
    if (signal) signal.removeEventListener("abort", stop);
  }
}
