"""Entropy estimators behind one batched interface (design section 3).

All take logits [S, V] and return entropies [S] in nats, of the temperature-1 distribution.
- exact: H = -sum_x p(x) log p(x) over the whole vocabulary;
- top-k: the same sum over the k most likely tokens only (a lower bound on H);
- top-k with tail correction: adds the tail mass r = 1 - sum_topk p spread evenly over the
  other |V| - k tokens, -r log(r / (|V| - k)); the uniform spread maximises the tail's
  entropy, so this bounds the tail's contribution from above.
Control laws use the floored value H_hat = max(H_est, H_min) (`floor_entropy`), which
protects them from over-confident, badly calibrated distributions.
"""
from __future__ import annotations

from typing import Protocol

import torch


class EntropyEstimator(Protocol):
    name: str

    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...


class ExactEntropy:
    """O(|V|): log-softmax, then -sum p log p with 0 log 0 = 0."""

    name = "exact"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return torch.special.entr(logp.exp()).sum(-1)


class TopKEntropy:
    """-sum over the k largest probabilities of p log p (true, not renormalised, p)."""

    def __init__(self, k: int) -> None:
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        self.k = k
        self.name = f"top{k}"

    def _top(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        k = min(self.k, x.shape[-1])
        top = x.topk(k, dim=-1).values
        return top - torch.logsumexp(x, dim=-1, keepdim=True)  # log p of the top k

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.special.entr(self._top(logits).exp()).sum(-1)


class TopKTailEntropy(TopKEntropy):
    """Top-k plus the tail mass spread uniformly over the remaining |V| - k tokens."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.name = f"top{k}+tail"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logp = self._top(logits)
        p = logp.exp()
        head = torch.special.entr(p).sum(-1)
        rest = logits.shape[-1] - logp.shape[-1]
        if rest == 0:
            return head
        r = (1.0 - p.sum(-1)).clamp_min(0.0)
        # -r log(r / rest) = entr(r) + r log(rest); entr handles r = 0
        return head + torch.special.entr(r) + r * torch.log(torch.tensor(float(rest)))


def make_estimator(name: str) -> EntropyEstimator:
    """'exact', 'topK' or 'topK+tail' (e.g. 'top32+tail')."""
    if name == "exact":
        return ExactEntropy()
    if name.startswith("top"):
        body, tail = (name[3:-5], True) if name.endswith("+tail") else (name[3:], False)
        if body.isdigit():
            return TopKTailEntropy(int(body)) if tail else TopKEntropy(int(body))
    raise ValueError(f"entropy estimator: unknown {name!r}; use exact, topK or topK+tail")


def floor_entropy(h: torch.Tensor, h_min: float | torch.Tensor) -> torch.Tensor:
    """H_hat = max(H_est, H_min)."""
    return torch.maximum(h, torch.as_tensor(h_min, dtype=h.dtype, device=h.device))
