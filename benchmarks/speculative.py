"""Speculative decoding on against off: same prompts, same seeds, alternating rounds.

    python benchmarks/speculative.py --quick   # 4 prompts per workload, 64 new tokens,
                                               # batch 1 and 4, greedy and T=0.7, 1 round
    python benchmarks/speculative.py           # 8 prompts (16 at batch 16), 128 tokens,
                                               # batch 1, 4 and 16, 2 rounds

Modes, each on its own engine over the same weights (default model, bf16, native kernels):
- off: plain decoding;
- fixed: prompt lookup that always drafts num_speculative_tokens tokens where a match
  exists (the control: what plain prompt lookup does elsewhere);
- gate: prompt lookup under the entropy gate (entropic.speculative.gate).
The engines live for the whole run, so the gate learns online from a cold start, as a
server does.

Workloads (docs/speculative.md says how each prompt is built):
- xsum, aclsum: summarise a news article / a paper (packaged subsets, data/README.md);
- code: rewrite a Python standard-library function (its docstrings stripped) with a
  docstring and type hints, the code kept (sources of this Python, PSF licence);
- quote: multi-turn chat whose last turn asks to quote the previous answer and continue;
- chat: plain ShareGPT first turns;
- mixed: the five above, interleaved.

Per (workload, batch, temperature, mode): output tokens per wall second over the whole
set (N prompts submitted at once, max_num_seqs = batch; at batch 1 the modes take turns
prompt by prompt, ABC CBA, so that the host's drift between compared runs is seconds), the
speedup against off within the same round (median over rounds; each round's in
"speedups"), acceptance rate, tokens per forward pass, gate-open
rate, and whether every request's token ids equal the off run's (T=0 greedy; T=0.7 seeded
per prompt, so the ids must match as well). Also c(k): the wall time of a step verifying
k drafted tokens (k + 1 rows of one sequence) over a one-row decode step, k = 1..8.
Writes a JSON file (--out) after every workload.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

from entropic import LLM, SamplingParams
from entropic.bench.machine import add_common_args, describe, header, write_json
from entropic.bench.datasets import load_aclsum, load_sharegpt_prompts, load_xsum
from entropic.config import EngineConfig
from entropic.control.clock import EntropicClock
from entropic.control.thermostat import Thermostat
from entropic.engine.engine import LLMEngine
from entropic.engine.scheduler import ScheduledChunk, SchedulerOutput
from entropic.speculative import SpeculativeConfig, Speculator

ROOT = Path(__file__).resolve().parents[1]

MODES = ("off", "fixed", "gate")
CODE_MODULES = ("textwrap", "shlex", "fnmatch", "difflib", "csv", "json.encoder", "calendar",
                "statistics", "heapq", "bisect", "colorsys", "html", "string", "glob",
                "posixpath", "base64", "ipaddress", "pprint", "copy")


def _strip_docstrings(src: str) -> str:
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def code_functions(n: int) -> list[str]:
    """n standard-library functions of 6..40 lines, docstrings stripped, in a fixed order."""
    out = []
    for name in CODE_MODULES:
        mod = importlib.import_module(name)
        taken = 0
        for attr, fn in sorted(vars(mod).items()):
            if attr.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != name:
                continue
            try:
                src = _strip_docstrings(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError, SyntaxError):
                continue
            if 6 <= src.count("\n") + 1 <= 40:
                out.append(src)
                taken += 1
                if taken == 2:  # two per module at most: variety
                    break
        if len(out) == n:
            break
    return out


def workloads(tok, n: int) -> dict[str, list[list[int]]]:
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}])  # noqa
    sets = {
        "xsum": [chat("Summarise this article in three sentences.\n\n" + r["article"][:2400])
                 for r in load_xsum(n)],
        "aclsum": [chat("Summarise this paper: its challenge, approach and outcome.\n\n"
                        + r["document"][:3000]) for r in load_aclsum(n)],
        "code": [chat("Rewrite this Python function with a docstring and type hints. Keep "
                      "the code exactly the same.\n\n```python\n" + src + "\n```")
                 for src in code_functions(n)],
    }
    recs = [r for r in load_sharegpt_prompts(200) if 200 < len(r["reference"])][:2 * n]
    sets["quote"] = [tok.apply_chat_template([
        {"role": "user", "content": r["prompt"][:1200]},
        {"role": "assistant", "content": r["reference"][:900]},
        {"role": "user", "content": "Quote the first three sentences of your answer exactly, "
                                    "then add one more example."}]) for r in recs[:n]]
    sets["chat"] = [chat(r["prompt"][:1500]) for r in recs[n:2 * n]]
    if len(sets["code"]) < n:
        raise RuntimeError(f"only {len(sets['code'])} code functions found, {n} wanted")
    names = list(sets)
    sets["mixed"] = [sets[names[i % len(names)]][i // len(names)] for i in range(n)]
    return sets


def make_engine(llm: LLM, mode: str, batch: int, k: int) -> LLMEngine:
    spec = None
    if mode != "off":
        spec = Speculator(SpeculativeConfig(num_speculative_tokens=k,
                                            gate="fixed" if mode == "fixed" else "entropy"))
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=2048, kv_cache_gib=1.0)
    return LLMEngine(llm.engine.model, llm.tokenizer, cfg, processors=[Thermostat()],
                     observer=EntropicClock(), speculator=spec)


SPEC_COUNTERS = ("drafted_tokens", "accepted_tokens", "decode_steps", "committed_tokens",
                 "gate_checks", "gate_open", "drafts")


def run_set(engine: LLMEngine, prompts: list[list[int]], temperature: float,
            max_tokens: int, first: int = 0) -> dict:
    """Run `prompts` (seeds 1000 + first + i) to completion on `engine`."""
    before = engine.speculator.stats.as_dict() if engine.speculator else None
    for i, p in enumerate(prompts, start=first):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1000 + i)
        engine.add_request(f"q{i}", p, params)
    t0 = time.perf_counter()
    outs = {o.request_id: o for o in engine.run_until_done()}
    wall = time.perf_counter() - t0
    ids = [outs[f"q{i}"].token_ids for i in range(first, first + len(prompts))]
    res = {"wall_s": wall, "tokens": sum(map(len, ids)), "ids": ids}
    if before is not None:
        after = engine.speculator.stats.as_dict()
        res["spec"] = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    return res


def run_round(engines: dict, modes: tuple[str, ...], batch: int, prompts: list[list[int]],
              temperature: float, max_tokens: int, flip: bool) -> dict[str, dict]:
    """One round of every mode over the same prompts. At batch 1 the modes alternate per
    prompt (ABC, CBA, ...), so that the host's drift between compared runs is a few
    seconds, not a whole set's; at larger batches each mode runs the whole set at once
    (a chunk would drain the batch), in alternating order."""
    chunk = 1 if batch == 1 else len(prompts)
    parts: dict[str, list[dict]] = {m: [] for m in modes}
    for c, start in enumerate(range(0, len(prompts), chunk)):
        order = modes if (c % 2 == 0) != flip else modes[::-1]
        for m in order:
            parts[m].append(run_set(engines[(m, batch)], prompts[start:start + chunk],
                                    temperature, max_tokens, first=start))
    out = {}
    for m, runs in parts.items():
        res = {"wall_s": sum(x["wall_s"] for x in runs),
               "tokens": sum(x["tokens"] for x in runs),
               "ids": [i for x in runs for i in x["ids"]]}
        res["tok_s"] = res["tokens"] / res["wall_s"]
        if runs[0].get("spec") is not None:
            d = {k: sum(x["spec"][k] for x in runs) for k in SPEC_COUNTERS}
            d["acceptance_rate"] = (d["accepted_tokens"] / d["drafted_tokens"]
                                    if d["drafted_tokens"] else 0.0)
            d["tokens_per_forward"] = (d["committed_tokens"] / d["decode_steps"]
                                       if d["decode_steps"] else 0.0)
            d["gate_open_rate"] = d["gate_open"] / d["gate_checks"] if d["gate_checks"] else 0.0
            res["spec"] = d
        out[m] = res
    return out


def verify_cost(llm: LLM, contexts=(256, 1024), ks=range(0, 9), repeats: int = 9) -> dict:
    """c(k) = step time of k + 1 decode rows of one sequence / one decode row."""
    eng = make_engine(llm, "off", 1, 1)
    run = eng.runner
    p = SamplingParams(temperature=0, max_tokens=1)
    out = {}
    for ctx in contexts:
        eng.kv.allocate("c", ctx + 16)
        table = list(eng.kv.block_table("c"))
        times: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(repeats):
            for k in ks:
                chunks = [ScheduledChunk("c", [100 + j], ctx + j, table, True, p, 0)
                          for j in range(k + 1)]
                t = time.perf_counter()
                run.execute(SchedulerOutput(1, chunks))
                times[k].append(time.perf_counter() - t)
        eng.kv.free("c")
        base = statistics.median(times[0])
        out[str(ctx)] = {str(k): statistics.median(times[k]) / base for k in ks}
        out[str(ctx)]["decode_ms"] = base * 1e3
    return out


def llama_cpp_lookup(model_path: str, sets: dict, workloads: list[str], n: int,
                     max_tokens: int, k: int, threads: int, rounds: int,
                     extra_bufts: bool = True) -> dict:
    """llama.cpp's lookup decoding beside ours: llama-cpp-python on the same GGUF (its own
    Q4_1 kernels), greedy, batch 1, the same prompt ids, stopping at EOS or max_tokens, with
    and without `LlamaPromptLookupDecoding(num_pred_tokens=k)`; whole wall time per set
    (prefill included, as for ours). `extra_bufts=False` loads the weights without
    llama.cpp's extra buffer types (AMX and repacked layouts)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from peers import llama_cpp_without_extra_bufts

    if not extra_bufts:
        llama_cpp_without_extra_bufts()

    def make(draft):
        # n_batch = n_ctx: with a draft model llama-cpp-python keeps logits for every
        # evaluated position in an n_batch-row buffer indexed by position (past 512 it fails)
        return llama_cpp.Llama(model_path=model_path, n_ctx=4096, n_batch=4096,
                               n_threads=threads, n_threads_batch=threads, verbose=False,
                               draft_model=draft)

    llms = {"off": make(None), "lookup": make(LlamaPromptLookupDecoding(num_pred_tokens=k))}
    eos = llms["off"].token_eos()

    def run(llm, prompts):
        ids, t0 = [], time.perf_counter()
        for p in prompts:
            llm.reset()
            out = []
            for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                  repeat_penalty=1.0, reset=True):
                if t == eos:
                    break
                out.append(t)
                if len(out) == max_tokens:
                    break
            ids.append(out)
        wall = time.perf_counter() - t0
        return {"tok_s": sum(map(len, ids)) / wall, "ids": ids}

    res = {"version": llama_cpp.__version__, "k": k, "extra_bufts": extra_bufts, "rows": []}
    for w in workloads:
        prompts = sets[w][:n]
        per = {"off": [], "lookup": []}
        for r in range(rounds):
            for m in (("off", "lookup") if r % 2 == 0 else ("lookup", "off")):
                per[m].append(run(llms[m], prompts))
        row = {"workload": w,
               "off_tok_s": statistics.median(x["tok_s"] for x in per["off"]),
               "lookup_tok_s": statistics.median(x["tok_s"] for x in per["lookup"]),
               "speedup": statistics.median(x["tok_s"] / o["tok_s"]
                                            for x, o in zip(per["lookup"], per["off"])),
               "same_ids": all(x["ids"] == o["ids"] for x, o in zip(per["lookup"], per["off"]))}
        print(f"llama.cpp {w:8} off {row['off_tok_s']:7.1f} lookup {row['lookup_tok_s']:7.1f} "
              f"tok/s {row['speedup']:5.2f}x same_ids {row['same_ids']}", flush=True)
        res["rows"].append(row)
    return res


