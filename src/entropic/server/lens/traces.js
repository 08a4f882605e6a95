// Per-request traces against token index (uPlot): the model's entropy H_t, the tempered
// entropy H^T_t of the distribution each token was drawn from (what the thermostat steers;
// the API's entropic.tempered_entropies), the temperature T_t each token was sampled at and
// the cumulative entropic time tau_t = sum max(0, H_{s-1} - H_s) (design section 2).
// Several runs can be overlaid (Compare). PNG and JSON export.

const COLOURS = { H: "#1f5fbf", HT: "#8e44ad", T: "#c0392b", tau: "#2e8b57" };
const DASHES = [undefined, [6, 4], [2, 3]];

// Cumulative tau after each token, from the entropies (the first token has no drop).
export function cumulativeTau(entropies) {
  const out = [];
  let tau = 0;
  entropies.forEach((h, i) => {
    if (i > 0) tau += Math.max(0, entropies[i - 1] - h);
    out.push(tau);
  });
  return out;
}

export class TraceChart {
  // el: the element the chart fills (it holds the chart as `el.traceChart`, for the
  // browser tests and the console). runs are {label, tokens} (token records).
  constructor(el, title) {
    this.el = el;
    el.traceChart = this;
    this.title = title;
    this.plot = null;
    this.labels = null;
    this.runs = [];
    this.pending = false;
    new ResizeObserver(() => this.plot && this.plot.setSize(this.size())).observe(el);
  }

  size() {
    return { width: Math.max(this.el.clientWidth, 240), height: 240 };
  }

  // Show `runs` (redrawn on the next frame; call as often as tokens arrive).
  set(runs) {
    this.runs = runs;
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  data() {
    const n = Math.max(1, ...this.runs.map((r) => r.tokens.length));
    const x = Array.from({ length: n }, (_, i) => i + 1);
    const cols = [x];
    for (const r of this.runs) {
      const hs = r.tokens.map((t) => t.entropy), ts = r.tokens.map((t) => t.temperature);
      const hts = r.tokens.map((t) => t.tempered_entropy);
      const pad = (a) => a.concat(Array(n - a.length).fill(null));
      cols.push(pad(hs), pad(hts), pad(ts), pad(cumulativeTau(hs)));
    }
    return cols;
  }

  draw() {
    const key = this.runs.map((r) => r.label).join("\u0000");
    if (!this.plot || key !== this.labels) this.build(key);
    this.plot.setData(this.data());
  }

  build(key) {
    if (this.plot) this.plot.destroy();
    this.labels = key;
    const series = [{ label: "token" }];
    this.legend = [];
    const many = this.runs.length > 1;
    this.runs.forEach((r, k) => {
      const tag = many ? ` (${r.label})` : "";
      const dash = DASHES[k % DASHES.length];
      const lines = [["H_t nats", "nats", COLOURS.H], ["H^T_t nats", "nats", COLOURS.HT],
                     ["T_t", "T", COLOURS.T], ["cum. τ nats", "tau", COLOURS.tau]];
      for (const [name, scale, colour] of lines) {
        series.push({ label: name + tag, scale, stroke: colour, width: 1.5, dash });
        this.legend.push({ label: name + tag, colour, dash });
      }
    });
    const opts = {
      ...this.size(),
      series,
      scales: { x: { time: false }, T: { range: (u, lo, hi) => [0, Math.max(2, hi || 0)] } },
      axes: [
        { label: "token index", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] },
        { scale: "nats", label: "entropy (nats)", stroke: COLOURS.H },
        { scale: "T", side: 1, label: "T_t", stroke: COLOURS.T, grid: { show: false } },
        { scale: "tau", side: 1, label: "cumulative τ (nats)", stroke: COLOURS.tau,
          grid: { show: false } },
      ],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
    };
    this.plot = new uPlot(opts, this.data(), this.el);
  }

  // A PNG of the chart with its title and a legend, drawn onto a white canvas.
  async png() {
    if (!this.plot) return null;
    const src = this.plot.ctx.canvas;
    const ratio = src.width / this.plot.width || 1;
    const pad = 28 * ratio, legendH = 18 * ratio * this.runs.length + 12 * ratio;
    const out = document.createElement("canvas");
    out.width = src.width;
    out.height = src.height + pad + legendH;
    const ctx = out.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, out.width, out.height);
    ctx.fillStyle = "#222";
    ctx.font = `${14 * ratio}px sans-serif`;
    ctx.fillText(this.title, 8 * ratio, 18 * ratio);
    ctx.drawImage(src, 0, pad);
    ctx.font = `${12 * ratio}px sans-serif`;
    let x = 8 * ratio, y = pad + src.height + 14 * ratio;
    for (const s of this.legend) {
      const w = ctx.measureText(s.label).width + 28 * ratio;
      if (x + w > out.width) { x = 8 * ratio; y += 18 * ratio; }
      ctx.strokeStyle = s.colour;
      ctx.lineWidth = 2 * ratio;
      ctx.setLineDash(s.dash ? s.dash.map((d) => d * ratio) : []);
      ctx.beginPath();
      ctx.moveTo(x, y - 4 * ratio);
      ctx.lineTo(x + 18 * ratio, y - 4 * ratio);
      ctx.stroke();
      ctx.fillText(s.label, x + 22 * ratio, y);
      x += w;
    }
    return new Promise((resolve) => out.toBlob(resolve, "image/png"));
  }
}

export function download(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

export function downloadJSON(obj, name) {
  download(new Blob([JSON.stringify(obj, null, 2)], { type: "application/json" }), name);
}

// One run as exported: the request body, the tokens with their readings, the totals.
export function runRecord(label, body, run) {
  const tau = cumulativeTau(run.tokens.map((t) => t.entropy));
  return {
    label, request: body, finish_reason: run.finish_reason, usage: run.usage,
    entropic: run.final, text: run.text,
    tokens: run.tokens.map((t, i) => ({ index: i + 1, text: t.text, logprob: t.logprob,
      entropy: t.entropy, tempered_entropy: t.tempered_entropy, temperature: t.temperature,
      cumulative_tau: tau[i], top: t.top })),
  };
}
