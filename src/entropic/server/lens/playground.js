// The playground: chat or completion over the OpenAI endpoints, streamed, tokens coloured by
// entropy, the traces of the last answer under it.
import { chatBody, completionBody, stream } from "./api.js";
import { samplerPanel } from "./settings.js";
import { appendTokens, fmt } from "./tokens.js";
import { TraceChart, download, downloadJSON, runRecord } from "./traces.js";
import { showMessage, explain } from "./ui.js";

const $ = (id) => document.getElementById(id);

export function statsLine(el, run) {
  const f = run.final || {};
  const n = run.tokens.length;
  const meanT = n ? run.tokens.reduce((a, t) => a + (t.temperature || 0), 0) / n : null;
  const parts = [
    ["tokens", String(n)], ["τ", fmt(f.tau) + " nats"], ["τ / TFLOP", fmt(f.tau_per_tflop, 2)],
    ["mean H", fmt(f.mean_entropy) + " nats"], ["mean T", fmt(meanT)],
    ["finish", run.finish_reason || "–"],
  ];
  el.replaceChildren();
  for (const [k, v] of parts) {
    const s = document.createElement("span");
    const b = document.createElement("b");
    b.textContent = k + " ";
    s.append(b, document.createTextNode(v));
    el.append(s);
  }
}

export function setupPlayground(card) {
  const panel = samplerPanel($("pg-settings"), "pg");
  const chart = new TraceChart($("pg-trace"), "entropic: traces of one answer");
  const transcript = $("pg-transcript"), prompt = $("pg-prompt");
  const send = $("pg-send"), stop = $("pg-stop");
  let history = [];   // chat turns sent so far: [{role, content}]
  let records = [];   // token records of every answer shown, indexed by span data-i
  let last = null;    // {body, run} of the last answer, for export
  let controller = null;

  card.watch(transcript, (span) => records[Number(span.dataset.i)]);
  const mode = () => document.querySelector('input[name="pg-mode"]:checked').value;

  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = "turn " + role;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role;
    const body = document.createElement("div");
    body.className = "answer";
    if (text !== null) body.textContent = text;
    div.append(who, body);
    transcript.append(div);
    return body;
  }

  async function run() {
    const text = prompt.value;
    if (!text.trim() || controller) return;
    let settings;
    try {
      settings = panel.read();
    } catch (e) {
      showMessage($("pg-message"), "error", e.message);
      return;
    }
    showMessage($("pg-message"), null);
    const chat = mode() === "chat";
    if (!chat) history = [];
    const messages = chat ? [...history, { role: "user", content: text }] : null;
    const body = chat ? chatBody(messages, settings) : completionBody(text, settings);
    const path = chat ? "/v1/chat/completions" : "/v1/completions";
    bubble(chat ? "user" : "prompt", text);
    const out = bubble("assistant", null);
    const offset = records.length;
    const live = { label: "answer", tokens: [] };
    controller = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    prompt.value = "";
    let result;
    try {
      result = await stream(path, body, {
        signal: controller.signal,
        onTokens: (toks) => {
          appendTokens(out, toks, records.length);
          records.push(...toks);
          live.tokens.push(...toks);
          chart.set([live]);
          transcript.scrollTop = transcript.scrollHeight;
        },
      });
      if (chat) history = [...messages, { role: "assistant", content: result.text }];
    } catch (e) {
      result = e.partial;
      out.classList.add("broken");
      if (e.kind !== "aborted") prompt.value = text; // ready to send again
      showMessage($("pg-message"), e.kind === "aborted" ? "info" : "error",
        explain(e, records.length - offset));
    } finally {
      controller = null;
      send.disabled = false;
      stop.disabled = true;
    }
    if (result) {
      last = { body, run: result };
      chart.set([{ label: "answer", tokens: result.tokens }]);
      statsLine($("pg-stats"), result);
      $("pg-png").disabled = $("pg-json").disabled = false;
    }
  }

  $("pg-form").addEventListener("submit", (e) => { e.preventDefault(); run(); });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); run(); }
  });
  stop.addEventListener("click", () => controller && controller.abort());
  $("pg-clear").addEventListener("click", () => {
    history = [];
    transcript.replaceChildren();
    showMessage($("pg-message"), null);
  });
  $("pg-png").addEventListener("click", async () => {
    const blob = await chart.png();
    if (blob) download(blob, "entropic-trace.png");
  });
  $("pg-json").addEventListener("click", () => {
    if (last) downloadJSON(runRecord("answer", last.body, last.run), "entropic-trace.json");
  });
}
