// The entropy lens (docs/lens.md): tabs, the API key, and the three views.
import { getApiKey, getJSON, setApiKey } from "./api.js";
import { setupCompare } from "./compare.js";
import { setupPlayground } from "./playground.js";
import { setupServerView } from "./server_view.js";
import { TokenCard, fillLegend } from "./tokens.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["playground", "compare", "server"];

function show(view) {
  if (!VIEWS.includes(view)) view = "playground";
  for (const v of VIEWS) {
    $("view-" + v).hidden = v !== view;
    $("tab-" + v).setAttribute("aria-selected", String(v === view));
  }
  // charts sized while hidden get their width now
  window.dispatchEvent(new Event("resize"));
}

// The served model, from /v1/models (needs the key when the server has one).
async function status() {
  const el = $("server-status");
  try {
    const models = await getJSON("/v1/models");
    el.textContent = "model: " + models.data[0].id;
    el.className = "status ok";
  } catch (e) {
    el.textContent = e.kind === "auth" ? "API key needed" : "server: " + e.message;
    el.className = "status bad";
    if (e.kind === "auth") {
      $("api-key").placeholder = "this server needs a key";
      $("api-key").focus();
    }
  }
}

function main() {
  fillLegend($("entropy-legend"));
  const card = new TokenCard($("hovercard"));
  setupPlayground(card);
  setupCompare(card);
  setupServerView();
  for (const v of VIEWS) {
    $("tab-" + v).addEventListener("click", () => { location.hash = v; });
  }
  window.addEventListener("hashchange", () => show(location.hash.slice(1)));
  show(location.hash.slice(1));
  const key = $("api-key");
  key.value = getApiKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setApiKey(key.value);
    status();
  });
  status();
}

main();
