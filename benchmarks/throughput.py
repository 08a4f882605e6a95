"""Throughput of the entropic engine against transformers `generate`, same model, same prompts.

    python benchmarks/throughput.py            # full run (slow on 2 CPU cores)
    python benchmarks/throughput.py --quick    # smoke run: 32 new tokens, batch 8, 512-token prefill

On a shared machine the figures are only as good as its idle cores: with more torch threads
than free cores every parallel op waits for a descheduled thread and runs many times slower.
The JSON records the load average before and after; compare runs at equal load.

Both engines load the same GGUF in the same dtype and get the same token ids: ShareGPT first
turns (entropic.bench.datasets) rendered once with the chat template. Decoding is greedy and
EOS is ignored (transformers: min_new_tokens = max_new_tokens), so both produce exactly the
requested number of tokens.

Figures (median over --repeats, then ours/transformers):
- decode tok/s, batch 1: (new_tokens - 1) / (last token time - first token time).
- output tok/s, N concurrent: N * new_tokens / wall time of the whole call. Ours: N requests
  submitted at once to `LLM.generate` (continuous batching). Transformers: one static,
  left-padded batch of N (so its prefill runs at the longest prompt's length).
- prefill tok/s: prompt tokens / time to first token, one ~--prefill-tokens prompt made by
  joining ShareGPT prompts, max_tokens=1.
- achieved bandwidth, batch-1 decode: bytes read per token * decode tok/s, where bytes =
  weight bytes (numel * element size of every parameter as stored: transformers' parameters,
  ours the GGUF's tensors at the run dtype; a tied embedding counted once since the lm_head
  reads it) + KV bytes read at the mean decode context
  (2 * layers * kv_heads * head_dim * element size * (prompt_len + new_tokens / 2)).
  Activations, norms' reads and the sampler are left out; it is a lower bound.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from entropic.bench.machine import add_common_args, describe, header, write_json

ROOT = Path(__file__).resolve().parents[1]

def gguf_shape(path: Path) -> dict:
    """Parameter count and KV geometry read from the GGUF header."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    f = {k: r.fields[k].contents() for k in r.fields if k.startswith(arch + ".")}
    heads = f[f"{arch}.attention.head_count"]
    head_dim = f.get(f"{arch}.attention.key_length", f[f"{arch}.embedding_length"] // heads)
    return {
        "numel": sum(int(np.prod(t.shape)) for t in r.tensors),
        "layers": f[f"{arch}.block_count"],
        "kv_heads": f.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
    }


def render(tok, text: str) -> list[int]:
    """Chat-template token ids for one user turn, from either engine's tokenizer."""
    msgs = [{"role": "user", "content": text}]
    try:  # transformers
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except TypeError:  # ours: apply_chat_template(messages) -> list[int]
        ids = tok.apply_chat_template(msgs)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class Ours:
    """The entropic engine through its public API."""

    name = "entropic"

    def __init__(self, args, dtype: torch.dtype, shape: dict):
        from entropic import LLM, SamplingParams

        self._params = SamplingParams
        self.llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_gib=args.kv_cache_gib,
                       enable_prefix_caching=False)  # repeats send the same prompts
        self.tokenizer = self.llm.get_tokenizer()
        # The engine keeps its weights as plain tensors in the run dtype: count the file's.
        self.weight_bytes = shape["numel"] * dtype.itemsize
        self.weight_source = f"GGUF numel x {dtype}"

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, list]:
        params = self._params(max_tokens=new, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        for o in outs:
            if len(o.token_ids) != new:
                raise RuntimeError(f"{self.name}: {len(o.token_ids)} tokens generated, {new} asked")
        return wall, outs

    def decode(self, prompt: list[int], new: int) -> float:
        wall, (o,) = self.run([prompt], new)
        tt = o.metrics.token_times if o.metrics else []
        if len(tt) >= 2 and tt[-1] > tt[0]:
            return (len(tt) - 1) / (tt[-1] - tt[0])
        return new / wall

    def batch(self, prompts: list[list[int]], new: int) -> float:
        wall, outs = self.run(prompts, new)
        return sum(len(o.token_ids) for o in outs) / wall

    def prefill(self, prompt: list[int]) -> float:
        wall, (o,) = self.run([prompt], 1)
        m = o.metrics
        ttft = (m.first_token_time - m.arrival_time) if m and m.first_token_time else wall
        return len(prompt) / ttft


class _TokenClock:
    """A stopping criterion that never stops and records when each token was appended."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HF:
    """transformers `generate` on the same GGUF: static left-padded batches, greedy."""

    name = "transformers"

    def __init__(self, args, dtype: torch.dtype):
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteriaList

        self._criteria = StoppingCriteriaList
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        folder, name = str(Path(args.model_path).parent), Path(args.model_path).name
        self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
        self.pad = self.tokenizer.pad_token_id
        if self.pad is None:
            self.pad = self.tokenizer.eos_token_id
        self.weight_bytes, self.weight_source = _param_bytes(self.model), "parameters"
        self.linear_classes = sorted({type(m).__name__ for m in self.model.modules()
                                      if "Linear" in type(m).__name__})

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, _TokenClock]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _TokenClock()
        t0 = clock.start
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=self.pad,
                stopping_criteria=self._criteria([clock]),
            )
        wall = time.perf_counter() - t0
        if out.shape[1] - width != new:
            raise RuntimeError(f"{self.name}: {out.shape[1] - width} tokens generated, {new} asked")
        return wall, clock

    def decode(self, prompt: list[int], new: int) -> float:
        wall, clock = self.run([prompt], new)
        tt = clock.times
        if len(tt) >= 2 and tt[-1] > tt[0]:
            return (len(tt) - 1) / (tt[-1] - tt[0])
        return new / wall

    def batch(self, prompts: list[list[int]], new: int) -> float:
        wall, _ = self.run(prompts, new)
        return len(prompts) * new / wall

    def prefill(self, prompt: list[int]) -> float:
        wall, clock = self.run([prompt], 1)
        ttft = clock.times[0] - clock.start if clock.times else wall
        return len(prompt) / ttft


def _param_bytes(module: torch.nn.Module) -> int:
    # parameters() yields a tied tensor once; data_ptr dedup also covers shared storage.
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def build_workload(tok, args) -> dict:
    """Token ids for the decode prompt, the concurrent batches and the long prefill prompt."""
    from entropic.bench.datasets import load_sharegpt_prompts

    rows = load_sharegpt_prompts()
    rendered = [render(tok, r["prompt"]) for r in rows]
    short = [ids for ids in rendered if len(ids) <= args.max_prompt_tokens]
    need = max(args.batch_sizes + [1])
    if len(short) < need:
        raise SystemExit(f"only {len(short)} prompts within {args.max_prompt_tokens} tokens, {need} needed")
    text, long_ids = "", render(tok, "")
    for r in rows:  # join whole prompts, skipping any that would overshoot the target
        cand = (text + "\n\n" + r["prompt"]) if text else r["prompt"]
        ids = render(tok, cand)
        if len(ids) <= args.prefill_tokens:
            text, long_ids = cand, ids
        if len(long_ids) > args.prefill_tokens - 16:
            break
    return {"rows": rows, "prompts": short[:need], "decode": short[0], "prefill": long_ids}


def measure(engine, work: dict, args, shape: dict, dtype: torch.dtype) -> dict:
    """One repeat of every figure for one engine."""
    res = {}
    dec = engine.decode(work["decode"], args.new_tokens)
    ctx = len(work["decode"]) + args.new_tokens / 2
    kv = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype.itemsize * ctx
    res["decode_tok_s"] = dec
    res["decode_bandwidth_gb_s"] = (engine.weight_bytes + kv) * dec / 1e9
    for n in args.batch_sizes:
        res[f"output_tok_s_{n}"] = engine.batch(work["prompts"][:n], args.new_tokens)
    res["prefill_tok_s"] = engine.prefill(work["prefill"])
    return res


def warm_up(engine, work: dict) -> None:
    engine.batch(work["prompts"][:2], 8)
    engine.prefill(work["prefill"][: len(work["prefill"]) // 4] or work["decode"])
    engine.decode(work["decode"], 16)


LABELS = {
    "decode_tok_s": "decode tok/s, batch 1",
    "decode_bandwidth_gb_s": "achieved bandwidth GB/s, batch-1 decode",
    "prefill_tok_s": "prefill tok/s, {p}-token prompt",
}


def markdown(summary: dict, engines: list[str], meta: dict) -> str:
    names = list(next(iter(summary.values())).keys())
    head = "| figure | " + " | ".join(engines) + (" | ours/transformers |" if len(engines) == 2 else " |")
    lines = [head, "|" + "---|" * (len(engines) + 1 + (len(engines) == 2))]
    for k in names:
        if k.startswith("output_tok_s_"):
            label = f"output tok/s, {k.rsplit('_', 1)[1]} concurrent"
        else:
            label = LABELS[k].format(p=meta["prefill_prompt_tokens"])
        cells = [f"{summary[e][k]:.1f}" for e in engines]
        if len(engines) == 2:
            cells.append(f"{summary[engines[0]][k] / summary[engines[1]][k]:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out=str(ROOT / "results" / "throughput.json"),
                    model="GGUF path (default: the engine's embedded model)",
                    quick="small smoke run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per figure; medians reported")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (32 with --quick)")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="concurrent requests, comma-separated; default 8,32,64 (8 with --quick)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="default 2048 (512 with --quick)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512,
                    help="batch prompts: ShareGPT first turns up to this rendered length, in file order")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    args = ap.parse_args(argv)
    args.out = Path(args.out)
    q = args.quick
    args.new_tokens = args.new_tokens or (32 if q else 128)
    args.batch_sizes = args.batch_sizes or ([8] if q else [8, 32, 64])
    args.prefill_tokens = args.prefill_tokens or (512 if q else 2048)
    from entropic.model.loader import default_model_path

    args.model_path = Path(args.model or default_model_path())
    if args.skip_ours and args.skip_transformers:
        ap.error("nothing to run")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    from entropic.config import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    shape = gguf_shape(args.model_path)
    engines = []
    if not args.skip_ours:
        engines.append(Ours(args, dtype, shape))
    if not args.skip_transformers:
        engines.append(HF(args, dtype))
    work = build_workload(engines[0].tokenizer, args)
    # Same token ids for both: check that the two chat templates agree on them.
    mismatches = None
    if len(engines) == 2:
        hf_tok = engines[1].tokenizer
        sample = work["rows"][:50]
        mismatches = sum(render(engines[0].tokenizer, r["prompt"]) != render(hf_tok, r["prompt"])
                         for r in sample)
        if mismatches:
            print(f"warning: chat templates differ on {mismatches}/50 prompts; both engines get "
                  f"{engines[0].name}'s token ids", file=sys.stderr)

    for e in engines:
        print(f"warming up {e.name} ...", file=sys.stderr)
        warm_up(e, work)
    samples = {e.name: {} for e in engines}
    for r in range(args.repeats):
        for e in engines:  # interleaved, so slow drift of a noisy machine hits both alike
            print(f"repeat {r + 1}/{args.repeats}: {e.name} ...", file=sys.stderr)
            for k, v in measure(e, work, args, shape, dtype).items():
                samples[e.name].setdefault(k, []).append(v)
    summary = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    names = [e.name for e in engines]

    meta = {
        "model": str(args.model_path), "dtype": args.dtype, "threads": args.threads,
        "repeats": args.repeats, "new_tokens": args.new_tokens, "batch_sizes": args.batch_sizes,
        "decode_prompt_tokens": len(work["decode"]),
        "batch_prompt_tokens": [len(p) for p in work["prompts"]],
        "prefill_prompt_tokens": len(work["prefill"]),
        "max_prompt_tokens": args.max_prompt_tokens,
        "weight_bytes": {e.name: e.weight_bytes for e in engines},
        "weight_bytes_source": {e.name: e.weight_source for e in engines},
        "kv_bytes_per_context_token": 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype.itemsize,
        "chat_template_mismatches_of_50": mismatches,
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": describe(args.threads), "arch": platform.machine(),
        "cpu_count": os.cpu_count(), "quick": args.quick,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "entropic_source": next((e.llm.source for e in engines if isinstance(e, Ours)), None),
    }
    for e in engines:
        if isinstance(e, HF):
            import transformers

            meta["transformers"] = transformers.__version__
            meta["transformers_linear_classes"] = e.linear_classes
    ratios = None
    if len(names) == 2:
        ratios = {k: summary[names[0]][k] / summary[names[1]][k] for k in summary[names[0]]}
    write_json(args.out, {"meta": meta, "median": summary,
                          "ratio_ours_over_transformers": ratios, "samples": samples})
    print(header(meta["machine"]))
    print(f"model {args.model_path.name}, {args.dtype}, {args.threads} threads, "
          f"{args.new_tokens} new tokens, median of {args.repeats}, load average "
          f"{load_before[0]:.1f} -> {meta['loadavg_after'][0]:.1f}\n")
    print(markdown(summary, names, meta))


if __name__ == "__main__":
    main()
