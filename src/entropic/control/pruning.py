"""Entropic attention pruning over paged KV blocks (design section 4, meso scale).

Each KV block b of a sequence carries an entropic contribution I_b. At a decode step only
blocks with I_b >= theta_t are attended, theta_t rising as the sequence's entropy H_t falls:
dense when the model is uncertain, sparse when it is certain. Always attended: the first
`sink_blocks` blocks, the `recent_blocks` most recent, and at least `min_blocks`.

I_b (the `score` option; "bound", the default, is query-aware and measured best in
docs/pruning.md):
- "mass": the share of attention the block receives, summed over layers and heads (H2O's
  heavy hitters, per block), measured at dense steps: the first decode after the prompt
  and every `refresh_interval`-th decode attend every block and report their shares (an
  explicit softmax, ~2x the fused kernel's time at that step), kept as an exponential
  moving average. Pruned steps use the fused kernel and measure nothing.
- "surprisal": the mean surprisal -log p of the block's tokens (prompt tokens are scored by
  teacher forcing, which costs one lm_head row per prompt token).
- "hybrid": (1 - w) * mass / mean(mass) + w * surprisal / mean(surprisal).
- "bound": query-aware, per layer and KV head, inside attention: the pruner sets only the
  budget, and the decode attention kernel ranks the blocks of each layer by an upper bound
  on their keys' scores against that layer's query, sum_i max(q_i min_i, q_i max_i) over
  the elementwise minimum and maximum of the block's keys (kept per full block in the KV
  cache). No dense steps, no stored I_b: the score is the current query's.
docs/pruning.md compares them.

No regret: pruning is worth its bookkeeping only where attention is a real share of a
decode's cost. The engine's cost model says how large (`CostModel.attention_share`: a
row's KV bytes against its share of the weights the step streams); below
`min_attention_share` the decode is dense.

theta_t as a budget: the sequence keeps the ceil(rho(H_t) * live) highest-I_b blocks,
  rho(H) = rho_min + (1 - rho_min) * clip((H - h_low) / (h_high - h_low), 0, 1),
so theta_t (the lowest I_b kept) rises as H_t falls. H_t is the entropy of the step that
produced the token being decoded, floored at h_floor (design section 3).

Block-sparse prefill (`prefill_delta`, on by default with pruning): a prompt has no sampled
distribution to take an entropy from, so its chunks follow the attention's own
concentration instead. Each tile of 16 prompt positions attends, per layer and KV head,
the blocks of 64 keys whose key bound (as "bound" above) comes within `prefill_delta`
logits of the tile's rows' best bound, plus the sink and the most recent blocks
(`entropic.model.attention.PrefillSparsity`): where a few blocks dominate the scores, the
rest are skipped; where scores are flat, everything is kept. A no-regret gate priced for
prefill (arithmetic, not bytes: `CostModel.prefill_attention_share` against
`min_prefill_attention_share`) keeps the chunks of the first ~2k positions dense, where
skipping did not pay for its quality cost (docs/pruning.md measures quality and speed).

Eviction (`evict=True`): when KV blocks run out, the lowest-I_b unprotected blocks of
running sequences (I_b relative to the sequence's mean, so that sequences compare) are
given back to the pool for good instead of preempting a sequence; a sequence keeps at
least max(min_blocks, ceil(rho_min * blocks)) live blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from entropic.engine.block_policy import BlockBudget, BlockSelection
from entropic.engine.cost import CostModel
from entropic.engine.request import Request
from entropic.model.attention import SPARSE_PREFILL_KEYS, PrefillSparsity

SCORES = ("mass", "surprisal", "hybrid", "bound")


@dataclass(frozen=True)
class PruningConfig:
    """Knobs of the block pruner; `LLM(pruning=PruningConfig())` turns it on."""

    score: str = "bound"
    hybrid_weight: float = 0.5
    min_keep_fraction: float = 0.25  # rho_min: the sparsest budget, at low entropy
    # False: keep min_keep_fraction at every step whatever the entropy (an entropy-blind
    # budget; docs/pruning.md measures it against the entropy law)
    adaptive: bool = True
    h_low: float = 0.5  # nats: at or below, the sparsest budget
    h_high: float = 3.0  # nats: at or above, dense
    h_floor: float = 0.0
    sink_blocks: int = 1
    recent_blocks: int = 2
    min_blocks: int = 4
    refresh_interval: int = 16  # mass scores: every this many decodes, one dense step
    mass_decay: float = 0.5  # weight of the old value in the moving average
    evict: bool = False
    # no-regret gate: prune a decode only where its attention is at least this share of
    # its cost by the engine's cost model (0: always)
    min_attention_share: float = 0.2
    # block-sparse prefill: skip a prompt tile's blocks of 64 keys whose key bound is more
    # than this many logits below the tile's best (None: dense prefills), in chunks whose
    # attention is at least min_prefill_attention_share of their FLOPs
    prefill_delta: float | None = 4.0
    min_prefill_attention_share: float = 0.4

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"pruning.score must be one of {SCORES}, got {self.score!r}")
        if not 0.0 <= self.hybrid_weight <= 1.0:
            raise ValueError(f"pruning.hybrid_weight must be in [0, 1], got {self.hybrid_weight}")
        if not 0.0 < self.min_keep_fraction <= 1.0:
            raise ValueError(f"pruning.min_keep_fraction must be in (0, 1], "
                             f"got {self.min_keep_fraction}")
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"pruning.adaptive must be a bool, got {self.adaptive!r}")
        if not 0.0 <= self.h_low < self.h_high:
            raise ValueError(f"pruning: need 0 <= h_low < h_high, got h_low={self.h_low}, "
                             f"h_high={self.h_high}")
        if self.h_floor < 0:
            raise ValueError(f"pruning.h_floor must be >= 0, got {self.h_floor}")
        for name in ("sink_blocks", "recent_blocks", "min_blocks", "refresh_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"pruning.{name} must be an integer, got {v!r}")
        if self.sink_blocks < 0:
            raise ValueError(f"pruning.sink_blocks must be >= 0, got {self.sink_blocks}")
        if self.recent_blocks < 1:
            raise ValueError("pruning.recent_blocks must be >= 1 (the block being written "
                             f"is always attended), got {self.recent_blocks}")
        if self.min_blocks < 1:
            raise ValueError(f"pruning.min_blocks must be >= 1, got {self.min_blocks}")
        if self.refresh_interval < 1:
            raise ValueError(f"pruning.refresh_interval must be >= 1, got {self.refresh_interval}")
        if not 0.0 <= self.min_attention_share <= 1.0:
            raise ValueError(f"pruning.min_attention_share must be in [0, 1], "
                             f"got {self.min_attention_share}")
        if self.evict and self.score == "bound":
            raise ValueError("pruning.evict needs a stored I_b per block (score 'mass', "
                             "'surprisal' or 'hybrid'); score 'bound' ranks blocks by the "
                             "current query only")
        if not 0.0 <= self.min_prefill_attention_share <= 1.0:
            raise ValueError(f"pruning.min_prefill_attention_share must be in [0, 1], "
                             f"got {self.min_prefill_attention_share}")
        if self.prefill_delta is not None and (
                isinstance(self.prefill_delta, bool)
                or not isinstance(self.prefill_delta, (int, float))
                or not 0.0 <= self.prefill_delta < math.inf):
            raise ValueError(f"pruning.prefill_delta must be None or a finite number >= 0, "
                             f"got {self.prefill_delta!r}")
        if not 0.0 <= self.mass_decay < 1.0:
            raise ValueError(f"pruning.mass_decay must be in [0, 1), got {self.mass_decay}")

    def keep_fraction(self, entropy: float) -> float:
        """rho(H): the share of live blocks kept at entropy H."""
        if not self.adaptive:
            return self.min_keep_fraction
        h = max(entropy, self.h_floor)
        x = min(1.0, max(0.0, (h - self.h_low) / (self.h_high - self.h_low)))
        return self.min_keep_fraction + (1.0 - self.min_keep_fraction) * x


@dataclass
class _Sequence:
    """What the pruner knows about one sequence's blocks."""

    mass: list[float | None] = field(default_factory=list)
    surprisal_sum: list[float] = field(default_factory=list)
    surprisal_count: list[int] = field(default_factory=list)
    decodes_since_dense: int = 0

    def grow(self, num_blocks: int) -> None:
        while len(self.mass) < num_blocks:
            self.mass.append(None)
            self.surprisal_sum.append(0.0)
            self.surprisal_count.append(0)


