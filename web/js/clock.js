// Browser ↔ gateway clock offset, NTP-style, from a few `GET /v1/time` pings.
//
// For one ping sent at t0 and answered at t1 (browser epoch ms) carrying server time S:
// offset = S − (t0 + t1) / 2, exact if the request and the response took equally long, and off by
// at most RTT/2 otherwise. The ping with the smallest RTT gives the tightest bound. The engine and
// the gateway share the machine clock, so this offset also converts engine emit times.

import { epochMs, errorFromResponse, gatewayURL } from "./api.js";

/**
 * @returns {Promise<{offsetMs: number, uncertaintyMs: number, rttMs: number, samples: number}>}
 *   server clock = browser clock + offsetMs (± uncertaintyMs)
 */
export async function estimateOffset(pings = 8) {
  const url = gatewayURL("/v1/time");
  await fetch(url, { cache: "no-store" }); // warm the connection: the first RTT includes a handshake
  let best = null;
  for (let i = 0; i < pings; i++) {
    const t0 = epochMs();
    const resp = await fetch(url, { cache: "no-store" });
    const t1 = epochMs();
    if (!resp.ok) throw await errorFromResponse(resp);
    const serverMs = (await resp.json()).time_ns / 1e6;
    const rtt = t1 - t0;
    if (best === null || rtt < best.rttMs) best = { offsetMs: serverMs - (t0 + t1) / 2, rttMs: rtt };
  }
  return { ...best, uncertaintyMs: best.rttMs / 2, samples: pings };
}
