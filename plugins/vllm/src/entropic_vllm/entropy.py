"""A logits processor that measures every row's entropy for entropic's scheduler.

    LLM(MODEL, logits_processors=[EntropyLogitsProcessor], scheduler_cls=EntropicScheduler,
        scheduling_policy="priority")

For each row whose request carries a board tag (`EntropicScheduler` adds it to every
request's `extra_args`), it computes H = -sum p log p of softmax(logits) and appends
(tag, output index, H) to the board (`entropic_vllm.board`). It returns the logits
untouched.

It declares itself *not* argmax-invariant, so vLLM runs it in every step, greedy ones
included (vLLM skips argmax-invariant processors when the whole batch is greedy), on the
fp32 logits before penalties and temperature (`Sampler.apply_logits_processors`, after the
allowed-token mask, bad words and vLLM's built-in min-tokens and logit-bias processors):
the model's temperature-1 entropy, the quantity entropic's engine gives its clock.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from entropic.sampling.sampler import entropy_from_logits
from entropic_vllm.board import BOARD_KEY, TAG_KEY, EntropyBoard
from entropic_vllm.rows import apply_moves, drop_removed

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig


class EntropyLogitsProcessor(LogitsProcessor):
    """Writes each tagged row's entropy to the entropy board (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        """The board keys are the scheduler's to set (in the engine core, after this check):
        a client that sent them could make the worker write to a board of its choosing."""
        given = [k for k in (BOARD_KEY, TAG_KEY) if k in (sampling_params.extra_args or {})]
        if given:
            raise ValueError(f"{', '.join(given)}: reserved for EntropicScheduler")

    def __init__(self, vllm_config: "VllmConfig", device: torch.device,
                 is_pin_memory: bool) -> None:
        self._rows: dict[int, tuple[int, list[int]]] = {}  # index -> (tag, output list)
        self._board: EntropyBoard | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # run in greedy batches too (it never changes the logits)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        drop_removed(self._rows, batch_update)
        for i, params, _prompt, outputs in batch_update.added:
            xargs = params.extra_args or {}
            if TAG_KEY not in xargs:
                self._rows.pop(i, None)
                continue
            path = xargs[BOARD_KEY]
            if self._board is None or self._board.path != path:
                self._board = EntropyBoard.open(path)
            self._rows[i] = (int(xargs[TAG_KEY]), outputs)
        apply_moves(self._rows, batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows or self._board is None:
            return logits
        rows = sorted(self._rows)
        idx = torch.tensor(rows, device=logits.device)
        h = entropy_from_logits(logits[idx]).tolist()
        tags = [self._rows[i][0] for i in rows]
        outputs = [len(self._rows[i][1]) for i in rows]  # the output index this step samples
        self._board.write(tags, outputs, h)
        return logits
