// Compare: one prompt and seed, two sampling set-ups (by default a fixed temperature
// against the thermostat), streamed side by side, their traces overlaid on one chart.
import { chatBody, stream } from "./api.js";
import { samplerPanel } from "./settings.js";
import { appendTokens } from "./tokens.js";
import { TraceChart, download, downloadJSON, runRecord } from "./traces.js";
import { statsLine } from "./playground.js";
import { showMessage, explain } from "./ui.js";

const $ = (id) => document.getElementById(id);

export function setupCompare(card) {
  const shared = samplerPanel($("cmp-shared"), "cmp", { fields: ["top_p", "max_tokens", "seed"],
                                                       thermostat: false });
  const sides = {
    A: samplerPanel($("cmp-a-settings"), "cmp-a", { fields: ["temperature"], stop: false,
                                                    values: { temperature: 1.0, thermostat: false } }),
    B: samplerPanel($("cmp-b-settings"), "cmp-b", { fields: ["temperature"], stop: false,
                                                    values: { temperature: 1.0, thermostat: true } }),
  };
  const chart = new TraceChart($("cmp-trace"), "entropic: A against B");
  const outs = { A: $("cmp-a-out"), B: $("cmp-b-out") };
  const records = { A: [], B: [] };
  let last = null;
  for (const k of ["A", "B"]) card.watch(outs[k], (span) => records[k][Number(span.dataset.i)]);

  async function runBoth() {
    const text = $("cmp-prompt").value;
    if (!text.trim()) return;
    let bodies;
    try {
      const common = shared.read();
      bodies = Object.fromEntries(["A", "B"].map((k) => {
        const s = sides[k].read();
        const settings = { ...common, temperature: s.temperature, thermostat: s.thermostat };
        return [k, chatBody([{ role: "user", content: text }], settings)];
      }));
    } catch (e) {
      showMessage($("cmp-message"), "error", e.message);
      return;
    }
    showMessage($("cmp-message"), null);
    $("cmp-run").disabled = true;
    const live = { A: { label: "A", tokens: [] }, B: { label: "B", tokens: [] } };
    for (const k of ["A", "B"]) {
      outs[k].replaceChildren();
      outs[k].classList.remove("broken");
      records[k] = [];
      $(`cmp-${k.toLowerCase()}-stats`).replaceChildren();
    }
    const one = (k) => stream("/v1/chat/completions", bodies[k], {
      onTokens: (toks) => {
        appendTokens(outs[k], toks, records[k].length);
        records[k].push(...toks);
        live[k].tokens.push(...toks);
        chart.set([live.A, live.B]);
      },
    });
    const settled = await Promise.allSettled([one("A"), one("B")]);
    $("cmp-run").disabled = false;
    const runs = {}, problems = [];
    settled.forEach((s, i) => {
      const k = i ? "B" : "A";
      if (s.status === "fulfilled") {
        runs[k] = s.value;
      } else {
        runs[k] = s.reason.partial || { tokens: [], text: "", final: null };
        outs[k].classList.add("broken");
        problems.push(`${k}: ${explain(s.reason, records[k].length)}`);
      }
      statsLine($(`cmp-${k.toLowerCase()}-stats`), runs[k]);
    });
    if (problems.length) showMessage($("cmp-message"), "error", problems.join(" "));
    chart.set(["A", "B"].map((k) => ({ label: k, tokens: runs[k].tokens })));
    last = { bodies, runs };
    $("cmp-png").disabled = $("cmp-json").disabled = false;
  }

  $("cmp-run").addEventListener("click", runBoth);
  $("cmp-png").addEventListener("click", async () => {
    const blob = await chart.png();
    if (blob) download(blob, "entropic-compare.png");
  });
  $("cmp-json").addEventListener("click", () => {
    if (!last) return;
    downloadJSON({ runs: ["A", "B"].map((k) => runRecord(k, last.bodies[k], last.runs[k])) },
      "entropic-compare.json");
  });
}