class EntropicBlockPruner:
    """The KV-block policy of the meso scale (plugs into the engine's `block_policy`)."""

    def __init__(self, config: PruningConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.uses_mass = config.score in ("mass", "hybrid")
        self.wants_prompt_surprisal = config.score in ("surprisal", "hybrid")
        self.wants_key_bounds = config.score == "bound"
        self._seqs: dict[str, _Sequence] = {}
        self._cost: CostModel | None = None

    def bind(self, cost: CostModel) -> None:
        self._cost = cost

    def pays(self, num_live: int, decode_rows: int) -> bool:
        """The no-regret gate: whether attention over `num_live` blocks is at least
        `min_attention_share` of a decode's cost in a step of `decode_rows` rows."""
        if self._cost is None or self.config.min_attention_share <= 0:
            return True
        share = self._cost.attention_share(num_live * self.block_size, decode_rows)
        return share >= self.config.min_attention_share

    def prefill_sparsity(self, req: Request, start: int, num_tokens: int
                         ) -> PrefillSparsity | None:
        """Block-sparse prefill for a chunk of `num_tokens` prompt tokens after `start`:
        None (dense) with `prefill_delta` None or where the chunk's attention is below
        `min_prefill_attention_share` of its FLOPs. The sink and recent spans are the decode's,
        in the prefill kernel's blocks of 64 keys (the recent ones end with the tile's own)."""
        cfg = self.config
        if cfg.prefill_delta is None:
            return None
        if (self._cost is not None and cfg.min_prefill_attention_share > 0
                and self._cost.prefill_attention_share(start, num_tokens)
                < cfg.min_prefill_attention_share):
            return None
        keys = SPARSE_PREFILL_KEYS
        sink = -(-cfg.sink_blocks * self.block_size // keys)
        recent = 1 + -(-cfg.recent_blocks * self.block_size // keys)
        return PrefillSparsity(float(cfg.prefill_delta), sink, recent)

    # ---- scores -------------------------------------------------------------------------
    def scores(self, request_id: str, indices: Sequence[int]) -> list[float] | None:
        """I_b of blocks `indices`, or None if one of them has not been measured yet."""
        s = self._seqs.get(request_id)
        if s is None or (indices and max(indices) >= len(s.mass)):
            return None
        if not indices:
            return []
        cfg = self.config
        mass = surpr = None
        if self.uses_mass:
            mass = [s.mass[i] for i in indices]
            if any(m is None for m in mass):
                return None
        if self.wants_prompt_surprisal:
            surpr = [s.surprisal_sum[i] / s.surprisal_count[i] if s.surprisal_count[i] else 0.0
                     for i in indices]
        if cfg.score == "mass":
            return mass
        if cfg.score == "surprisal":
            return surpr
        mm = sum(mass) / len(mass) or 1.0
        ms = sum(surpr) / len(surpr) or 1.0
        w = cfg.hybrid_weight
        return [(1 - w) * m / mm + w * u / ms for m, u in zip(mass, surpr)]

    def protected(self, live: Sequence[int], num_blocks: int) -> set[int]:
        """Sink and recent blocks (those of them still live)."""
        cfg = self.config
        keep = set(range(min(cfg.sink_blocks, num_blocks)))
        keep.update(range(max(0, num_blocks - cfg.recent_blocks), num_blocks))
        return keep.intersection(live)

    def budget(self, entropy: float, num_live: int) -> int:
        """Blocks to attend: max(min_blocks, ceil(rho(H) * live))."""
        return max(self.config.min_blocks,
                   math.ceil(self.config.keep_fraction(entropy) * num_live - 1e-9))

    def bound_budget(self, entropy: float | None, num_live: int,
                     decode_rows: int = 1) -> BlockBudget | None:
        """Query-aware selection's decision for one decode: the budget of blocks to attend
        among `num_live`, or None (dense) with no entropy yet, where the no-regret gate is
        closed, or where the budget covers every live block. (entropic_vllm's attention
        backend asks this too.)"""
        if entropy is None or not self.pays(num_live, decode_rows):
            return None
        budget = self.budget(entropy, num_live)
        if budget >= num_live:
            return None
        return BlockBudget(budget, self.config.sink_blocks, self.config.recent_blocks)

    # ---- the hook -----------------------------------------------------------------------
    def select(self, req: Request, live: list[int], num_blocks: int,
               decode_rows: int = 1) -> BlockSelection:
        cfg = self.config
        if cfg.score == "bound":
            h = req.entropies[-1] if req.entropies else None
            return BlockSelection(None, budget=self.bound_budget(h, len(live), decode_rows))
        s = self._seqs.setdefault(req.request_id, _Sequence())
        s.grow(num_blocks)
        if not self.pays(len(live), decode_rows):
            return BlockSelection(None)
        dense = BlockSelection(None, collect_attention=self.uses_mass)
        if not req.entropies or (self.uses_mass
                                 and s.decodes_since_dense >= cfg.refresh_interval - 1):
            s.decodes_since_dense = 0
            return dense
        s.decodes_since_dense += 1
        budget = self.budget(req.entropies[-1], len(live))
        if budget >= len(live):
            return BlockSelection(None)
        keep = self.protected(live, num_blocks)
        rest = [i for i in live if i not in keep]
        scores = self.scores(req.request_id, rest)
        if scores is None:  # something unmeasured: attend everything, which measures it
            s.decodes_since_dense = 0
            return dense
        ranked = sorted(range(len(rest)), key=lambda j: -scores[j])[:max(0, budget - len(keep))]
        return BlockSelection(sorted(keep.union(rest[j] for j in ranked)))

    def observe(self, req: Request, positions: Sequence[int], surprisal: Sequence[float],
                attended: Sequence[int] | None, block_mass: Sequence[float] | None) -> None:
        s = self._seqs.setdefault(req.request_id, _Sequence())
        bs = self.block_size
        if positions:
            s.grow(max(positions) // bs + 1)
        for p, u in zip(positions, surprisal):
            s.surprisal_sum[p // bs] += u
            s.surprisal_count[p // bs] += 1
        if not attended or block_mass is None:
            return
        s.grow(max(attended) + 1)
        d = self.config.mass_decay
        for i, m in zip(attended, block_mass):
            s.mass[i] = m if s.mass[i] is None else d * s.mass[i] + (1 - d) * m

    def evict(self, candidates: Sequence[tuple[Request, list[int]]],
              need: int) -> list[tuple[str, int]]:
        """The `need` lowest-I_b unprotected blocks among running sequences, I_b relative
        to each sequence's mean; each keeps max(min_blocks, ceil(rho_min * blocks)) live."""
        cfg = self.config
        if not cfg.evict or need <= 0:
            return []
        offers: list[tuple[float, str, int]] = []
        for req, live in candidates:
            if req.num_computed_tokens <= req.num_prompt_tokens or not live:
                continue
            num = -(-req.num_computed_tokens // self.block_size)
            floor = max(cfg.min_blocks, math.ceil(cfg.min_keep_fraction * num))
            spare = len(live) - floor
            keep = self.protected(live, num)
            rest = [i for i in live if i not in keep and i < num]
            scores = self.scores(req.request_id, rest)
            if spare <= 0 or not rest or scores is None:
                continue
            mean = sum(scores) / len(scores) or 1.0
            ranked = sorted(zip(scores, rest))[:spare]
            offers += [(sc / mean, req.request_id, i) for sc, i in ranked]
        offers.sort()
        return [(rid, i) for _, rid, i in offers[:need]]

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._seqs.pop(rid, None)
