"""Runs vLLM with entropic's scheduler (in vLLM's venv) for tests_vllm/test_scheduler_vllm.py.

    VENV/bin/python tests_vllm/sched_runs.py HF_DIR OUT.json

One engine, vLLM's default layout on CPU (engine core and worker in two processes, so the
entropies cross the board between processes), two running slots (max_num_seqs=2) so that
admission binds, small aging parameters (W = 8 steps, R = 4 steps) so that aging engages
within a short run. Two phases:
- greedy: vllm_runs.PROMPTS, 24 greedy tokens each, through LLM.generate (compared with
  the baseline scenario, vLLM's default scheduler);
- trace: a replayed trace: requests added to the engine at fixed engine iterations (one
  long prompt at the start, then a stream of short ones, then two counting requests
  displaced by two late short ones), sampled at temperature 1.
The scheduler's own log (every step: the ranking, what was scheduled, displaced, the
entropies it read) comes back with the outputs.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from vllm_runs import FP32_TOKEN_BYTES, GREEDY_TOKENS, PROMPTS

MAX_WAIT, MIN_RESIDENCY, SLOTS = 8, 4, 2
LONG = ("Summarise the following notes in one line. " * 14).strip()
SHORTS = ["Hi", "Count: 1, 2,", "Red, green,", "The cat", "Once upon a", "2 + 2 =",
          "Hello world", "A B C", "Yes or no?", "Paris is"]
# (engine iteration at which it arrives, request id, prompt, max_tokens)
# ... and at the end, after the stream has drained, two greedy requests that count (entropy
# near 0, so the lowest pi), then two short ones arriving while both count: they displace
# them (pauses, the counts resume where they stopped)
TRACE = ([(0, "t00-short", "The weather today", 10), (0, "t01-long", LONG, 12),
          (0, "t02-short", "My favourite colour", 10)]
         + [(3 + 4 * i, f"t{i + 3:02d}-short", p, 8) for i, p in enumerate(SHORTS)]
         + [(64, "t13-count", "A, B, C, D, E, F, G, H, I, J, K,", 24),
            (64, "t14-count", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", 24),
            (72, "t15-short", "Tell me a story about", 8), (72, "t16-short", "My name is", 8)])


def main() -> None:
    hf_dir, out_path = sys.argv[1:3]
    from vllm import LLM, SamplingParams

    from entropic_vllm.entropy import EntropyLogitsProcessor
    from entropic_vllm.scheduler import EntropicScheduler

    log_path = os.path.join(tempfile.mkdtemp(), "sched.jsonl")
    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, seed=0, max_num_seqs=SLOTS,
              max_model_len=1024, enable_prefix_caching=False,
              kv_cache_memory_bytes=4096 * FP32_TOKEN_BYTES,
              scheduler_cls=EntropicScheduler, scheduling_policy="priority",
              logits_processors=[EntropyLogitsProcessor],
              additional_config={"entropic_scheduler": {
                  "max_wait": MAX_WAIT, "min_residency": MIN_RESIDENCY, "log": log_path}})
    greedy = [SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
              for _ in PROMPTS]
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    result: dict = {
        "greedy": [{"request_id": o.request_id, "prompt_token_ids": list(o.prompt_token_ids),
                    "token_ids": list(o.outputs[0].token_ids)} for o in outs],
        "max_wait": MAX_WAIT, "min_residency": MIN_RESIDENCY, "slots": SLOTS,
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config
        .max_num_batched_tokens}
    with open(log_path) as f:
        result["greedy_steps"] = sum(1 for _ in f)

    engine = llm.llm_engine
    pending = sorted(TRACE)
    done: dict[str, dict] = {}
    it = 0
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests():
            it = max(it, pending[0][0])  # idle: the next arrival now (step() waits for work)
        while pending and pending[0][0] <= it:
            _, rid, prompt, n = pending.pop(0)
            temperature = 0.0 if "count" in rid else 1.0
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=temperature,
                                                           seed=int(rid[1:3]),
                                                           ignore_eos=True))
        for o in engine.step():
            if o.finished:
                done[o.request_id] = {"prompt_token_ids": list(o.prompt_token_ids),
                                      "token_ids": list(o.outputs[0].token_ids)}
        it += 1
    result["trace"] = [{"request_id": rid, "arrival_iteration": a, "max_tokens": n,
                        **done[rid]} for a, rid, _, n in TRACE]
    with open(log_path) as f:
        result["log"] = [json.loads(line) for line in f]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
