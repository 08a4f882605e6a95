"""Packaged prompt sets for benchmarks: small, deterministic subsets of public data.

Provenance and the script that regenerates each file: data/README.md in the repository.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

SHAREGPT_FILE = "sharegpt_first_turns.jsonl"
XSUM_FILE = "xsum_articles.jsonl"
ACLSUM_FILE = "aclsum_papers.jsonl"
STRATEGYQA_FILE = "strategyqa.jsonl"
LONGDOCS_FILE = "longdocs.jsonl"


def _packaged(name: str) -> Path:
    # Package data sits beside this module, so this works for editable and normal installs.
    return Path(str(resources.files(__package__).joinpath("data", name)))


def load_sharegpt_prompts(n: int | None = None, path: str | Path | None = None) -> list[dict]:
    """First-turn ShareGPT prompts, in file order: dicts with ``id``, ``prompt``, ``reference``.

    ``reference`` is the ChatGPT reply from the same conversation. ``n`` takes the first n
    records (all 500 when None); asking for more than the file holds is an error rather than
    a silently shorter list. ``path`` reads another file of the same format instead of the
    packaged one.
    """
    return _read_jsonl(Path(path) if path is not None else _packaged(SHAREGPT_FILE), n)


def load_xsum(n: int | None = None) -> list[dict]:
    """BIG-bench gem/xsum news articles: dicts with ``id``, ``article``, ``reference`` (the
    one-sentence reference summary), in file order."""
    return _read_jsonl(_packaged(XSUM_FILE), n)


def load_aclsum(n: int | None = None) -> list[dict]:
    """ACLSum test papers (abstract, introduction, conclusion; cut at ~6,000 characters):
    dicts with ``id``, ``title``, ``document``, ``reference`` (challenge, approach and
    outcome summaries joined), in file order."""
    return _read_jsonl(_packaged(ACLSUM_FILE), n)


def load_strategyqa(n: int | None = None) -> list[dict]:
    """BIG-bench strategyqa yes/no questions: dicts with ``id``, ``question``, ``answer``
    ("yes" or "no"), in file order."""
    return _read_jsonl(_packaged(STRATEGYQA_FILE), n)


def load_longdocs(kind: str | None = None) -> list[dict]:
    """Long documents for the pruning benchmark (~34,000 characters, 7.5k-13.5k tokens):
    4 ACLSum paper bodies (``reference`` = the abstract) and 4 Shakespeare acts
    (``reference`` None). Dicts with ``id``, ``kind`` ("paper" or "play"), ``title``,
    ``text``, ``reference``; `kind` selects one of the two."""
    if kind not in (None, "paper", "play"):
        raise ValueError(f"kind must be None, 'paper' or 'play', got {kind!r}")
    rows = _read_jsonl(_packaged(LONGDOCS_FILE), None)
    return [r for r in rows if kind is None or r["kind"] == kind]


def _read_jsonl(src: Path, n: int | None) -> list[dict]:
    """The first n records of a JSONL file (all when None); fewer than n is an error."""
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rows: list[dict] = []
    with open(src, encoding="utf-8") as f:
        for line in f:
            if n is not None and len(rows) == n:
                break
            if line.strip():
                rows.append(json.loads(line))
    if n is not None and len(rows) < n:
        raise ValueError(f"{src} holds {len(rows)} records, {n} requested")
    return rows


def user_prompt_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn of the model's chat template; a model without one (a base
    model, Gemma 3 270M) continues the raw text instead."""
    if not tokenizer.chat_template:
        return tokenizer.encode(text + "\n\n")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def chat_prompt_ids(tokenizer, n: int, max_tokens: int = 512) -> list[list[int]]:
    """The first n ShareGPT first turns, chat-templated to token ids (raw text for a model
    without a template), of at most max_tokens."""
    out: list[list[int]] = []
    for rec in load_sharegpt_prompts():
        ids = user_prompt_ids(tokenizer, rec["prompt"])
        if len(ids) <= max_tokens:
            out.append(ids)
        if len(out) == n:
            break
    return out
