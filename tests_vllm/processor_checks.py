"""Checks of the thermostat processor's batch bookkeeping, with no model: run in the vLLM
venv (tests_vllm/test_processor_unit.py does), exits non-zero on the first failure.

A reference run feeds each request's logits alone; the checked runs feed the same logits
through batches that vLLM could produce: rows moved and swapped, a request removed and
added back (preemption), a step whose token is thrown away (a prefill chunk), a row with no
thermostat beside them. Every request must see the same temperatures as alone.
"""
from __future__ import annotations

import gc
import sys

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from entropic_vllm import ThermostatLogitsProcessor

V = 64
TH = {"target_entropy": 2.0, "eta": 0.5, "t_min": 0.2, "t_max": 3.0}


def make(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.7 + 0.2 * i, extra_args={"thermostat": dict(TH)})


def stream(i: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return [torch.randn(V, generator=g) * (1 + i) for _ in range(steps)]


def temps_of(row_out: torch.Tensor, raw: torch.Tensor, t_req: float) -> float:
    """The temperature a processed row was divided by (row = raw / t_req * t_req / T)."""
    return float((raw[0] / row_out[0]).item())


def alone(i: int, steps: int) -> list[float]:
    p = ThermostatLogitsProcessor(None, torch.device("cpu"), False)
    params, outs = make(i), []
    p.update_state(BatchUpdate(1, [], [(0, params, [1], outs)], []))
    got = []
    for x in stream(i, steps):
        t_req = params.temperature
        row = p.apply((x / t_req)[None].clone())[0]
        got.append(float((x[0] / row[0]).item()))
        outs.append(0)
        p.update_state(None)
    return got


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"FAILED: {what}")
        sys.exit(1)


def main() -> None:
    steps = 8
    want = {i: alone(i, steps) for i in range(3)}
    check(len({round(t, 4) for t in want[0]}) > 3, "the law moved T in the reference")

    p = ThermostatLogitsProcessor(None, torch.device("cpu"), False)
    params = {i: make(i) for i in range(3)}
    plain = SamplingParams(temperature=1.0)
    outs = {i: [] for i in range(3)}
    xs = {i: stream(i, steps) for i in range(3)}
    got = {i: [] for i in range(3)}
    # batch: index -> request (3 = the plain request)
    where = {0: 0, 1: 1, 2: 2, 3: 3}
    p.update_state(BatchUpdate(4, [], [(0, params[0], [1], outs[0]), (1, params[1], [1], outs[1]),
                                       (2, params[2], [1], outs[2]), (3, plain, [1], [])], []))
    step = {i: 0 for i in range(3)}
    for k in range(12):
        if k == 2:  # swap rows 0 and 2, move row 1 to index 3 (the plain one moves to 1)
            p.update_state(BatchUpdate(4, [], [], [(0, 2, MoveDirectionality.SWAP)]))
            where = {0: 2, 1: 1, 2: 0, 3: 3}
            p.update_state(BatchUpdate(4, [], [], [(1, 3, MoveDirectionality.SWAP)]))
            where = {0: 2, 1: 3, 2: 0, 3: 1}
        if k == 4:  # request 2 (at index 0) preempted: removed; the rest condensed
            p.update_state(BatchUpdate(3, [0], [], [(3, 0, MoveDirectionality.UNIDIRECTIONAL)]))
            where = {0: 1, 1: 3, 2: 0}  # index -> request after the move
        if k == 6:  # request 2 comes back with the same SamplingParams object
            p.update_state(BatchUpdate(4, [], [(3, params[2], [1], outs[2])], []))
            where = {0: 1, 1: 3, 2: 0, 3: 2}
        rows = torch.zeros(len(where), V)
        raw_rows = {}
        for idx, r in where.items():
            if r == 3:
                rows[idx] = torch.linspace(-1, 1, V)
                continue
            if step[r] >= steps:
                continue
            x = xs[r][step[r]]
            raw_rows[idx] = (r, x)
            rows[idx] = x / params[r].temperature
        before_plain = {idx: rows[idx].clone() for idx, r in where.items() if r == 3}
        out = p.apply(rows.clone())
        for idx, row in before_plain.items():
            check(torch.equal(out[idx], row), "a row without a thermostat was changed")
        discard = (k == 1)  # this step's token is thrown away (a prefill chunk)
        for idx, (r, x) in raw_rows.items():
            t = float((x[0] / out[idx][0]).item())
            if discard and r == 0:
                check(abs(t - want[0][step[0]]) < 1e-5, "the discarded step used the wrong T")
                continue
            got[r].append(t)
            outs[r].append(0)
            step[r] += 1
    for r in range(3):
        check(len(got[r]) == steps, f"request {r} ran {len(got[r])} steps, not {steps}")
        check(all(abs(a - b) < 1e-5 for a, b in zip(got[r], want[r])),
              f"request {r}: temperatures {got[r]} differ from alone {want[r]}")

    # a new SamplingParams object starts from T_0; state is dropped with the object
    fresh = make(0)
    p.update_state(BatchUpdate(1, [0, 1, 2, 3], [(0, fresh, [1], [])], []))
    x = xs[0][0]
    out = p.apply((x / fresh.temperature)[None].clone())
    check(abs(float((x[0] / out[0][0]).item()) - want[0][0]) < 1e-5, "a new request kept old state")
    n_states = len(p._states)
    del params, fresh
    gc.collect()
    check(len(p._states) < n_states, "state outlived its SamplingParams")

    # validation
    for bad, msg in [({"thermostat": {"eta": 0}}, "thermostat.eta"),
                     ({"thermostat": [1]}, "must be a dict"),
                     ({"thermostat": {}, "thermostat_eta": 1.0}, "not both"),
                     ({"thermostat_mode": 3}, "thermostat.mode must be a string"),
                     ({"thermostat_mode": "follow", "entropic_trace": ""}, "entropic_trace")]:
        try:
            ThermostatLogitsProcessor.validate_params(SamplingParams(temperature=1.0,
                                                                     extra_args=bad))
        except ValueError as e:
            check(msg in str(e), f"{bad}: message {e!r} lacks {msg!r}")
        else:
            check(False, f"{bad} was accepted")
    ThermostatLogitsProcessor.validate_params(SamplingParams(temperature=1.0))
    print("ok")


if __name__ == "__main__":
    main()
