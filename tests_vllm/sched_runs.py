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

    VENV/bin/python tests_vllm/sched_runs.py pressure HF_DIR OUT.json

A second engine whose KV pool is short (PRESSURE_BLOCKS blocks of PRESSURE_BLOCK_SIZE
tokens; vLLM's CPU default is 128): the trace's
two counting requests are displaced by two newcomers whose outputs then need the blocks
the paused counts hold, so the scheduler must drop paused KV (a recompute) before vLLM
would preempt a running request.
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
# The long prompt comes two iterations after the first two short ones, when they hold both
# slots: a request reaches vLLM's engine core (another process) when the core reads it, and
# one added in the same iteration as others was seen a step late on an AMD EPYC, where the
# long prompt then took the slot the late short one would have had, and never needed aging.
TRACE = ([(0, "t00-short", "The weather today", 10), (2, "t01-long", LONG, 12),
          (0, "t02-short", "My favourite colour", 10)]
         + [(3 + 4 * i, f"t{i + 3:02d}-short", p, 8) for i, p in enumerate(SHORTS)]
         + [(64, "t13-count", "A, B, C, D, E, F, G, H, I, J, K,", 24),
            (64, "t14-count", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", 24),
            (72, "t15-short", "Tell me a story about", 8), (72, "t16-short", "My name is", 8)])
# the pressure run: the same two counts, then two newcomers that outgrow the pool
PRESSURE_BLOCKS, PRESSURE_BLOCK_SIZE = 6, 32
PRESSURE = [(0, "p00-count", TRACE[-4][2], 24), (0, "p01-count", TRACE[-3][2], 24),
            (8, "p02-story", TRACE[-2][2], 50), (8, "p03-story", TRACE[-1][2], 50)]


def make_llm(hf_dir: str, log_path: str, kv_tokens: int, max_model_len: int, **kw):
    from vllm import LLM

    from entropic_vllm.entropy import EntropyLogitsProcessor
    from entropic_vllm.scheduler import EntropicScheduler

    return LLM(model=hf_dir, dtype="float32", enforce_eager=True, seed=0, max_num_seqs=SLOTS,
               max_model_len=max_model_len, enable_prefix_caching=False,
               kv_cache_memory_bytes=kv_tokens * FP32_TOKEN_BYTES,
               scheduler_cls=EntropicScheduler, scheduling_policy="priority",
               logits_processors=[EntropyLogitsProcessor],
               additional_config={"entropic_scheduler": {
                   "max_wait": MAX_WAIT, "min_residency": MIN_RESIDENCY, "log": log_path}},
               **kw)


def replay(engine, trace: list[tuple[int, str, str, int]]) -> list[dict]:
    """Add each request at its engine iteration (counting requests greedy, the others
    sampled at temperature 1) and step until all are done."""
    from vllm import SamplingParams

    pending = sorted(trace)
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
    return [{"request_id": rid, "arrival_iteration": a, "max_tokens": n, **done[rid]}
            for a, rid, _, n in trace]


def main() -> None:
    args = sys.argv[1:]
    pressure = args[0] == "pressure"
    hf_dir, out_path = args[1:3] if pressure else args[:2]
    from vllm import SamplingParams

    log_path = os.path.join(tempfile.mkdtemp(), "sched.jsonl")
    if pressure:
        # vLLM's pool keeps one block back (its null block)
        llm = make_llm(hf_dir, log_path, (PRESSURE_BLOCKS + 1) * PRESSURE_BLOCK_SIZE,
                       PRESSURE_BLOCKS * PRESSURE_BLOCK_SIZE, block_size=PRESSURE_BLOCK_SIZE)
    else:
        llm = make_llm(hf_dir, log_path, 4096, 1024)
    engine = llm.llm_engine
    from entropic.control.scheduling import EntropicSchedulingConfig

    result: dict = {"max_wait": MAX_WAIT, "min_residency": MIN_RESIDENCY, "slots": SLOTS,
                    "max_wait_total": EntropicSchedulingConfig.max_wait_total,
                    "max_num_batched_tokens": engine.vllm_config.scheduler_config
                    .max_num_batched_tokens,
                    "num_blocks": engine.vllm_config.cache_config.num_gpu_blocks,
                    "greedy": [], "greedy_steps": 0}
    if not pressure:
        greedy = [SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
                  for _ in PROMPTS]
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        result["greedy"] = [{"request_id": o.request_id,
                             "prompt_token_ids": list(o.prompt_token_ids),
                             "token_ids": list(o.outputs[0].token_ids)} for o in outs]
        with open(log_path) as f:
            result["greedy_steps"] = sum(1 for _ in f)
    result["trace"] = replay(engine, PRESSURE if pressure else TRACE)
    with open(log_path) as f:
        result["log"] = [json.loads(line) for line in f]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
