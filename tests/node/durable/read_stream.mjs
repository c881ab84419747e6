// One reader of a tokenfan stream by the Durable Streams protocol, with the official client
// (@durable-streams/client, unmodified): `node read_stream.mjs '<config JSON>'`.
//
// config: {urls: [durable_url, ...], offset?: "-1", live: "long-poll" | "sse", stopAfter?: n, retries?: n,
//          headers?: {...}}
// It reads urls[0] from `offset` with `subscribeJson` until the stream is closed (Stream-Closed /
// streamClosed), or until it holds `stopAfter` messages (a "reload": it stops and prints the offset to resume
// from). When the client gives up on a URL (its gateway died: `retries` failed attempts), it resumes on the
// next URL from the offset of the last batch it got: a new client instance, as after a reload.
// Prints one JSON line per batch ({"batch": n, "offset", "total"}) and then the result:
// {"result": {items, offsets, offset, closed, stopped, errors, urlsUsed}}.
import { stream } from "@durable-streams/client"

const cfg = JSON.parse(process.argv[2])
const items = []
const offsets = []
const errors = []
let offset = cfg.offset ?? "-1"
let closed = false
let stopped = false
let urlsUsed = 0

for (const url of cfg.urls) {
  urlsUsed++
  try {
    const res = await stream({
      url, offset, live: cfg.live, json: true, headers: cfg.headers ?? {},
      backoffOptions: { initialDelay: 50, maxDelay: 300, multiplier: 1.5, maxRetries: cfg.retries ?? 3 },
    })
    await new Promise((resolve, reject) => {
      res.subscribeJson(async (batch) => {
        if (stopped || closed) return
        const take = batch.items
        if (cfg.stopAfter != null && items.length + take.length >= cfg.stopAfter) {
          // a reload mid-batch would lose the batch's offset: the harness stops only on a batch's edge
          stopped = true
        }
        items.push(...take)
        offset = batch.offset
        offsets.push(batch.offset)
        console.log(JSON.stringify({ batch: take.length, offset, total: items.length }))
        if (batch.streamClosed) closed = true
        if (stopped || closed) {
          res.cancel()
          resolve()
        }
      })
      // `closed` settles as the client finishes reading, before its subscriber has had the last batch: the
      // end is the batch that says streamClosed; this only ends a session that stopped without one
      res.closed.then(() => setTimeout(resolve, 1000), reject)
    })
  } catch (err) {
    errors.push(String(err && err.message || err))
  }
  if (closed || stopped) break
}

console.log(JSON.stringify({ result: { items, offsets, offset, closed, stopped, errors, urlsUsed } }))
process.exit(0)
