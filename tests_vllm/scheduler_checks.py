"""Checks of the entropy board, the entropy processor and the scheduler's startup checks, with
no model: run in the vLLM venv (tests_vllm/test_scheduler_unit.py does), exits non-zero on
the first failure, prints "ok" at the end.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from entropic.sampling.sampler import entropy_from_logits
from entropic_vllm import board as board_mod
from entropic_vllm.board import BOARD_KEY, TAG_KEY, EntropyBoard, RecordsLost
from entropic_vllm.entropy import EntropyLogitsProcessor
from entropic_vllm.scheduler import check_layout, scheduling_config

V = 64


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"FAILED: {what}")
        sys.exit(1)


def board_round_trip() -> None:
    b = EntropyBoard.create()
    w = EntropyBoard.open(b.path)
    check(b.read() == [], "a new board is empty")
    w.write([3, 7], [0, 5], [1.5, 0.25])
    w.write([3], [1], [2.0])
    check(b.read() == [(3, 0, 1.5), (7, 5, 0.25), (3, 1, 2.0)], "records in write order")
    check(b.read() == [], "a record is read once")
    cap = board_mod.CAPACITY
    n = cap - 2  # wraps around the ring's end
    w.write(list(range(n)), [1] * n, [0.5] * n)
    got = b.read()
    check([t for t, _, _ in got] == list(range(n)), "a write across the ring's end")
    w.write(list(range(cap + 1)), [0] * (cap + 1), [0.0] * (cap + 1))
    try:
        b.read()
        check(False, "a reader more than CAPACITY behind must raise")
    except RecordsLost:
        pass
    b.unlink()
    check(not os.path.exists(b.path), "unlink removes the name")
    w.write([1], [2], [3.0])  # the mapping outlives the name
    try:
        EntropyBoard.open(b.path)
        check(False, "opening a board that does not exist must raise")
    except RuntimeError as e:
        check("does not share a host" in str(e), f"the error says why: {e}")
    for other in ("/etc/passwd", os.path.join(os.path.dirname(b.path), "other-file")):
        try:
            EntropyBoard.open(other)
            check(False, f"{other} is not a board and must not be opened")
        except ValueError as e:
            check("is not an entropy board" in str(e), str(e))


def processor_bookkeeping() -> None:
    b = EntropyBoard.create()
    p = EntropyLogitsProcessor(None, torch.device("cpu"), False)
    check(not p.is_argmax_invariant(), "runs in greedy batches too")
    EntropyLogitsProcessor.validate_params(SamplingParams(extra_args={"thermostat": {}}))
    try:  # a client may not name a board: only the scheduler, after validation, does
        EntropyLogitsProcessor.validate_params(
            SamplingParams(extra_args={BOARD_KEY: b.path, TAG_KEY: 1}))
        check(False, "client-supplied board keys must be refused")
    except ValueError as e:
        check("reserved for EntropicScheduler" in str(e), str(e))
    tagged = [SamplingParams(temperature=0.0, extra_args={BOARD_KEY: b.path, TAG_KEY: t})
              for t in (10, 11, 12)]
    plain = SamplingParams(temperature=1.0)
    outs = [[], [1, 2], [], []]
    p.update_state(BatchUpdate(4, [], [(0, tagged[0], [1], outs[0]),
                                       (1, tagged[1], [1], outs[1]),
                                       (2, plain, [1], outs[2]),
                                       (3, tagged[2], [1], outs[3])], []))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, V, generator=g) * torch.tensor([[0.5], [1.0], [2.0], [4.0]])
    y = p.apply(x.clone())
    check(torch.equal(y, x), "the logits are returned untouched")
    h = entropy_from_logits(x).tolist()
    got = b.read()
    want = [(10, 0, h[0]), (11, 2, h[1]), (12, 0, h[3])]
    check([(t, n) for t, n, _ in got] == [(t, n) for t, n, _ in want], f"rows {got}")
    check(all(abs(a[2] - w[2]) < 1e-6 for a, w in zip(got, want)), "entropies of the rows")
    # row 3 moves to 0 (0 removed), rows 1 and 2 swap; one token appended to 11's output
    outs[1].append(5)
    p.update_state(BatchUpdate(3, [0], [], [(3, 0, MoveDirectionality.UNIDIRECTIONAL),
                                            (1, 2, MoveDirectionality.SWAP)]))
    x2 = torch.randn(3, V, generator=g)
    p.apply(x2.clone())
    h2 = entropy_from_logits(x2).tolist()
    got = b.read()
    check([(t, n) for t, n, _ in got] == [(12, 0), (11, 3)], f"after the moves: {got}")
    check(abs(got[0][2] - h2[0]) < 1e-6 and abs(got[1][2] - h2[2]) < 1e-6,
          "moved rows read their new positions")
    b.unlink()


def startup_checks() -> None:
    def cfg(**over):
        base = dict(policy="priority", async_scheduling=False,
                    procs=["entropic_vllm:EntropyLogitsProcessor"], tp=1, pp=1, nnodes=1,
                    backend="mp", spec=None)
        base.update(over)
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(policy=base["policy"],
                                             async_scheduling=base["async_scheduling"]),
            parallel_config=SimpleNamespace(tensor_parallel_size=base["tp"],
                                            pipeline_parallel_size=base["pp"],
                                            nnodes=base["nnodes"],
                                            distributed_executor_backend=base["backend"]),
            model_config=SimpleNamespace(logits_processors=base["procs"]),
            speculative_config=base["spec"])
    check_layout(cfg())
    check_layout(cfg(procs=[EntropyLogitsProcessor], backend="uni"))
    check_layout(cfg(procs=["entropic_vllm.entropy.EntropyLogitsProcessor"]))
    for over, words in [({"policy": "fcfs"}, "--scheduling-policy priority"),
                        ({"procs": []}, "EntropyLogitsProcessor"),
                        ({"procs": ["no.such:Thing"]}, "EntropyLogitsProcessor"),
                        ({"tp": 2}, "parallel size 1"),
                        ({"backend": "ray"}, "on the scheduler's machine"),
                        ({"nnodes": 2}, "on the scheduler's machine"),
                        ({"async_scheduling": True}, "--no-async-scheduling"),
                        ({"spec": object()}, "speculative")]:
        try:
            check_layout(cfg(**over))
            check(False, f"{over} must be refused")
        except ValueError as e:
            check(words in str(e), f"{over}: {e}")
    law, path = scheduling_config({"entropic_scheduler": {"max_wait": 4, "max_bypass": 2,
                                                          "max_wait_total": 64, "log": "/x"}})
    check(law.max_wait == 4 and law.max_bypass == 2 and law.max_wait_total == 64
          and path == "/x", "options from additional_config")
    for bad, words in [({"max_wait": 0}, "max_wait must be >= 1"),
                       ({"max_bypass": 0}, "max_bypass must be >= 1"),
                       ({"max_wait": 8, "max_wait_total": 4}, "max_wait_total must be >="),
                       ({"wait": 3}, "known fields")]:
        try:
            scheduling_config({"entropic_scheduler": bad})
            check(False, f"{bad} must be refused")
        except ValueError as e:
            check(words in str(e), f"{bad}: {e}")


def main() -> None:
    board_round_trip()
    processor_bookkeeping()
    startup_checks()
    print("ok")


if __name__ == "__main__":
    main()
