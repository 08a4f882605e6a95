"""Runs vLLM (in its own virtual environment) for tests_vllm/, writing what it did as JSON.

    VENV/bin/python tests_vllm/vllm_runs.py SCENARIO HF_DIR OUT.json

Scenarios:
- baseline: plain vLLM, no plugin; greedy requests.
- plugin: the thermostat processor and the trace extension loaded; the same greedy requests
  in one batch with seeded thermostat requests (stabilize and follow).
- preempt: the plugin with a KV cache too small for its four thermostat requests, so vLLM
  preempts (and later recomputes) some of them.
- pruning: the pruning processor (which installs the pruning attention backend) and the
  trace extension; the greedy requests beside two long ones (880-token prompts) that opt in
  to pruning, in phases: a config that never binds, a fixed quarter budget, the entropy
  law, the default no-regret gate; the backend's counters after each phase.
(baseline also runs the greedy requests beside the two long prompts, plain: "mixed".)
One thread (VLLM_CPU_OMP_THREADS_BIND=0 is set by the caller), fp32, eager (no compile).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = ["The capital of France is", "Write a haiku about autumn:",
           "def fibonacci(n):", "Three facts about the moon:"]
GREEDY_TOKENS = 24
THERMO = [  # (extra_args["thermostat"], temperature, seed, max_tokens)
    ({"target_entropy": 2.0, "eta": 0.3, "t_min": 0.3, "t_max": 2.5}, 1.2, 1, 24),
    ({"target_entropy": 2.5, "eta": 0.2, "t_min": 0.4, "t_max": 2.0, "h_min": 0.1,
      "mode": "follow"}, 0.9, 2, 24),
]
PREEMPT_TOKENS = 160
LONG_DOCS = ("docs/design.md", "docs/entropy.md")  # prose, cut to LONG_PROMPT_TOKENS
LONG_PROMPT_TOKENS = 880  # 7 blocks of vLLM's 128 tokens; 8 by the last of LONG_TOKENS
LONG_TOKENS = 48
PRUNING = {  # phase -> extra_args["pruning"] of the long requests
    "never_binds": {"min_blocks": 64, "min_attention_share": 0.0},
    "fixed": {"adaptive": False, "min_keep_fraction": 0.25, "min_attention_share": 0.0},
    "adaptive": {"min_attention_share": 0.0},
}
FP32_TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32


def build(hf_dir: str, plugin: bool | str, kv_tokens: int, max_model_len: int):
    from vllm import LLM

    kw = {}
    if plugin == "pruning":
        from entropic_vllm.pruning import PruningLogitsProcessor
        from entropic_vllm.traces import EXTENSION
        kw = {"logits_processors": [PruningLogitsProcessor], "worker_extension_cls": EXTENSION}
    elif plugin:
        from entropic_vllm import ThermostatLogitsProcessor
        from entropic_vllm.traces import EXTENSION
        kw = {"logits_processors": [ThermostatLogitsProcessor], "worker_extension_cls": EXTENSION}
    return LLM(model=hf_dir, dtype="float32", enforce_eager=True, seed=0, max_num_seqs=8,
               max_model_len=max_model_len, enable_prefix_caching=False,
               kv_cache_memory_bytes=kv_tokens * FP32_TOKEN_BYTES, disable_log_stats=False,
               **kw)


def record(outs, traces=None, keys=None):
    rows = []
    for i, o in enumerate(outs):
        row = {"prompt_token_ids": list(o.prompt_token_ids),
               "token_ids": list(o.outputs[0].token_ids)}
        if keys and keys[i] is not None:
            row["trace"] = traces.get(keys[i])
        rows.append(row)
    return rows


def long_prompts(llm) -> list:
    from vllm.inputs import TokensPrompt
    tok = llm.get_tokenizer()
    root = Path(__file__).resolve().parents[1]
    return [TokensPrompt(prompt_token_ids=tok.encode((root / p).read_text())[:LONG_PROMPT_TOKENS])
            for p in LONG_DOCS]


def long_greedy(pruning: dict | None):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True,
                          extra_args=None if pruning is None else {"pruning": pruning})


def pruning_phases(llm, greedy) -> dict:
    from entropic_vllm.traces import fetch_pruning_stats
    from vllm import SamplingParams

    longs = long_prompts(llm)
    fetch_pruning_stats(llm)  # zero the counters
    out: dict = {}
    for name, cfg in PRUNING.items():
        outs = llm.generate(PROMPTS + longs, greedy + [long_greedy(cfg) for _ in longs],
                            use_tqdm=False)
        rows = record(outs)
        out[name] = {"config": cfg, "greedy": rows[:len(PROMPTS)], "long": rows[len(PROMPTS):],
                     "stats": fetch_pruning_stats(llm)}
    llm.generate(longs, [long_greedy({}) for _ in longs], use_tqdm=False)
    out["gate"] = {"config": {}, "stats": fetch_pruning_stats(llm)}
    try:
        llm.generate(["x"], SamplingParams(max_tokens=2, extra_args={"pruning": {"score": "mass"}}),
                     use_tqdm=False)
        out["bad_params_error"] = None
    except Exception as e:
        out["bad_params_error"] = f"{type(e).__name__}: {e}"
    return out


def preemptions(llm) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics()
               if m.name == "vllm:num_preemptions")


def main() -> None:
    scenario, hf_dir, out_path = sys.argv[1:4]
    from vllm import SamplingParams

    greedy = [SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
              for _ in PROMPTS]
    result: dict = {"scenario": scenario}
    if scenario == "baseline":
        llm = build(hf_dir, False, 4096, 1024)
        result["greedy"] = record(llm.generate(PROMPTS, greedy, use_tqdm=False))
        # the pruning scenario's batches, plain: the greedy requests beside the long ones
        longs = long_prompts(llm)
        rows = record(llm.generate(PROMPTS + longs,
                                   greedy + [long_greedy(None) for _ in longs], use_tqdm=False))
        result["mixed"] = {"greedy": rows[:len(PROMPTS)], "long": rows[len(PROMPTS):]}
    elif scenario == "pruning":
        llm = build(hf_dir, "pruning", 4096, 1024)
        result.update(pruning_phases(llm, greedy))
    elif scenario == "plugin":
        from entropic_vllm.traces import fetch_traces
        llm = build(hf_dir, True, 4096, 1024)
        params, keys, prompts = list(greedy), [None] * len(PROMPTS), list(PROMPTS)
        for j, (th, temp, seed, n) in enumerate(THERMO):
            keys.append(f"thermo{j}")
            prompts.append(PROMPTS[j])
            params.append(SamplingParams(max_tokens=n, temperature=temp, seed=seed,
                                         ignore_eos=True,
                                         extra_args={"thermostat": th,
                                                     "entropic_trace": f"thermo{j}"}))
        outs = llm.generate(prompts, params, use_tqdm=False)
        rows = record(outs, fetch_traces(llm, [k for k in keys if k]), keys)
        result["greedy"] = rows[:len(PROMPTS)]
        result["thermostat"] = [dict(r, thermostat=th, temperature=temp, seed=seed)
                                for r, (th, temp, seed, _) in zip(rows[len(PROMPTS):], THERMO)]
        try:
            llm.generate(["x"], SamplingParams(max_tokens=2,
                                               extra_args={"thermostat": {"eta": -1.0}}),
                         use_tqdm=False)
            result["bad_params_error"] = None
        except Exception as e:  # what an offline user sees for bad arguments
            result["bad_params_error"] = f"{type(e).__name__}: {e}"
    elif scenario == "preempt":
        from entropic_vllm.traces import fetch_traces
        # 4 requests of ~8 + 160 tokens need ~700 slots; the cache holds 384
        llm = build(hf_dir, True, 384, 256)
        th = {"target_entropy": 2.0, "eta": 0.3, "t_min": 0.3, "t_max": 2.5}
        keys = [f"pre{i}" for i in range(len(PROMPTS))]
        params = [SamplingParams(max_tokens=PREEMPT_TOKENS, temperature=1.7, seed=10 + i,
                                 ignore_eos=True,
                                 extra_args={"thermostat": th, "entropic_trace": k})
                  for i, k in enumerate(keys)]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        result["thermostat"] = [dict(r, thermostat=th, temperature=1.7)
                                for r in record(outs, fetch_traces(llm, keys), keys)]
        result["preemptions"] = preemptions(llm)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}: baseline, plugin, preempt or pruning")
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
