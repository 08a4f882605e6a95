"""Benchmark metrics: text overlap (ROUGE, BLEU), yes/no answers, paired bootstrap.

Everything here is a plain function of per-request values, so the ablation can recompute
any metric on bootstrap resamples of the requests (`paired_bootstrap`) and report each
difference against the baseline with a confidence interval.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

import numpy as np

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


def rouge_f(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-pair ROUGE-1/2/L F-measure (rouge-score, Porter stemming), each an array."""
    from rouge_score import rouge_scorer

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    rows = [scorer.score(r, h) for h, r in zip(hyps, refs)]  # score(target, prediction)
    return {k: np.array([s[k].fmeasure for s in rows], dtype=float) for k in ROUGE_KEYS}


def _bleu():
    from sacrebleu.metrics import BLEU

    return BLEU()


def bleu_stats(hyps: Sequence[str], refs: Sequence[str]) -> np.ndarray:
    """Per-pair sufficient statistics of corpus BLEU (sacrebleu's own segment statistics:
    hypothesis length, reference length, matched and total n-grams for n = 1..4), one row
    per pair. Summing rows over any subset and calling `bleu_from_stats` gives exactly
    sacrebleu's corpus BLEU of that subset: this is how sacrebleu's own paired bootstrap
    resamples, and it is what makes BLEU cheap to bootstrap."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not hyps:
        return np.zeros((0, 10))
    return np.array(_bleu()._extract_corpus_statistics(list(hyps), [list(refs)]), dtype=float)


def bleu_from_stats(stats: np.ndarray) -> float:
    """Corpus BLEU (0..100, sacrebleu defaults) from summed statistics (one row or many)."""
    s = np.asarray(stats, dtype=float)
    if s.ndim == 2:
        s = s.sum(axis=0)
    return float(_bleu()._compute_score_from_stats([int(round(x)) for x in s]).score)


def corpus_bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """sacrebleu corpus BLEU with one reference per hypothesis."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hyps), [list(refs)]).score)


_YESNO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_yes_no(text: str) -> str | None:
    """The first standalone 'yes' or 'no' in a reply (lower case), or None."""
    m = _YESNO.search(text)
    return m.group(1).lower() if m else None


# ---- summaries of samples ---------------------------------------------------------------
def percentile(xs: Sequence[float] | np.ndarray, q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for an empty sample."""
    a = np.asarray(xs, dtype=float)
    return float(np.percentile(a, q)) if a.size else float("nan")


def bootstrap_ci(xs: Sequence[float], stat: Callable[[np.ndarray], float] = np.mean,
                 n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
                 ) -> tuple[float, float, float]:
    """(point, low, high): `stat` of the sample and its percentile bootstrap interval."""
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        raise ValueError("bootstrap of an empty sample")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_boot, a.size))
    boots = np.array([stat(a[i]) for i in idx])
    lo, hi = np.percentile(boots, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(stat(a)), float(lo), float(hi)


def paired_bootstrap(data: Mapping[str, Mapping[str, np.ndarray]],
                     metrics: Mapping[str, Callable[[Mapping[str, np.ndarray]], float]],
                     n_items: int, n_boot: int = 1000, seed: int = 0
                     ) -> dict[str, dict[str, np.ndarray]]:
    """Every metric on `n_boot` resamples of the items, the same resample for every config.

    `data[config][field]` is an array over the same n_items (item i of config a is item i
    of config b: same prompt, arrival and seed), so differences between configurations are
    paired and their spread across resamples is the noise of the comparison.
    Returns {config: {metric: array of n_boot values}}.
    """
    rng = np.random.default_rng(seed)
    out = {c: {m: np.empty(n_boot) for m in metrics} for c in data}
    for b in range(n_boot):
        idx = rng.integers(0, n_items, size=n_items)
        for c, fields in data.items():
            sub = {k: v[idx] for k, v in fields.items()}
            for m, fn in metrics.items():
                out[c][m][b] = fn(sub)
    return out


def interval(samples: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """Percentile interval of bootstrap samples, NaNs ignored."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if not s.size:
        return float("nan"), float("nan")
    lo, hi = np.percentile(s, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(lo), float(hi)


def relative_change(value, base):
    """(value - base) / base, elementwise; NaN where base is 0."""
    value, base = np.asarray(value, dtype=float), np.asarray(base, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(base != 0, (value - base) / base, np.nan)


def superadditivity(gain_full, single_gains: Sequence) -> np.ndarray:
    """Full system's gain minus the sum of the single layers' gains (> 0: super-additive).

    Gains are relative changes against the baseline, signed so that positive is better
    (see `Metric.higher_is_better`); works elementwise on bootstrap samples.
    """
    total = np.zeros_like(np.asarray(gain_full, dtype=float))
    for g in single_gains:
        total = total + np.asarray(g, dtype=float)
    return np.asarray(gain_full, dtype=float) - total
