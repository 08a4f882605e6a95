"""Speculative decoding: drafts verified by the target model in one multi-row pass.

`SpeculativeConfig` chooses the drafter (`method="ngram"`: prompt lookup over the request's
own tokens; `method="draft_model"`: a smaller model with the same tokenizer) and the entropy
gate (`entropic.speculative.gate`) that decides, per request and step, whether to draft and
how far. The engine side (verify rows, acceptance, KV rollback) lives in the scheduler and
the model runner; see docs/speculative.md.
"""
from entropic.speculative.config import SpeculativeConfig
from entropic.speculative.speculator import Speculator, SpeculationStats

__all__ = ["SpeculativeConfig", "Speculator", "SpeculationStats"]
