// Talking to the server: the API key, request bodies, and SSE streams read into token records.
// A token record is {text, logprob, top: [{token, logprob}], entropy, temperature,
// tempered_entropy}, the same for chat and completions; see docs/lens.md.

const KEY_STORE = "entropic-lens-key"; // sessionStorage: this tab only, never the server
const TOP_ALTERNATIVES = 5;

let apiKey = sessionStorage.getItem(KEY_STORE) || "";

export function setApiKey(key) {
  apiKey = key.trim();
  if (apiKey) sessionStorage.setItem(KEY_STORE, apiKey);
  else sessionStorage.removeItem(KEY_STORE);
}

export function getApiKey() {
  return apiKey;
}

function headers(extra = {}) {
  const h = { ...extra };
  if (apiKey) h.Authorization = "Bearer " + apiKey;
  return h;
}

// Why a call failed: kind is "auth" (401), "http" (another error status), "inband" (an
// error inside a stream), "dropped" (the connection broke mid-stream) or "aborted" (Stop).
export class LensError extends Error {
  constructor(kind, message, status = null) {
    super(message);
    this.kind = kind;
    this.status = status;
  }
}

async function errorOf(resp) {
  let msg = resp.statusText || "error";
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) msg = body.error.message;
  } catch (e) { /* not JSON: keep the status text */ }
  if (resp.status === 401) {
    return new LensError("auth", apiKey ? "the server refused this API key: " + msg
      : "this server needs an API key: enter it at the top right", 401);
  }
  return new LensError("http", `HTTP ${resp.status}: ${msg}`, resp.status);
}

export async function getText(path) {
  const resp = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!resp.ok) throw await errorOf(resp);
  return resp.text();
}

export async function getJSON(path) {
  return JSON.parse(await getText(path));
}

// ---- request bodies ------------------------------------------------------------------------
// settings: {temperature, top_p, max_tokens, seed, stop: [..], thermostat: null | {...}}
function common(s) {
  const body = { stream: true, stream_options: { include_usage: true },
                 max_tokens: s.max_tokens, temperature: s.temperature, top_p: s.top_p,
                 entropic: { entropy: true } };
  if (s.seed !== null) body.seed = s.seed;
  if (s.stop.length) body.stop = s.stop;
  if (s.thermostat) body.entropic.thermostat = { ...s.thermostat };
  return body;
}

export function chatBody(messages, s) {
  return { messages, ...common(s), logprobs: true, top_logprobs: TOP_ALTERNATIVES };
}

export function completionBody(prompt, s) {
  return { prompt, ...common(s), logprobs: TOP_ALTERNATIVES };
}

// ---- reading a stream ----------------------------------------------------------------------
function chatTokens(choice) {
  const content = (choice.logprobs && choice.logprobs.content) || [];
  return content.map((c) => ({ text: c.token, logprob: c.logprob,
    top: (c.top_logprobs || []).map((t) => ({ token: t.token, logprob: t.logprob })) }));
}

function completionTokens(choice) {
  const lp = choice.logprobs;
  if (!lp) return [];
  return lp.tokens.map((tok, i) => ({ text: tok, logprob: lp.token_logprobs[i],
    top: Object.entries(lp.top_logprobs[i] || {})
      .map(([token, logprob]) => ({ token, logprob }))
      .sort((a, b) => b.logprob - a.logprob) }));
}

function tokensOf(choice, chat) {
  const toks = chat ? chatTokens(choice) : completionTokens(choice);
  const ent = choice.entropic || {};
  const hs = ent.entropies || [], ts = ent.temperatures || [];
  const hts = ent.tempered_entropies || [];
  const reading = (i) => ({ entropy: hs[i], temperature: ts[i],
                            tempered_entropy: hts[i] === undefined ? null : hts[i] });
  toks.forEach((t, i) => Object.assign(t, reading(i)));
  // entropy without logprobs (should not happen here, but keep the readings)
  for (let i = toks.length; i < hs.length; i++) {
    toks.push({ text: "", logprob: null, top: [], ...reading(i) });
  }
  return toks;
}

// POST `body` to `path` and read its SSE stream. Calls onTokens(records) as tokens arrive
// and onText(delta) with the response text. Resolves to {tokens, text, final, finish_reason,
// usage}; rejects with a LensError whose `partial` holds what arrived before the failure.
export async function stream(path, body, { signal, onTokens = () => {}, onText = () => {} } = {}) {
  const chat = path.endsWith("/chat/completions");
  const run = { tokens: [], text: "", final: null, finish_reason: null, usage: null };
  const fail = (err) => { err.partial = run; return err; };
  let resp;
  try {
    resp = await fetch(path, { method: "POST", signal, body: JSON.stringify(body),
      headers: headers({ "Content-Type": "application/json" }) });
  } catch (e) {
    if (signal && signal.aborted) throw fail(new LensError("aborted", "stopped"));
    throw fail(new LensError("dropped", "could not reach the server (" + e.message + ")"));
  }
  if (!resp.ok) throw fail(await errorOf(resp));
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "", done = false;
  const handle = (data) => {
    if (data === "[DONE]") { done = true; return; }
    const msg = JSON.parse(data);
    if (msg.error) throw new LensError("inband", "the server reported: " + msg.error.message);
    if (msg.usage) run.usage = msg.usage;
    for (const choice of msg.choices || []) {
      const text = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
      if (text) { run.text += text; onText(text); }
      const toks = tokensOf(choice, chat);
      if (toks.length) { run.tokens.push(...toks); onTokens(toks); }
      if (choice.finish_reason) run.finish_reason = choice.finish_reason;
      if (choice.entropic && choice.entropic.tau !== undefined) run.final = choice.entropic;
    }
  };
  try {
    while (!done) {
      const { value, done: eof } = await reader.read();
      if (eof) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while (!done && (cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) handle(line.slice(6));
        }
      }
    }
  } catch (e) {
    if (e instanceof LensError) throw fail(e);
    if (signal && signal.aborted) throw fail(new LensError("aborted", "stopped"));
    throw fail(new LensError("dropped", "the stream broke off (" + e.message + ")"));
  }
  if (!done) throw fail(new LensError("dropped", "the connection closed before the answer ended"));
  return run;
}
