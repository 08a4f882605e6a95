"""Sampler-chain probes for benchmarks: they observe, they change nothing."""
from __future__ import annotations

import torch

from entropic.control.estimators import ExactEntropy


class TemperedEntropyProbe:
    """Records, per request, the entropy H^T of softmax(logits / T) at the temperature each
    row is about to be sampled at (greedy rows: T = 1). Placed after the thermostat in the
    sampler chain, it sees the temperature the thermostat chose. Costs one exact entropy
    over the vocabulary per row per step."""

    def __init__(self) -> None:
        self.h: dict[str, list[float]] = {}
        self._exact = ExactEntropy()

    def apply(self, logits, temperatures, batch):
        t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
        for rid, h in zip(batch.request_ids, self._exact(logits / t[:, None]).tolist()):
            self.h.setdefault(rid, []).append(h)
        return logits, temperatures

    def accept(self, token_ids, batch):
        pass

    def release(self, request_ids):
        pass

    def pop(self, request_id: str, n: int) -> list[float]:
        """The readings of a request (one per generated token, at most n), forgetting it.

        A request recomputed after preemption is not probed twice for a token: the
        recompute samples only the next token, at the end of its prompt plus outputs."""
        return self.h.pop(request_id, [])[:n]
