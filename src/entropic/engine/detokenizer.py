"""Incremental detokenization and stop-string matching for one request."""
from __future__ import annotations

from typing import Sequence

_CONTEXT = 5  # prompt tokens kept ahead of the output, so the first token's leading space survives


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas without re-decoding everything.

    The window [prefix_offset, read_offset) is text already emitted; new text is what the
    window plus new tokens decode to beyond it, held back while it ends in an incomplete
    UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool,
                 stop: Sequence[str], include_stop: bool) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = list(stop)
        self.include_stop = include_stop
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def add(self, new_ids: Sequence[int]) -> tuple[str, str | None]:
        """Add tokens; return (text delta, the stop string hit or None)."""
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        old_len = len(self.text)
        self.text += delta
        hit = self._find_stop(len(delta))
        if hit is None:
            return delta, None
        stop_str, cut = hit
        self.text = self.text[:cut]
        return self.text[old_len:], stop_str

    def _find_stop(self, delta_len: int) -> tuple[str, int] | None:
        if not self.stop:
            return None
        # a stop string can straddle the previous text and the delta
        lo = max(0, len(self.text) - delta_len - self._max_stop + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, lo)
            if i >= 0 and (best is None or i < best[1]):
                best = (s, i)
        if best is None:
            return None
        s, i = best
        return s, i + len(s) if self.include_stop else i
