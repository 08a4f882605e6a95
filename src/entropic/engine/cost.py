"""Cost accounting from what actually ran: FLOPs (linear and attention), KV bytes, seconds.

Per step and per request, from the step's chunks:
- linear FLOPs: 2 * (parameters of the layers' projections) per computed token, plus
  2 * vocab * hidden for each row whose logits were computed (the lm_head runs only there:
  the sampled row, and prompt rows scored for prompt logprobs);
- attention FLOPs: 4 * layers * heads * head_dim per (query token, attended KV position)
  pair (QK^T and AV); the attended count comes from the runner, so pruning shows;
- KV bytes read: 2 (K and V) * layers * kv_heads * head_dim * element size per KV position
  read by the chunk (its whole attended context is read once per chunk);
- seconds: the step's wall time, apportioned to its rows in proportion to their FLOPs.
"""
from __future__ import annotations

from dataclasses import dataclass

from entropic.config import ModelConfig
from entropic.outputs import Cost  # what a request reports; computed here


@dataclass(frozen=True)
class ChunkWork:
    """What one request's chunk computed in a step."""

    request_id: str
    num_tokens: int
    sampled: bool
    attended_pairs: int  # sum over the chunk's query tokens of KV positions attended
    kv_positions_read: int  # distinct KV positions read by the chunk
    scored_rows: int = 0  # prompt rows whose logits were computed (teacher-forced scores)


def dense_work(request_id: str, start: int, num_tokens: int, sampled: bool,
               scored_rows: int = 0) -> ChunkWork:
    """Dense causal attention: token at position p attends p + 1 positions."""
    pairs = num_tokens * start + num_tokens * (num_tokens + 1) // 2
    return ChunkWork(request_id, num_tokens, sampled, pairs, start + num_tokens, scored_rows)


class CostModel:
    """Turns a step's chunk geometry into per-request costs for one model."""

    def __init__(self, config: ModelConfig, kv_element_bytes: int,
                 weight_element_bytes: float | None = None) -> None:
        c = config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size \
            + 3 * c.hidden_size * c.intermediate_size
        self.linear_per_token = 2.0 * c.num_layers * per_layer
        self.lm_head_per_row = 2.0 * c.vocab_size * c.hidden_size
        self.attention_per_pair = 4.0 * c.num_layers * c.num_heads * c.head_dim
        self.kv_bytes_per_position = 2.0 * c.num_layers * kv * kv_element_bytes
        # bytes of weights one step streams (projections and lm_head), shared by its rows
        wb = kv_element_bytes if weight_element_bytes is None else weight_element_bytes
        self.weight_bytes = (self.linear_per_token + self.lm_head_per_row) / 2.0 * wb

    def attention_share(self, context: int, rows: int) -> float:
        """Decode on a CPU is bound by memory traffic: the share of one row's bytes that its
        attention reads, a context of `context` positions against its 1 / rows share of the
        weights the step streams."""
        kv = self.kv_bytes_per_position * context
        return kv / (kv + self.weight_bytes / max(rows, 1))

    def prefill_attention_share(self, start: int, num_tokens: int) -> float:
        """Prefill is bound by arithmetic: the share of a chunk's FLOPs (`num_tokens` new
        tokens after `start` cached ones, dense) that its attention computes."""
        w = dense_work("", start, num_tokens, False)
        attn = self.attention_per_pair * w.attended_pairs
        total = attn + self.linear_per_token * num_tokens
        return attn / total if total else 0.0

    def chunk_cost(self, w: ChunkWork) -> Cost:
        return Cost(
            flops_linear=self.linear_per_token * w.num_tokens
            + self.lm_head_per_row * (int(w.sampled) + w.scored_rows),
            flops_attention=self.attention_per_pair * w.attended_pairs,
            kv_bytes_read=self.kv_bytes_per_position * w.kv_positions_read,
        )

    def step_costs(self, work: list[ChunkWork], seconds: float) -> dict[str, Cost]:
        costs = {w.request_id: self.chunk_cost(w) for w in work}
        total = sum(c.flops for c in costs.values()) or 1.0
        for c in costs.values():
            c.seconds = seconds * c.flops / total
        return costs
