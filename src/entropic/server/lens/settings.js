// A panel of sampling controls, built from a field list so the playground and both sides of
// Compare share one definition. read() returns the settings api.js turns into a body.

// The thermostat's defaults are ThermostatOptions' (server/protocol.py).
const FIELDS = {
  temperature: { label: "temperature", value: 0.7, step: 0.05, min: 0,
                 hint: "T_0 when the thermostat is on" },
  top_p: { label: "top-p", value: 1.0, step: 0.05, min: 0, max: 1 },
  max_tokens: { label: "max tokens", value: 96, step: 1, min: 1, int: true },
  seed: { label: "seed", value: 1, step: 1, int: true, optional: true, hint: "empty: random" },
};
const THERMOSTAT = {
  target_entropy: { label: "H* (nats)", value: 2.0, step: 0.1, min: 0 },
  eta: { label: "eta", value: 0.2, step: 0.05, min: 0 },
  t_min: { label: "T_min", value: 0.2, step: 0.05, min: 0 },
  t_max: { label: "T_max", value: 2.0, step: 0.05, min: 0 },
};

function numberInput(id, spec) {
  const wrap = document.createElement("label");
  wrap.className = "field";
  const name = document.createElement("span");
  name.textContent = spec.label;
  const input = document.createElement("input");
  input.type = "number";
  input.id = id;
  input.step = String(spec.step);
  if (spec.min !== undefined) input.min = String(spec.min);
  if (spec.max !== undefined) input.max = String(spec.max);
  input.value = spec.value === null ? "" : String(spec.value);
  if (spec.hint) input.title = spec.hint;
  if (spec.optional) input.placeholder = spec.hint || "";
  wrap.append(name, input);
  return wrap;
}

// Build the controls into `el`. prefix: id prefix; fields: which of FIELDS to show; stop:
// whether to show the stop-strings box; thermostat: whether to show its box; values:
// defaults to override (thermostat: bool, the toggle).
export function samplerPanel(el, prefix, { fields = Object.keys(FIELDS), stop = true,
                                            thermostat = true, values = {} } = {}) {
  const inputs = {};
  for (const f of fields) {
    const spec = { ...FIELDS[f], ...(f in values ? { value: values[f] } : {}) };
    const w = numberInput(`${prefix}-${f}`, spec);
    inputs[f] = w.querySelector("input");
    el.append(w);
  }
  let stopBox = null;
  if (stop) {
    const w = document.createElement("label");
    w.className = "field wide";
    const name = document.createElement("span");
    name.textContent = "stop strings (one per line; \\n is a newline)";
    stopBox = document.createElement("textarea");
    stopBox.id = `${prefix}-stop`;
    stopBox.rows = 2;
    w.append(name, stopBox);
    el.append(w);
  }
  const box = document.createElement("fieldset");
  box.className = "thermostat";
  const legend = document.createElement("legend");
  const toggle = document.createElement("input");
  toggle.type = "checkbox";
  toggle.id = `${prefix}-thermostat`;
  toggle.checked = Boolean(values.thermostat);
  const tl = document.createElement("label");
  tl.htmlFor = toggle.id;
  tl.textContent = " thermostat";
  legend.append(toggle, tl);
  box.append(legend);
  const th = {};
  for (const [f, spec] of Object.entries(THERMOSTAT)) {
    const w = numberInput(`${prefix}-${f}`, spec);
    th[f] = w.querySelector("input");
    box.append(w);
  }
  const modeWrap = document.createElement("label");
  modeWrap.className = "field";
  const modeName = document.createElement("span");
  modeName.textContent = "mode";
  const mode = document.createElement("select");
  mode.id = `${prefix}-mode`;
  for (const m of ["stabilize", "follow"]) {
    const o = document.createElement("option");
    o.value = o.textContent = m;
    mode.append(o);
  }
  modeWrap.append(modeName, mode);
  box.append(modeWrap);
  const sync = () => box.classList.toggle("off", !toggle.checked);
  toggle.addEventListener("change", sync);
  sync();
  if (thermostat) el.append(box);
  else toggle.checked = false;

  const num = (input, spec) => {
    if (input.value.trim() === "") return spec.optional ? null : spec.value;
    const v = Number(input.value);
    if (!Number.isFinite(v)) throw new Error(`${spec.label}: not a number`);
    return spec.int ? Math.round(v) : v;
  };
  return {
    toggle,
    // The settings, or an Error naming the bad field. Numbers that are floats on the
    // server are sent as JSON numbers; pydantic takes 1 for 1.0.
    read(overrides = {}) {
      const s = { seed: null, stop: [] };
      for (const f of fields) s[f] = num(inputs[f], FIELDS[f]);
      if (stopBox) {
        s.stop = stopBox.value.split("\n").filter((x) => x.length > 0)
          .map((x) => x.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
      }
      s.thermostat = null;
      if (toggle.checked) {
        s.thermostat = { mode: mode.value };
        for (const [f, spec] of Object.entries(THERMOSTAT)) s.thermostat[f] = num(th[f], spec);
      }
      return { ...s, ...overrides };
    },
  };
}
