"""What the thermostat processor costs inside vLLM, measured in alternation in one engine.

    VENV/bin/python benchmarks/vllm_plugin_overhead.py HF_DIR [--rows 8] [--tokens 64] [--rounds 5]

One `vllm.LLM` with the plugin loaded (fp32, eager, one core: set VLLM_CPU_OMP_THREADS_BIND=0).
Each round runs the same batch twice, in alternating order: `rows` requests sampled at
temperature 1 with seeds, once plain and once with the thermostat (and a trace key). Both do
the same number of steps (ignore_eos). Reported: median wall time of each, and the median
of the per-round differences per decode step (rounds alternate so that the machine's drift
cancels). Prints JSON, with the machine (`entropic.bench.machine.describe`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams

    from entropic_vllm import ThermostatLogitsProcessor
    from entropic_vllm.traces import EXTENSION, fetch_traces

    llm = LLM(model=a.hf_dir, dtype="float32", enforce_eager=True, seed=0, max_num_seqs=a.rows,
              max_model_len=1024, enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20,
              logits_processors=[ThermostatLogitsProcessor], worker_extension_cls=EXTENSION)
    prompts = [f"Write a short story about the number {i}:" for i in range(a.rows)]

    def run(thermo: bool, r: int) -> float:
        keys = [f"r{r}-{i}" for i in range(a.rows)]
        ps = [SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=i, ignore_eos=True,
                             extra_args=({"thermostat": {}, "entropic_trace": keys[i]}
                                         if thermo else None)) for i in range(a.rows)]
        t0 = time.perf_counter()
        llm.generate(prompts, ps, use_tqdm=False)
        wall = time.perf_counter() - t0
        if thermo:
            assert len(fetch_traces(llm, keys)) == a.rows
        return wall

    run(False, -1)
    run(True, -2)  # warm-up of both paths
    plain, thermo, diffs = [], [], []
    for r in range(a.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {t: run(t, r) for t in order}
        plain.append(got[False])
        thermo.append(got[True])
        diffs.append((got[True] - got[False]) / a.tokens)
    from entropic.bench.machine import describe

    print(json.dumps({"machine": describe(), "rows": a.rows, "tokens": a.tokens, "rounds": a.rounds,
                      "plain_s_median": statistics.median(plain),
                      "thermostat_s_median": statistics.median(thermo),
                      "overhead_ms_per_step_median": 1e3 * statistics.median(diffs),
                      "overhead_ms_per_step_all": [round(1e3 * d, 2) for d in diffs],
                      "plain_tok_s_median": a.rows * a.tokens / statistics.median(plain),
                      "thermostat_tok_s_median": a.rows * a.tokens / statistics.median(thermo)}))


if __name__ == "__main__":
    main()
