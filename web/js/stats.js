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

/** {p50, p90, p99, p999, mean, n}: the `tokenfan bench` summary of one metric (null when no samples). */
export function summarize(values) {
  const s = sorted(values);
  const r = (x) => (Number.isFinite(x) ? Math.round(x * 1000) / 1000 : null);
  return {
    p50: r(quantileSorted(s, 0.5)),
    p90: r(quantileSorted(s, 0.9)),
    p99: r(quantileSorted(s, 0.99)),
    p999: r(quantileSorted(s, 0.999)),
    mean: r(mean(s)),
    n: s.length,
  };
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

function resampleMedian(values, rand, scratch) {
  const n = values.length;
  for (let i = 0; i < n; i++) scratch[i] = values[(rand() * n) | 0];
  scratch.sort();
  return quantileSorted(scratch, 0.5);
}

/**
 * Median of B − median of A with a percentile-bootstrap 95% CI: each resample draws A and B
 * independently with replacement.
 * @returns {{median: number|null, ci95: [number, number]|null, resamples: number}}
 */
export function bootstrapMedianDiff(a, b, { resamples = 1000, seed = 1 } = {}) {
  const A = sorted(a);
  const B = sorted(b);
  if (!A.length || !B.length) return { median: null, ci95: null, resamples: 0 };
  const rand = rng(seed);
  const sa = new Float64Array(A.length);
  const sb = new Float64Array(B.length);
  const diffs = new Float64Array(resamples);
  for (let i = 0; i < resamples; i++) diffs[i] = resampleMedian(B, rand, sb) - resampleMedian(A, rand, sa);
  diffs.sort();
  const r = (x) => Math.round(x * 1000) / 1000;
  return {
    median: r(quantileSorted(B, 0.5) - quantileSorted(A, 0.5)),
    ci95: [r(quantileSorted(diffs, 0.025)), r(quantileSorted(diffs, 0.975))],
    resamples,
  };
}

/** Points of the empirical CDF: [[x, F(x)], ...] for sorted x. */
export function ecdf(values) {
  const s = sorted(values);
  return s.map((x, i) => [x, (i + 1) / s.length]);
}
