"""entropic's KV-block pruning on vLLM's CPU build: the per-request side (docs/vllm.md).

    LLM(MODEL, logits_processors=[PruningLogitsProcessor], ...)
    vllm serve MODEL --logits-processors entropic_vllm.pruning:PruningLogitsProcessor

A request opts in with `extra_args={"pruning": {...}}` (offline; `{}`: every default) or,
on the server, flat `vllm_xargs` keys `pruning_<field>`. The fields are those of
`entropic.control.pruning.PruningConfig` that query-aware selection uses (`FIELDS`),
validated by entropic's own dataclass; `score` may only be "bound" and `evict` is not
offered (vLLM frees KV blocks only per request).

Two objects in the worker process share the work:
- `PruningLogitsProcessor` (this module) keeps each opted-in request's config and the
  entropy H_t of the step that produced its latest token (the model's temperature-1
  entropy, computed before penalties and temperature), and installs the attention backend
  when vLLM builds it;
- `entropic_vllm.pruned_attention.PruningAttentionBackend`, vLLM's CPU attention with
  entropic's selection in front: at each decode of an opted-in request it asks entropic's
  `EntropicBlockPruner.bound_budget` for a budget and, in every layer, keeps the sink, the
  recent and the highest-bound blocks of the row's block table.
vLLM builds both and hands neither a reference to the other, so they meet in `SHARED`, one
object per worker process: the processor's rows (batch index -> request state), which
match the attention metadata's rows (both are the persistent batch's order: vLLM applies
the batch's moves to the processors in `InputBatch.refresh_metadata`, after `condense` and
the decode-first reorder, before it builds the step's attention metadata).
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from entropic.control.pruning import EntropicBlockPruner, PruningConfig
from entropic.engine.cost import CostModel
from entropic.sampling.sampler import entropy_from_logits
from entropic_vllm.rows import update_rows

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

KEY = "pruning"
PREFIX = "pruning_"
# PruningConfig's fields that query-aware selection reads ("mass", "surprisal", "hybrid" and
# eviction need per-block state across steps that this route does not keep)
FIELDS = ("score", "min_keep_fraction", "adaptive", "h_low", "h_high", "h_floor",
          "sink_blocks", "recent_blocks", "min_blocks", "min_attention_share")
INTS = ("sink_blocks", "recent_blocks", "min_blocks")
BACKEND = "entropic_vllm.pruned_attention.PruningAttentionBackend"


def parse_pruning(extra_args: Mapping[str, Any] | None) -> PruningConfig | None:
    """The request's pruning config, or None when it asks for none. Raises ValueError,
    naming the argument, for anything entropic's own config would refuse."""
    if not extra_args:
        return None
    nested = extra_args.get(KEY)
    flat = {k[len(PREFIX):]: v for k, v in extra_args.items() if k.startswith(PREFIX)}
    if nested is None and not flat:
        return None
    if nested is not None and flat:
        raise ValueError(f"pruning: give either extra_args['{KEY}'] (a dict) or "
                         f"'{PREFIX}<field>' keys, not both")
    given = nested if nested is not None else flat
    where = f"extra_args['{KEY}']" if nested is not None else f"'{PREFIX}<field>' keys"
    if not isinstance(given, Mapping):
        raise ValueError(f"pruning: extra_args['{KEY}'] must be a dict of "
                         f"{', '.join(FIELDS)}; got {type(given).__name__}")
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ValueError(f"pruning: unknown or unsupported field(s) {unknown} in {where}; "
                         f"known on vLLM: {', '.join(FIELDS)}")
    kw: dict[str, Any] = {}
    for name, value in given.items():
        if name == "score":
            if value != "bound":
                raise ValueError(f"pruning.score: only 'bound' on vLLM (query-aware, from "
                                 f"the KV cache itself), got {value!r}")
        elif name == "adaptive":  # 0 / 1 too: vllm_xargs may hand a JSON boolean as an int
            if not isinstance(value, int) or value not in (0, 1):
                raise ValueError(f"pruning.adaptive must be true or false, got {value!r}")
            value = bool(value)
        elif name in INTS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"pruning.{name} must be an integer, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"pruning.{name} must be a number, got {value!r}")
        else:
            value = float(value)
        kw[name] = value
    try:
        return PruningConfig(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None


@dataclass
class PruningStats:
    """Counters of the worker's pruned attention, summed since the last reset.

    `decodes`: decode rows of opted-in requests; `pruned_decodes`: those that got a budget
    below their live blocks; per layer of those rows: `layer_rows`, `blocks_live` (blocks
    of their contexts) and `blocks_attended`."""

    decodes: int = 0
    pruned_decodes: int = 0
    layer_rows: int = 0
    blocks_live: int = 0
    blocks_attended: int = 0


class RequestPruning:
    """One opted-in request: its config and the entropy of its latest kept token."""

    def __init__(self, config: PruningConfig) -> None:
        self.config = config
        self.outputs: list[int] = []
        self.entropy: float | None = None
        self.pending: tuple[int, float] | None = None  # (output index sampled, its H)
        self._pruner: EntropicBlockPruner | None = None

    def entropy_now(self) -> float | None:
        """H_t of the token being decoded: the entropy of the step that sampled it, once
        the token is in the output list (a thrown-away step's H never counts)."""
        if self.pending is not None and len(self.outputs) > self.pending[0]:
            self.entropy = self.pending[1]
            self.pending = None
        return self.entropy

    def pruner(self, block_size: int, cost: CostModel | None) -> EntropicBlockPruner:
        if self._pruner is None:
            self._pruner = EntropicBlockPruner(self.config, block_size)
            if cost is not None:
                self._pruner.bind(cost)
        return self._pruner


@dataclass
class SharedRows:
    """What the processor and the attention backend of one worker process share."""

    rows: dict[int, RequestPruning] = field(default_factory=dict)  # batch index -> state
    backend_built: bool = False
    stats: PruningStats = field(default_factory=PruningStats)

    def pop_stats(self, reset: bool = True) -> dict[str, int]:
        out = asdict(self.stats)
        if reset:
            self.stats = PruningStats()
        return out


SHARED = SharedRows()


def install() -> None:
    """Make vLLM's CPU platform choose the pruning backend: `CpuPlatform.get_attn_backend_cls`
    returns `AttentionBackendEnum.CPU_ATTN.get_path()`, which honours this override. Must
    run in the worker before the model's layers are built (the processor's constructor:
    `GPUModelRunner.__init__` builds the logits processors, `load_model` the layers)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)


class PruningLogitsProcessor(LogitsProcessor):
    """Per-request pruning state and entropies for the pruning attention backend."""

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        parse_pruning(sampling_params.extra_args)

    def __init__(self, vllm_config: "VllmConfig", device: torch.device,
                 is_pin_memory: bool) -> None:
        install()
        self._rows = SHARED.rows
        self._rows.clear()
        self._states: dict[int, RequestPruning] = {}  # id(SamplingParams) -> state

    def is_argmax_invariant(self) -> bool:
        return False  # run in greedy batches too (it never changes the logits)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        update_rows(self._rows, batch_update, self._state_of)

    def _state_of(self, params: "SamplingParams") -> RequestPruning | None:
        key = id(params)
        st = self._states.get(key)
        if st is not None:
            return st  # a request back in the batch (moved out, preempted): its own state
        cfg = parse_pruning(params.extra_args)
        if cfg is None:
            return None
        st = self._states[key] = RequestPruning(cfg)
        weakref.finalize(params, self._states.pop, key, None)
        return st

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        if not SHARED.backend_built:
            raise RuntimeError("entropic pruning: requests opted in, but vLLM's attention is "
                               "not entropic_vllm's pruning backend (it needs vLLM's CPU "
                               "build, whose CPU_ATTN backend the processor overrides)")
        rows = sorted(self._rows)
        idx = torch.tensor(rows, device=logits.device)
        h = entropy_from_logits(logits[idx]).tolist()
        for i, hi in zip(rows, h):
            st = self._rows[i]
            st.pending = (len(st.outputs), hi)
        return logits