def llama_cpp_in_child(sets: dict, workloads: list[str], n: int, max_tokens: int, k: int,
                       threads: int, rounds: int, model: str | None = None) -> dict:
    """llama_cpp_lookup in a child process (a crash there loses nothing of ours); the
    prompts travel as token ids in a JSON file. llama-cpp-python 0.3.36 built on a CPU with
    AMX crashes (SIGSEGV) in its first decode with its extra buffer types (AMX, repacked
    Q4_1); then the run is repeated without them, and the result says so."""
    import subprocess
    import tempfile

    from entropic.model.loader import default_model_path
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for extra in (True, False):
            work, res = Path(tmp) / "work.json", Path(tmp) / "result.json"
            work.write_text(json.dumps({
                "model": model or default_model_path(), "workloads": workloads,
                "sets": {w: sets[w][:n] for w in workloads}, "n": n, "max_tokens": max_tokens,
                "k": k, "threads": threads, "rounds": rounds, "extra_bufts": extra}))
            proc = subprocess.run([sys.executable, __file__, "--llama-cpp-child", str(work),
                                   "--out", str(res)])
            if proc.returncode == 0:
                out = json.loads(res.read_text())
                out["failed_first"] = errors
                return out
            errors.append(f"extra_bufts={extra}: the llama.cpp child exited with "
                          f"{proc.returncode}")
            print(errors[-1], flush=True)
    return {"error": "; ".join(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, out=str(ROOT / "benchmarks" / "results" / "speculative.json"),
                    model="local GGUF file or HF directory (default: the embedded model; "
                          "llama.cpp's side needs a GGUF file)",
                    quick="4 prompts, 64 tokens, batches 1 and 4, 1 round")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--temperatures", default="0,0.7", help="comma-separated, 0 = greedy")
    ap.add_argument("--workloads", default="xsum,aclsum,code,quote,chat,mixed")
    ap.add_argument("--no-llama-cpp", action="store_true",
                    help="skip llama.cpp's lookup decoding (llama-cpp-python) side by side")
    ap.add_argument("--batches", default=None, help="batch sizes, e.g. 1,4,16")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES), help="off first, e.g. off,gate")
    ap.add_argument("--quantization", choices=("int4", "int8"), default=None,
                    help="the model's projections (default: LLM()'s floats, fp32 on CPUs "
                         "without bf16; int4 is the CLI's default at batch 1)")
    ap.add_argument("--llama-cpp-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.llama_cpp_child:
        w = json.loads(Path(a.llama_cpp_child).read_text())
        Path(a.out).write_text(json.dumps(llama_cpp_lookup(
            w["model"], w["sets"], w["workloads"], w["n"], w["max_tokens"], w["k"],
            w["threads"], w["rounds"], w["extra_bufts"])))
        return
    torch.set_num_threads(a.threads)
    n, max_tokens, batches, rounds = (4, 64, (1, 4), 1) if a.quick else (8, 128, (1, 4, 16), 2)
    if a.batches:
        batches = tuple(int(b) for b in a.batches.split(","))
    rounds = a.rounds or rounds
    modes = tuple(a.modes.split(","))
    if modes[0] != "off" or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes must start with off and name modes from {MODES}")
    temps = tuple(float(t) for t in a.temperatures.split(","))
    llm = LLM(model=a.model, quantization=a.quantization,
              enable_prefix_caching=False)  # rounds replay the same prompts
    sets = workloads(llm.tokenizer, max(n, max(batches)))
    machine = describe(a.threads)
    result = {"machine": machine, "cpu": machine["cpu"], "flags": machine["flags"],
              "threads": a.threads, "dtype": str(llm.engine.model.dtype).removeprefix("torch."),
              "quantization": a.quantization,
              "torch": torch.__version__, "quick": a.quick, "max_tokens": max_tokens,
              "batches": list(batches), "rounds": rounds, "modes": list(modes),
              "k": a.k, "c_of_k": verify_cost(llm), "runs": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"# {header(machine)}")
    print("c(k) at context 256:", {k: round(v, 2) for k, v in result["c_of_k"]["256"].items()})
    engines = {(m, b): make_engine(llm, m, b, a.k) for m in modes for b in batches}
    print(f"{'workload':8} {'b':>3} {'T':>4} {'mode':6} {'tok/s':>7} {'speedup':>8} "
          f"{'accept':>7} {'tok/fwd':>7} {'gate':>5} same_ids")
    for w in a.workloads.split(","):
        for b in batches:
            prompts = sets[w][:max(n, b)]
            for temp in temps:
                per_round: dict[str, list[dict]] = {m: [] for m in modes}
                for r in range(rounds):
                    got = run_round(engines, modes, b, prompts, temp, max_tokens, r % 2 == 1)
                    for m in modes:
                        per_round[m].append(got[m])
                row = {"workload": w, "batch": b, "temperature": temp, "n": len(prompts)}
                for m in modes:
                    runs = per_round[m]
                    row[m] = {
                        "tok_s": statistics.median(x["tok_s"] for x in runs),
                        "speedup": statistics.median(
                            x["tok_s"] / o["tok_s"] for x, o in zip(runs, per_round["off"])),
                        "speedups": [x["tok_s"] / o["tok_s"]
                                     for x, o in zip(runs, per_round["off"])],
                        "same_ids": all(x["ids"] == o["ids"]
                                        for x, o in zip(runs, per_round["off"])),
                        "spec": runs[-1].get("spec"),
                    }
                    sp = row[m]["spec"] or {}
                    print(f"{w:8} {b:>3} {temp:>4} {m:6} {row[m]['tok_s']:7.1f} "
                          f"{row[m]['speedup']:7.2f}x {sp.get('acceptance_rate', 0):7.2f} "
                          f"{sp.get('tokens_per_forward', 1):7.2f} "
                          f"{sp.get('gate_open_rate', 0):5.2f} {row[m]['same_ids']}",
                          flush=True)
                result["runs"].append(row)
        out.write_text(json.dumps(result, indent=1))
    if a.no_llama_cpp:
        result["llama_cpp"] = "skipped (--no-llama-cpp)"
    elif importlib.util.find_spec("llama_cpp") is None:
        result["llama_cpp"] = "llama-cpp-python is not installed: pip install llama-cpp-python"
        print(result["llama_cpp"])
    else:
        result["llama_cpp"] = llama_cpp_in_child(sets, a.workloads.split(","), n,
                                                 max_tokens, a.k, a.threads, rounds, a.model)
    gate_stats = {f"b{b}": engines[("gate", b)].speculator.stats.as_dict() for b in batches
                  if ("gate", b) in engines}
    result["gate_stats"] = gate_stats
    write_json(out, result)


if __name__ == "__main__":
    main()
