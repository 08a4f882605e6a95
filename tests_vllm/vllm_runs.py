"""Runs vLLM (in its own virtual environment) for tests_vllm/, writing what it did as JSON.

    VENV/bin/python tests_vllm/vllm_runs.py SCENARIO HF_DIR OUT.json

Scenarios:
- baseline: plain vLLM, no plugin; greedy requests.
- plugin: the thermostat processor and the trace extension loaded; the same greedy requests
  in one batch with seeded thermostat requests (stabilize and follow).
- preempt: the plugin with a KV cache too small for its four thermostat requests, so vLLM
  preempts (and later recomputes) some of them.
One thread (VLLM_CPU_OMP_THREADS_BIND=0 is set by the caller), fp32, eager (no compile).
"""
from __future__ import annotations

import json
import sys

PROMPTS = ["The capital of France is", "Write a haiku about autumn:",
           "def fibonacci(n):", "Three facts about the moon:"]
GREEDY_TOKENS = 24
THERMO = [  # (extra_args["thermostat"], temperature, seed, max_tokens)
    ({"target_entropy": 2.0, "eta": 0.3, "t_min": 0.3, "t_max": 2.5}, 1.2, 1, 24),
    ({"target_entropy": 2.5, "eta": 0.2, "t_min": 0.4, "t_max": 2.0, "h_min": 0.1,
      "mode": "follow"}, 0.9, 2, 24),
]
PREEMPT_TOKENS = 160
FP32_TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32


def build(hf_dir: str, plugin: bool, kv_tokens: int, max_model_len: int):
    from vllm import LLM

    kw = {}
    if plugin:
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
        raise SystemExit(f"unknown scenario {scenario!r}: baseline, plugin or preempt")
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
