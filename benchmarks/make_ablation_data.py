"""Regenerate the ablation's packaged task data (src/entropic/bench/data/) from PyPI packages.

    pip download --no-deps bigbench==1.0.0 -d /tmp/bb        # sdist, ~360 MB; never installed
    pip download --no-deps aclsum==0.1.2 -d /tmp/acl         # wheel, ~5 MB; never installed
    python benchmarks/make_ablation_data.py --bigbench /tmp/bb/bigbench-1.0.0.tar.gz \
        --aclsum /tmp/acl/aclsum-0.1.2-py3-none-any.whl

Writes three small JSONL files (provenance and licences: data/README.md):
- xsum_articles.jsonl: BIG-bench `gem/xsum` news articles with their one-sentence reference
  summaries (the first N in file order whose article is MIN..MAX characters);
- strategyqa.jsonl: BIG-bench `strategyqa` yes/no questions with the correct answer (the
  first N in file order);
- aclsum_papers.jsonl: ACLSum test-split papers (abstract, introduction, conclusion, in that
  order, light detokenisation, cut at a sentence boundary at MAX characters) with the
  reference summary = the challenge, approach and outcome summaries joined.
Selection is deterministic; reruns are byte-identical.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import tarfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src/entropic/bench/data"
XSUM_MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/gem/xsum/task.json"
SQA_MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/strategyqa/task.json"
ACL_MEMBER = "aclsum/dataset/test.jsonl"
XSUM_N, XSUM_CHARS = 48, (300, 2000)  # ~75..500 tokens
SQA_N = 200
ACL_N, ACL_CHARS = 16, 6000  # ~1.5k tokens at ~4 characters per token
ACL_SECTIONS = ("abstract", "introduction", "conclusion")
ACL_ASPECTS = ("challenge", "approach", "outcome")


def detok(s: str) -> str:
    """Undo the PTB-style spacing of ACLSum sentences ('word , word ( x )')."""
    s = re.sub(r" ([,.;:!?%)\]])", r"\1", s)
    s = re.sub(r"([(\[]) ", r"\1", s)
    return s.replace(" 's", "'s").replace(" n't", "n't")


def xsum(task: dict) -> list[dict]:
    out = []
    for i, ex in enumerate(task["examples"]):
        art, ref = ex["input"].strip(), ex["target"].strip()
        if XSUM_CHARS[0] <= len(art) <= XSUM_CHARS[1] and ref:
            out.append({"id": f"xsum-{i}", "article": art, "reference": ref})
        if len(out) == XSUM_N:
            break
    return out


def strategyqa(task: dict) -> list[dict]:
    out = []
    for i, ex in enumerate(task["examples"][:SQA_N]):
        answer = max(ex["target_scores"], key=ex["target_scores"].get).lower()
        out.append({"id": f"sqa-{i}", "question": ex["input"].strip(), "answer": answer})
    return out


def aclsum(lines: list[str]) -> list[dict]:
    out = []
    for line in lines[:ACL_N]:
        rec = json.loads(line)
        doc = ""
        for sec in ACL_SECTIONS:
            for sent in rec["sentences"][sec]:
                sent = detok(sent.strip())
                if len(doc) + len(sent) + 1 > ACL_CHARS:
                    break
                doc = f"{doc} {sent}" if doc else sent
        ref = " ".join(rec["summary"][a].strip() for a in ACL_ASPECTS)
        out.append({"id": rec["id"], "title": rec.get("title", ""), "document": doc,
                    "reference": ref})
    return out


def write(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"{path.name}: {len(rows)} records, {path.stat().st_size} bytes, sha256 {digest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bigbench", required=True, type=Path, help="bigbench-1.0.0.tar.gz")
    ap.add_argument("--aclsum", required=True, type=Path, help="aclsum-0.1.2-py3-none-any.whl")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tarfile.open(args.bigbench) as tar:
        xs = json.load(tar.extractfile(XSUM_MEMBER))
        sq = json.load(tar.extractfile(SQA_MEMBER))
    with zipfile.ZipFile(args.aclsum) as z:
        acl_lines = z.read(ACL_MEMBER).decode("utf-8").splitlines()
    args.out.mkdir(parents=True, exist_ok=True)
    write(xsum(xs), args.out / "xsum_articles.jsonl")
    write(strategyqa(sq), args.out / "strategyqa.jsonl")
    write(aclsum(acl_lines), args.out / "aclsum_papers.jsonl")


if __name__ == "__main__":
    main()
