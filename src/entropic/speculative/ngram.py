"""Prompt-lookup drafting: continue the sequence the way it continued before.

Per request, an index maps every n-gram (n in [min, max]) of its tokens to the position
right after its latest occurrence. A draft for a sequence ending in tokens s is the run of
tokens that followed the longest suffix of s seen earlier. The index grows by one entry per
n for each new token, so a lookup costs O(max - min) dictionary probes whatever the length.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Index:
    indexed: int = 0  # tokens [0, indexed) have had the n-grams ending at them registered
    after: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramProposer:
    """Drafts from the request's own prompt and output."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._index: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k drafted tokens after `tokens`, and the length of the suffix match that
        produced them (0: no match, no draft)."""
        ix = self._index.setdefault(request_id, _Index())
        self._extend(ix, tokens)
        end = len(tokens)
        for n in range(min(self.lookup_max, end - 1), self.lookup_min - 1, -1):
            start = ix.after.get(tuple(tokens[end - n:]))
            if start is not None:
                return tokens[start:start + k], n
        return [], 0

    def _extend(self, ix: _Index, tokens: list[int]) -> None:
        """Register the n-grams that end before the last token (each maps to the position
        after it); the suffix itself is what a lookup asks for, so it is not registered yet."""
        if len(tokens) < ix.indexed:  # the sequence was rolled back: rebuild
            ix.indexed, ix.after = 0, {}
        for end in range(max(ix.indexed, 1), len(tokens)):
            # n-grams tokens[end - n:end], followed by tokens[end]
            for n in range(self.lookup_min, min(self.lookup_max, end) + 1):
                ix.after[tuple(tokens[end - n:end])] = end
        ix.indexed = max(ix.indexed, len(tokens))

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
