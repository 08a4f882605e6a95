"""Driving the engine step by step in tests: the logits behind every sampled token."""
from __future__ import annotations

import torch


def run_capturing_steps(llm, prompts, params, prefix: str = "cap") -> dict[str, list[tuple]]:
    """Run `prompts` (request ids prefix0, prefix1, ...) to the end; each request's
    (fp32 logits row, temperature sampled at) for every token it sampled, in order."""
    eng = llm.engine
    eng.runner.keep_logits = True
    steps: dict[str, list[tuple]] = {}
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"{prefix}{i}", p, params)
        while eng.has_unfinished_requests():
            sched = eng.scheduler.schedule()
            res = eng.runner.execute(sched)
            for row, (rid, tok) in enumerate(res.sampled.items()):
                steps.setdefault(rid, []).append((res.logits[row].clone(), tok.temperature))
            eng.scheduler.update(sched, res.sampled, 0.0)
    finally:
        eng.runner.keep_logits = False
    return steps


def run_capturing_logits(llm, prompts, params, prefix: str = "cap") -> dict[str, list[torch.Tensor]]:
    """Each request's fp32 logits row for every token it sampled (run_capturing_steps)."""
    return {rid: [lg for lg, _ in st]
            for rid, st in run_capturing_steps(llm, prompts, params, prefix).items()}
