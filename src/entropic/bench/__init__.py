"""Benchmark workloads and helpers (packaged prompt sets; see datasets.py)."""
from entropic.bench.datasets import load_sharegpt_prompts

__all__ = ["load_sharegpt_prompts"]
