// Tokens coloured by entropy, and the card that explains one token. Model and prompt text
// only ever reach the page as textContent (never innerHTML), so it cannot become markup.

// Entropy (nats) -> background colour: a piecewise-linear ramp over [0, H_MAX]; entropies
// above H_MAX get the last colour. tests/test_lens.py recomputes it from the API's numbers.
export const H_MAX = 6.0;
const STOPS = [
  [0.0, [224, 236, 255]],  // pale blue: the model is sure
  [0.25, [190, 235, 200]], // green
  [0.5, [255, 240, 150]],  // yellow
  [0.75, [255, 190, 110]], // orange
  [1.0, [245, 120, 120]],  // red: the model is unsure
];

export function entropyColour(h) {
  const t = Math.min(Math.max(h / H_MAX, 0), 1);
  let i = 1;
  while (i < STOPS.length - 1 && t > STOPS[i][0]) i++;
  const [t0, c0] = STOPS[i - 1], [t1, c1] = STOPS[i];
  const f = (t - t0) / (t1 - t0);
  const rgb = c0.map((c, k) => Math.round(c + f * (c1[k] - c)));
  return `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;
}

// The colour scale under the page header: a few swatches with their entropies.
export function fillLegend(el) {
  el.replaceChildren();
  for (let h = 0; h <= H_MAX; h += 1) {
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.backgroundColor = entropyColour(h);
    sw.textContent = h === H_MAX ? `≥${h}` : String(h);
    el.append(sw);
  }
}

export function fmt(x, digits = 3) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits);
}

export function pct(logprob) {
  if (logprob === null || logprob === undefined) return "–";
  const p = Math.exp(logprob) * 100;
  return p >= 10 ? p.toFixed(1) + "%" : p.toPrecision(2) + "%";
}

// A token's text as shown in the card: whitespace made visible.
function visible(s) {
  return s.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
}

// Append token records to `el` as spans; `offset` is the index of the first one.
export function appendTokens(el, records, offset) {
  records.forEach((rec, k) => {
    const span = document.createElement("span");
    span.className = "tok";
    span.tabIndex = 0;
    span.textContent = rec.text;
    span.dataset.i = String(offset + k);
    if (rec.entropy !== undefined) {
      span.dataset.entropy = String(rec.entropy);
      span.style.backgroundColor = entropyColour(rec.entropy);
    }
    el.append(span);
  });
}

// The hover card, shared by every token view. `lookup(span)` returns the span's record.
export class TokenCard {
  constructor(card) {
    this.card = card;
    this.pinned = null;
    document.addEventListener("keydown", (e) => { if (e.key === "Escape") this.hide(true); });
    document.addEventListener("click", (e) => {
      if (this.pinned && !e.target.closest(".tok") && !card.contains(e.target)) this.hide(true);
    });
  }

  // Wire a container of token spans: hover or focus shows the card, a click or tap pins it.
  watch(container, lookup) {
    const target = (e) => e.target.closest && e.target.closest(".tok");
    container.addEventListener("mouseover", (e) => {
      const t = target(e);
      if (t && !this.pinned) this.show(t, lookup(t));
    });
    container.addEventListener("mouseout", (e) => {
      if (target(e) && !this.pinned) this.hide(false);
    });
    container.addEventListener("focusin", (e) => {
      const t = target(e);
      if (t && !this.pinned) this.show(t, lookup(t));
    });
    container.addEventListener("click", (e) => {
      const t = target(e);
      if (!t) return;
      if (this.pinned === t) { this.hide(true); return; }
      this.pinned = null;
      this.show(t, lookup(t));
      this.pinned = t;
    });
  }

  hide(unpin) {
    if (unpin) this.pinned = null;
    if (!this.pinned) this.card.hidden = true;
  }

  show(span, rec) {
    if (!rec) return;
    const c = this.card;
    c.replaceChildren();
    const head = document.createElement("div");
    head.className = "card-head";
    const code = document.createElement("code");
    code.textContent = visible(rec.text);
    head.append(code, document.createTextNode(` · token ${Number(span.dataset.i) + 1}`));
    const dl = document.createElement("dl");
    const row = (name, value, cls) => {
      const dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = name;
      dd.textContent = value;
      if (cls) dd.className = cls;
      dl.append(dt, dd);
    };
    row("probability", pct(rec.logprob), "card-p");
    row("entropy H", fmt(rec.entropy) + " nats", "card-h");
    row("temperature", rec.temperature === 0 ? "0 (greedy)" : fmt(rec.temperature), "card-t");
    if (rec.tempered_entropy !== null && rec.tempered_entropy !== undefined) {
      row("H^T (sampled)", fmt(rec.tempered_entropy) + " nats", "card-ht");
    }
    const list = document.createElement("ol");
    list.className = "alts";
    for (const alt of rec.top) {
      const li = document.createElement("li");
      if (alt.token === rec.text) li.className = "chosen";
      const tok = document.createElement("code");
      tok.textContent = visible(alt.token);
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.style.width = (Math.exp(alt.logprob) * 100).toFixed(1) + "%";
      bar.append(fill);
      const p = document.createElement("span");
      p.className = "alt-p";
      p.textContent = pct(alt.logprob);
      li.append(tok, bar, p);
      list.append(li);
    }
    const altHead = document.createElement("div");
    altHead.className = "card-sub";
    altHead.textContent = rec.top.length ? "top alternatives" : "no alternatives returned";
    c.append(head, dl, altHead, list);
    c.hidden = false;
    const r = span.getBoundingClientRect();
    const w = c.offsetWidth, h = c.offsetHeight;
    let left = Math.min(r.left + window.scrollX, window.scrollX + document.documentElement.clientWidth - w - 8);
    let top = r.bottom + window.scrollY + 6;
    if (r.bottom + h + 12 > window.innerHeight && r.top > h + 12) top = r.top + window.scrollY - h - 6;
    c.style.left = Math.max(left, 4) + "px";
    c.style.top = top + "px";
  }
}
