// Small statistics for latency samples (pure functions, no DOM).
//
// Percentiles interpolate linearly between order statistics (numpy's default), so the browser's
// numbers match `tokenfan bench` on the same samples.

/** Sorted copy of the finite values. */
export function sorted(values) {
  return values.filter(Number.isFinite).sort((a, b) => a - b);
}

/** q in [0, 1] of an already sorted array; NaN when empty. */
export function quantileSorted(s, q) {
  if (!s.length) return NaN;
  const pos = (s.length - 1) * q;
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return s[lo] + (s[hi] - s[lo]) * (pos - lo);
}

export function mean(values) {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : NaN;
}

export function median(values) {
  return quantileSorted(sorted(values), 0.5);
}

/**
 * {n, mean, p50, p90, p99, "p99.9"}: the `tokenfan bench` summary of one metric (tokenfan_bench/stats/metrics.py
 * summary_ms); every statistic is null when there are no samples.
 */
export function summarize(values) {
  const s = sorted(values);
  const q = (p) => (s.length ? quantileSorted(s, p) : null);
  return { n: s.length, mean: s.length ? mean(s) : null, p50: q(0.5), p90: q(0.9), p99: q(0.99), "p99.9": q(0.999) };
}

/** Deterministic PRNG (mulberry32) so an exported CI can be reproduced from the same samples. */
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/**
 * Medians of `resamples` bootstrap resamples of `values`. With `clusters` (one label per value),
 * whole clusters are drawn with replacement: tokens of one stream are not independent, and an
 * i.i.d. token bootstrap would give intervals that are too narrow.
 */
export function bootstrapMedians(values, clusters = null, { resamples = 1000, seed = 1 } = {}) {
  const rand = rng(seed);
  const groups = new Map();
  values.forEach((v, i) => {
    const key = clusters ? clusters[i] : i;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(v);
  });
  const parts = [...groups.values()];
  const out = new Float64Array(resamples);
  for (let r = 0; r < resamples; r++) {
    const draw = [];
    for (let k = 0; k < parts.length; k++) draw.push(...parts[(rand() * parts.length) | 0]);
    out[r] = quantileSorted(Float64Array.from(draw).sort(), 0.5);
  }
  return out;
}

/** Fewer streams than this: resample tokens i.i.d. (as tokenfan_bench/stats/ab_difference.py MIN_CLUSTERS). */
export const MIN_CLUSTERS = 20;

/**
 * Difference of medians median(b) − median(a) of two independent samples (e.g. delivery latencies of
 * two arms that read separate streams), with a percentile bootstrap 95% CI, in the shape of `tokenfan
 * bench`'s unpaired `diff_ms` (tokenfan_bench/stats/ab_difference.py difference_boots): each arm is resampled on its
 * own, by whole streams when it has MIN_CLUSTERS of them (`aStreams`/`bStreams`: the stream of each
 * value), else value by value. Pass null clusters for one value per stream (e.g. TTFT).
 */
export function unpairedMedianDiff(a, aStreams, b, bStreams,
  { resamples = 1000, seed = 1, floorMs = 0, method = "unpaired difference of medians" } = {}) {
  const count = (values, streams) => (streams ? new Set(streams).size : values.length);
  const nStreams = Math.min(count(a, aStreams), count(b, bStreams));
  const clustered = aStreams !== null && bStreams !== null && nStreams >= MIN_CLUSTERS;
  const base = { paired: false, n: Math.min(a.length, b.length), streams: nStreams, n_boot: resamples, seed,
    systematic_floor_ms: floorMs,
    method: `${method}, ` + (clustered ? "stream-cluster bootstrap"
      : aStreams === null ? "bootstrap over streams" : "token bootstrap (few streams)") };
  if (!a.length || !b.length) return { median: null, ci95: null, ci95_sampling: null, ...base };
  // Two seeds: with one, both arms would draw the same indices and their resamples would move together.
  const bootsA = bootstrapMedians(a, clustered ? aStreams : null, { resamples, seed });
  const bootsB = bootstrapMedians(b, clustered ? bStreams : null, { resamples, seed: seed + 1 });
  const boots = bootsB.map((v, i) => v - bootsA[i]).sort();
  const lo = quantileSorted(boots, 0.025);
  const hi = quantileSorted(boots, 0.975);
  return { median: median(b) - median(a), ci95: [lo - floorMs, hi + floorMs], ci95_sampling: [lo, hi], ...base };
}

/** Points of the empirical CDF: [[x, F(x)], ...] for sorted x. */
export function ecdf(values) {
  const s = sorted(values);
  return s.map((x, i) => [x, (i + 1) / s.length]);
}
