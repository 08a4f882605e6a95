// The server view: load, KV blocks, throughput and the engine-wide entropic gauges, polled
// from /metrics (Prometheus text) and kept by the page for the last minutes.
import { getText } from "./api.js";
import { fmt } from "./tokens.js";
import { showMessage, explain } from "./ui.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 2000;
const KEEP_S = 600;
const P = "entropic_";

// Prometheus exposition text -> {metric name: value}, labelled series summed.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m) out[m[1]] = (out[m[1]] || 0) + Number(m[3]);
  }
  return out;
}

// What each panel plots: [title, [[series label, value(sample, previous sample)], ...]].
const PANELS = [
  ["requests", [["running", (s) => s.m[P + "requests_running"]],
                ["waiting", (s) => s.m[P + "requests_waiting"]]]],
  ["KV blocks in use", [["used", (s) => s.m[P + "kv_blocks_used"]]]],
  ["generated tokens / s", [["tokens/s", (s, p) => rate(s, p, P + "generation_tokens_total")]]],
  ["mean entropy (nats)", [["mean H", (s) => s.m[P + "mean_entropy_nats"]]]],
  ["entropic time τ / s (nats)", [["τ/s", (s) => s.m[P + "tau_rate_nats_per_second"]]]],
  ["blocks attended / live (pruning)", [["attended/live", (s, p) => attendedShare(s, p)]]],
];
const COLOURS = ["#1f5fbf", "#c0392b", "#2e8b57"];

function clock(t) {
  const d = new Date(t * 1000), two = (n) => String(n).padStart(2, "0");
  return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
}

function rate(s, p, name) {
  if (!p || s.m[name] === undefined || p.m[name] === undefined) return null;
  return Math.max(0, s.m[name] - p.m[name]) / (s.t - p.t);
}

// Share of live KV blocks decode attention read over the last poll interval (null when no
// decode step ran under the pruning policy in it).
function attendedShare(s, p) {
  const live = P + "decode_blocks_live", att = P + "decode_blocks_attended";
  if (!p || s.m[live] === undefined) return null;
  const dl = s.m[live] - p.m[live];
  return dl > 0 ? (s.m[att] - p.m[att]) / dl : null;
}

export function setupServerView() {
  const samples = [];
  const cards = $("srv-cards"), charts = $("srv-charts");
  const plots = PANELS.map(([title, series]) => {
    const box = document.createElement("div");
    box.className = "chart small";
    const h = document.createElement("h4");
    h.textContent = title;
    const area = document.createElement("div");
    box.append(h, area);
    charts.append(box);
    const opts = {
      width: 360, height: 150,
      series: [{}, ...series.map(([label], i) => ({ label, stroke: COLOURS[i], width: 1.5 }))],
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(hi || 0, 1e-9) * 1.1] } },
      // wall-clock time of day (uPlot's default adds a date row that overlaps it)
      axes: [{ values: (u, splits) => splits.map(clock) }, { size: 50 }],
      legend: { show: true, live: false },
    };
    return { box, plot: new uPlot(opts, [[], ...series.map(() => [])], area), series };
  });

  // The cards are built once and updated in place (a screen reader or a test holding one
  // keeps it).
  const cardEls = {};
  function card(id, label, value) {
    let c = cardEls[id];
    if (!c) {
      const div = document.createElement("div");
      div.className = "card";
      div.id = id;
      c = cardEls[id] = { v: document.createElement("div"), l: document.createElement("div") };
      c.v.className = "value";
      c.l.className = "label";
      div.append(c.v, c.l);
      cards.append(div);
    }
    c.v.textContent = value;
    c.l.textContent = label;
  }

  function render() {
    const s = samples[samples.length - 1], p = samples[samples.length - 2];
    const m = s.m;
    const live = m[P + "decode_blocks_live"], att = m[P + "decode_blocks_attended"];
    const pruning = (live || 0) > 0;
    const share = attendedShare(s, p);
    card("srv-running", "running", String(m[P + "requests_running"] ?? "–"));
    card("srv-waiting", "waiting", String(m[P + "requests_waiting"] ?? "–"));
    card("srv-kv", `KV blocks in use of ${m[P + "kv_blocks_total"] ?? "–"}`,
      String(m[P + "kv_blocks_used"] ?? "–"));
    card("srv-tps", "tokens / s", fmt(rate(s, p, P + "generation_tokens_total"), 1));
    card("srv-entropy", "mean entropy (nats)", fmt(m[P + "mean_entropy_nats"], 2));
    card("srv-tau", "τ / s (nats)", fmt(m[P + "tau_rate_nats_per_second"], 2));
    card("srv-tau-tflop", "τ / TFLOP since start", fmt(m[P + "tau_per_tflop"], 2));
    if (pruning) {
      card("srv-pruning", `blocks attended / live (since start ${fmt(att / live * 100, 1)}%)`,
        share === null ? "idle" : fmt(share * 100, 1) + "%");
    } else {
      card("srv-pruning", "pruning (serve with --pruning)", "off");
    }
    for (const [i, { box, plot, series }] of plots.entries()) {
      const isPruning = i === plots.length - 1;
      box.hidden = isPruning && !pruning;
      const xs = [], cols = series.map(() => []);
      samples.forEach((smp, j) => {
        xs.push(smp.t);
        series.forEach(([, f], k) => cols[k].push(f(smp, samples[j - 1]) ?? null));
      });
      const w = box.clientWidth - 16;
      if (w > 100 && Math.abs(plot.width - w) > 4) plot.setSize({ width: w, height: 150 });
      plot.setData([xs, ...cols]);
    }
  }

  async function poll() {
    try {
      const m = parseMetrics(await getText("/metrics"));
      const t = Date.now() / 1000;
      samples.push({ t, m });
      while (samples.length && samples[0].t < t - KEEP_S) samples.shift();
      showMessage($("srv-message"), null);
      render();
    } catch (e) {
      showMessage($("srv-message"), "error", e.kind ? explain(e, 0)
        : "Could not read /metrics: " + e.message);
    }
  }
  poll();
  setInterval(poll, POLL_MS);
}
