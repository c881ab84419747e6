// A minimal line/step/dot chart on a <canvas>: enough for a latency CDF and a per-token
// timeline, without a vendored charting library. Redraws are coalesced to one per frame.

/** A "nice" tick step (1, 2 or 5 × 10^k) giving about `count` ticks over `range`. */
export function niceStep(range, count = 5) {
  if (!(range > 0)) return 1;
  const raw = range / count;
  const pow = 10 ** Math.floor(Math.log10(raw));
  const m = raw / pow;
  return (m >= 5 ? 10 : m >= 2 ? 5 : m >= 1 ? 2 : 1) * pow;
}

function cssVar(name, fallback) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

function fmt(v, step) {
  const digits = step >= 1 ? 0 : Math.min(3, Math.ceil(-Math.log10(step)));
  return v.toFixed(digits);
}

export class Chart {
  /**
   * @param {HTMLCanvasElement} canvas
   * @param {{xLabel: string, yLabel: string}} labels
   */
  constructor(canvas, { xLabel, yLabel }) {
    this.canvas = canvas;
    this.xLabel = xLabel;
    this.yLabel = yLabel;
    this.series = [];
    this.bounds = { xMin: 0, xMax: 1, yMin: 0, yMax: 1 };
    this.pending = false;
    new ResizeObserver(() => this.schedule()).observe(canvas);
  }

  /**
   * @param {{color: string, points: number[][], style: "step"|"line"|"dots"}[]} series
   * @param {{xMin?: number, xMax: number, yMin?: number, yMax: number}} bounds
   */
  set(series, bounds) {
    this.series = series;
    this.bounds = { xMin: 0, yMin: 0, ...bounds };
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth;
    const h = c.clientHeight;
    if (!w || !h) return;
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);

    const pad = { l: 48, r: 10, t: 8, b: 34 };
    const pw = w - pad.l - pad.r;
    const ph = h - pad.t - pad.b;
    const { xMin, xMax, yMin, yMax } = this.bounds;
    const sx = (x) => pad.l + ((x - xMin) / (xMax - xMin || 1)) * pw;
    const sy = (y) => pad.t + ph - ((y - yMin) / (yMax - yMin || 1)) * ph;
    const ink = cssVar("--muted", "#666");
    const line = cssVar("--line", "#ddd");

    g.font = "11px system-ui, sans-serif";
    g.lineWidth = 1;
    g.fillStyle = ink;
    g.strokeStyle = line;
    const xs = niceStep(xMax - xMin, Math.max(2, Math.floor(pw / 70)));
    g.textAlign = "center";
    g.textBaseline = "top";
    for (let x = Math.ceil(xMin / xs) * xs; x <= xMax + 1e-9; x += xs) {
      g.beginPath();
      g.moveTo(sx(x), pad.t);
      g.lineTo(sx(x), pad.t + ph);
      g.stroke();
      g.fillText(fmt(x, xs), sx(x), pad.t + ph + 3);
    }
    const ys = niceStep(yMax - yMin, Math.max(2, Math.floor(ph / 40)));
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let y = Math.ceil(yMin / ys) * ys; y <= yMax + 1e-9; y += ys) {
      g.beginPath();
      g.moveTo(pad.l, sy(y));
      g.lineTo(pad.l + pw, sy(y));
      g.stroke();
      g.fillText(fmt(y, ys), pad.l - 4, sy(y));
    }
    g.textAlign = "center";
    g.textBaseline = "bottom";
    g.fillText(this.xLabel, pad.l + pw / 2, h - 1);
    g.save();
    g.translate(11, pad.t + ph / 2);
    g.rotate(-Math.PI / 2);
    g.textBaseline = "middle";
    g.fillText(this.yLabel, 0, 0);
    g.restore();

    g.save();
    g.beginPath();
    g.rect(pad.l, pad.t, pw, ph);
    g.clip();
    for (const s of this.series) this.drawSeries(g, s, sx, sy);
    g.restore();
  }

  drawSeries(g, s, sx, sy) {
    const color = s.color.startsWith("--") ? cssVar(s.color, "#333") : s.color;
    g.strokeStyle = color;
    g.fillStyle = color;
    if (s.style === "dots") {
      for (const [x, y] of s.points) {
        g.beginPath();
        g.arc(sx(x), sy(y), 2, 0, 2 * Math.PI);
        g.fill();
      }
      return;
    }
    g.lineWidth = 2;
    g.beginPath();
    s.points.forEach(([x, y], i) => {
      if (i === 0) {
        g.moveTo(sx(x), sy(s.style === "step" ? 0 : y));
        if (s.style === "step") g.lineTo(sx(x), sy(y));
      } else {
        if (s.style === "step") g.lineTo(sx(x), sy(s.points[i - 1][1]));
        g.lineTo(sx(x), sy(y));
      }
    });
    g.stroke();
  }
}
