// Small shared pieces of the page: the message line under a view, and what an error means.

// Show `text` in the message element `el` (kind: "error" | "info"); null kind hides it.
export function showMessage(el, kind, text = "") {
  el.hidden = kind === null;
  el.className = "message " + (kind || "");
  el.textContent = text;
}

// One sentence for a LensError (api.js), `n` tokens having arrived before it.
export function explain(err, n) {
  switch (err.kind) {
    case "auth":
      return "API key needed: " + err.message + ".";
    case "dropped":
      return `The stream was cut off after ${n} token${n === 1 ? "" : "s"}: ${err.message}. ` +
        "What arrived is kept above; the prompt is back in the box, send it again to retry.";
    case "aborted":
      return `Stopped after ${n} token${n === 1 ? "" : "s"}.`;
    case "inband":
      return `The request failed after ${n} token${n === 1 ? "" : "s"}: ${err.message}.`;
    default:
      return "The request failed: " + err.message;
  }
}
