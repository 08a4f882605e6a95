"""Weight-format parity: how far a model's next-token distributions move from a reference.

`sequence_logits` runs a model's forward once over a whole token sequence (one causal
prefill into a private KV cache) and returns the fp32 logits at every position; comparing
them across weight formats (fp32, bf16, int8, int4) on the same sequences measures what a
format costs: top-1 agreement, KL divergence, entropy shift, and max logit difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from entropic.model.attention import AttentionMetadata, PrefillChunk
from entropic.model.llama import LlamaModel


@torch.inference_mode()
def sequence_logits(model: LlamaModel, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """fp32 logits [len(ids), vocab]: position i is the distribution of token i + 1."""
    n = len(ids)
    if n == 0:
        raise ValueError("sequence_logits needs at least one token")
    kv = model.make_kv_cache(math.ceil(n / block_size), block_size)
    dev = model.device
    slots = torch.arange(n, device=dev)
    meta = AttentionMetadata(slot_mapping=slots, num_decode=0, decode_groups=[],
                             prefills=[PrefillChunk(0, n, 0, slots)])
    positions = torch.arange(n, device=dev)
    return model.forward(torch.tensor(ids, device=dev), positions, meta, kv, positions)


@dataclass
class Divergence:
    """Per-position agreement of a candidate's distributions with a reference's."""

    positions: int = 0
    top1_agree: int = 0
    kl_sum: float = 0.0  # KL(reference || candidate), nats
    abs_entropy_diff_sum: float = 0.0  # |H_candidate - H_reference|, nats
    max_logit_diff: float = 0.0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
        ref_lp = torch.log_softmax(ref_logits.float(), -1)
        lp = torch.log_softmax(logits.float(), -1)
        ref_p = ref_lp.exp()
        self.positions += ref_lp.shape[0]
        self.top1_agree += int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
        self.kl_sum += float((ref_p * (ref_lp - lp)).sum())
        h_ref = -(ref_p * ref_lp).sum(-1)
        h = -(lp.exp() * lp).sum(-1)
        self.abs_entropy_diff_sum += float((h - h_ref).abs().sum())
        self.max_logit_diff = max(self.max_logit_diff,
                                  float((logits.float() - ref_logits.float()).abs().max()))

    def summary(self) -> dict:
        n = max(self.positions, 1)
        return {"positions": self.positions, "top1_agreement": self.top1_agree / n,
                "mean_kl": self.kl_sum / n, "mean_abs_entropy_diff": self.abs_entropy_diff_sum / n,
                "max_logit_diff": self.max_logit_diff}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
