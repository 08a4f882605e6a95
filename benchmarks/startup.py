"""Startup time: from a fresh interpreter to an `LLM` ready to generate, by phase.

    python benchmarks/startup.py [--repeats 5] [--quantization none int4] [--threads 2]
                                 [--against PATH_TO_OTHER_SRC] [--model PATH]

Each sample is a fresh child process (interpreter start excluded). Startup = importing torch,
transformers and entropic plus the first `LLM(...)`, what a user waits for. Then, in the same
process, the tokenizer and the weights are read once more, each alone (a breakdown, now with
the file in the page cache), and a second `LLM(...)` is built (what another engine in one
process costs, as in `entropic bench ablation`). With --against, the same children run
with another source tree first on PYTHONPATH (e.g. a copy of an earlier `src`), alternating
with this one sample by sample, so the two are compared under the same drift of the host.
The converted-tokenizer cache is what the user has (a first run ever also pays its
conversion once; `ENTROPIC_TOKENIZERS_DIR=none` measures without it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from entropic.bench.machine import add_common_args, describe, header, write_json

PHASES = ("import_torch", "import_transformers", "import_entropic", "llm", "tokenizer", "weights",
          "llm_again")

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads({threads})
t1 = time.perf_counter()
import transformers
t2 = time.perf_counter()
from entropic import LLM
from entropic.model.loader import resolve_model_path
from entropic.model.tokenizer import Tokenizer
from entropic.model.gguf_loader import read_gguf_tensors
t3 = time.perf_counter()
LLM(model={model!r}, quantization={quant!r})
t4 = time.perf_counter()
kind, path = resolve_model_path({model!r})
if kind == "gguf":
    Tokenizer.from_gguf(path)
t5 = time.perf_counter()
if kind == "gguf":
    read_gguf_tensors(path, keep_int4={quant!r} == "int4")
t6 = time.perf_counter()
LLM(model={model!r}, quantization={quant!r})
t7 = time.perf_counter()
print(json.dumps(dict(import_torch=t1 - t0, import_transformers=t2 - t1,
                      import_entropic=t3 - t2, llm=t4 - t3, tokenizer=t5 - t4,
                      weights=t6 - t5, llm_again=t7 - t6, startup=t4 - t0)))
"""


def sample(src: str | None, model: str | None, quant: str | None, threads: int) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    code = _CHILD.format(threads=threads, model=model, quant=quant)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"child failed ({src or 'this tree'}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quantization", nargs="+", choices=("none", "int4", "int8"),
                    default=["none", "int4"], help="none: LLM()'s floats")
    ap.add_argument("--against", default=None,
                    help="another source tree (a folder holding the entropic package)")
    add_common_args(ap, out="results/startup.json", quick=None)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    if a.against and not os.path.isdir(os.path.join(a.against, "entropic")):
        ap.error(f"--against {a.against}: no entropic package in that folder")
    info = describe(a.threads)
    print(header(info), flush=True)
    trees = {"this": None} | ({"against": a.against} if a.against else {})
    rows = []
    for quant in a.quantization:
        q = None if quant == "none" else quant
        samples: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(a.repeats):
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            for name, src in order:
                samples[name].append(sample(src, a.model, q, a.threads))
        for name, runs in samples.items():
            med = {k: statistics.median(s[k] for s in runs) for k in (*PHASES, "startup")}
            rows.append({"quantization": quant, "tree": name, "src": trees[name],
                         "median_s": med, "samples": runs})
            print(f"{quant:5s} {name:8s} startup {med['startup']:.2f} s | " + ", ".join(
                f"{k} {med[k]:.2f}" for k in PHASES), flush=True)
    write_json(a.out, {"machine": info, "args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
