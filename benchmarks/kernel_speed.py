"""entropic's native CPU kernels against the torch ops they replace, side by side.

    python3 benchmarks/kernel_speed.py                 # 2 threads, results/kernels.json
    python3 benchmarks/kernel_speed.py --quick         # fewer repeats

Each figure is the median time of one call (or of one token's worth of calls), the two
implementations alternating call by call so that machine noise hits both alike:
- decode attention: `entropic.paged_decode_attention` (reads the paged cache in place)
  against the torch path (gather the context with index_select, then SDPA), SmolLM2's
  shapes (9 query heads, 3 KV heads, head dim 64), KV in blocks of 16 slots scattered over a
  large cache, at batch 1 (context 128 and 1024) and 64 rows (context 300);
- prefill attention: `entropic.prefill_attention` (bf16, flash style) against SDPA's fp32
  flash kernel (the torch path), causal, 512 and 2048 tokens, one layer;
- small ops of one layer: RMSNorm, RoPE + KV write, SiLU*up against their torch formulas;
- the sampler's row statistics (max, log-normaliser, entropy, argmax) over 49152 logits,
  1 and 64 rows: `entropic.logit_stats` against log_softmax and the ops around it;
- int4 projections of a whole token: the 4 projection shapes of SmolLM2 x 30 layers, each
  with its own weights (so they stream from memory as in a real decode step), entropic's
  int4 kernel against torch's (`_weight_int4pack_mm_for_cpu`), and a plain sum over the
  same number of bytes as the memory floor;
- the int8 lm_head (49152 x 576): entropic's int8 kernel against torch's
  (`_weight_int8pack_mm`).
The quantized kernels and prefill attention need AVX2 or better (the native level in use,
`entropic.kernels.isa()`); at the generic level those rows are skipped with a message.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from entropic.bench.machine import add_common_args, describe, header, write_json

ROOT = Path(__file__).resolve().parents[1]

def _median_us(fns: dict, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each function, calls alternating."""
    for f in fns.values():
        for _ in range(3):
            f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def _paged_slots(n: int, ctx: int, num_slots: int, gen) -> "torch.Tensor":
    import torch
    nb = -(-ctx // 16)
    rows = [(torch.randperm(num_slots // 16, generator=gen)[:nb, None] * 16
             + torch.arange(16)).reshape(-1)[:ctx] for _ in range(n)]
    return torch.stack(rows)


def attention_rows(repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    ops = torch.ops.entropic
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, ctx in ((1, 128), (1, 1024), (64, 300)):
        num_slots = 32768
        cache = torch.randn(num_slots, 2, 3, 64, generator=gen).bfloat16()
        q = torch.randn(n, 9, 64, generator=gen).bfloat16()
        slots = _paged_slots(n, ctx, num_slots, gen)
        flat, qd = slots.reshape(-1), q.view(n, 3, 3, 64)

        def torch_path():
            c = cache.index_select(0, flat).view(n, ctx, 2, 3, 64)
            return F.scaled_dot_product_attention(qd, c[:, :, 0].transpose(1, 2),
                                                  c[:, :, 1].transpose(1, 2), scale=0.125)

        t = _median_us({"native": lambda: ops.paged_decode_attention(q, cache, slots, None,
                                                                     0.125, None),
                        "torch": torch_path}, repeats if n == 1 else max(repeats // 10, 5))
        out.append({"what": f"decode attention, {n} row(s), context {ctx}", **t})
    return out


def prefill_rows(repeats: int) -> list[dict]:
    """Causal attention of a whole prompt (no cached prefix), SmolLM2's shapes: entropic's
    bf16 prefill kernel against the torch path it replaces (SDPA's flash kernel in fp32 on
    the chunk's own K/V, as `entropic.model.attention._prefill_chunk` runs it)."""
    import torch
    import torch.nn.functional as F
    ops = torch.ops.entropic
    if not ops.prefill_attention_supported():
        print("prefill attention: skipped (the generic level has none: it needs AVX2 or better)")
        return []
    gen = torch.Generator().manual_seed(2)
    out = []
    for T in (512, 2048):
        cache = torch.randn(T, 2, 3, 64, generator=gen).bfloat16()
        q = torch.randn(T, 9, 64, generator=gen).bfloat16()
        slots = torch.arange(T)

        def torch_path():
            qp = q.transpose(0, 1)[None].float()
            kp = cache[:, 0].transpose(0, 1)[None].float()
            vp = cache[:, 1].transpose(0, 1)[None].float()
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=0.125,
                                                  enable_gqa=True)[0].transpose(0, 1).bfloat16()

        t = _median_us({"native": lambda: ops.prefill_attention(q, cache, slots, 0, 0.125),
                        "torch": torch_path}, max(repeats // 40, 5))
        out.append({"what": f"prefill attention, {T}-token prompt (one layer)", **t})
    return out


def sampler_rows(repeats: int) -> list[dict]:
    """The sampler's per-row statistics of a step's fp32 logits (vocabulary 49152): one
    `entropic.logit_stats` call against the torch ops it replaces (finite check, log_softmax,
    entropy, argmax)."""
    import torch
    from entropic.sampling.sampler import entropy_from_logprobs
    gen = torch.Generator().manual_seed(3)
    out = []
    for rows in (1, 64):
        logits = torch.randn(rows, 49152, generator=gen) * 3

        def torch_path():
            torch.isfinite(logits.amax(dim=-1)).all()
            logp = torch.log_softmax(logits, dim=-1)
            return entropy_from_logprobs(logp), logits.argmax(dim=-1)

        t = _median_us({"native": lambda: torch.ops.entropic.logit_stats(logits),
                        "torch": torch_path}, repeats if rows == 1 else max(repeats // 10, 5))
        out.append({"what": f"sampler statistics, {rows} row(s) x 49152", **t})
    return out


def small_op_rows(repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from entropic.model.llama import RotaryEmbedding, rms_norm
    ops = torch.ops.entropic
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 576, generator=gen).bfloat16()
    w = torch.rand(576, generator=gen).bfloat16()
    gu = torch.randn(1, 3072, generator=gen).bfloat16()
    rope = RotaryEmbedding(64, 8192, 1e5, torch.bfloat16, "cpu")
    cos, sin = rope.tables(torch.tensor([100]))
    qkv = torch.randn(1, 960, generator=gen).bfloat16()
    cache = torch.zeros(64, 2, 3, 64, dtype=torch.bfloat16)
    slot = torch.tensor([5])

    def rope_torch():
        y = qkv.clone()
        RotaryEmbedding.apply_(y[:, :768].view(1, 12, 64), cos, sin)
        cache.index_copy_(0, slot, y[:, 576:].view(1, 2, 3, 64))

    def rope_native():
        ops.rope_kv_(qkv.clone(), cos, sin, cache, slot, 9, 3)

    rows = [("RMSNorm, 1 x 576", lambda: ops.rms_norm(x, w, 1e-5), lambda: rms_norm(x, w, 1e-5)),
            ("SiLU * up, 1 x 1536", lambda: ops.silu_mul(gu),
             lambda: F.silu(gu[:, :1536]) * gu[:, 1536:]),
            ("RoPE + KV write, 1 token (clone included)", rope_native, rope_torch)]
    return [{"what": name, **_median_us({"native": a, "torch": b}, repeats)}
            for name, a, b in rows]


def quantized_rows(repeats: int) -> list[dict]:
    import torch
    from entropic.model.linear import Int4Linear, Int8Linear, NativeInt4Linear, NativeInt8Linear
    from entropic.model.quant import quantize_int4
    if not torch.ops.entropic.int4_linear_supported():
        print("quantized kernels skipped: the generic level has none (they need AVX2 or better)")
        return []
    gen = torch.Generator().manual_seed(2)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    layers = [[quantize_int4(torch.randn(n, k, generator=gen) * 0.05) for n, k in shapes]
              for _ in range(30)]
    ours = [[NativeInt4Linear(b) for b in layer] for layer in layers]
    theirs = [[Int4Linear(b) for b in layer] for layer in layers]
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for k in (576, 1536)}
    # the bytes entropic's format reads per token (codes, fp32 scales and offsets)
    floor = [torch.ones(sum(n * k for n, k in shapes) * 3 // 16) for _ in range(30)]

    def token(lins):
        def run():
            for layer in lins:
                for lin in layer:
                    lin(xs[lin.in_features])
        return run

    def sums():
        for f in floor:
            f.sum()

    reps = max(repeats // 20, 10)
    out = [{"what": "int4 projections of one token (30 layers x 4, weights from memory)",
            **_median_us({"native": token(ours), "torch": token(theirs),
                          "sum over the same bytes": sums}, reps)}]
    head = torch.randn(49152, 576, generator=gen) * 0.05
    x = torch.randn(1, 576, generator=gen).bfloat16()
    n8, t8 = NativeInt8Linear(head), Int8Linear(head)
    out.append({"what": "int8 lm_head 49152 x 576, 1 row",
                **_median_us({"native": lambda: n8(x), "torch": lambda: t8(x)}, reps)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out=str(ROOT / "results" / "kernels.json"), model=False,
                    quick="fewer repeats")
    a = ap.parse_args(argv)
    import torch
    from entropic import kernels
    torch.set_num_threads(a.threads)
    kernels.load()
    repeats = 100 if a.quick else 400
    rows = (attention_rows(repeats) + prefill_rows(repeats) + small_op_rows(repeats)
            + sampler_rows(repeats) + quantized_rows(repeats))
    machine = describe(a.threads)
    print(header(machine))
    print("| kernel call | native us | torch us | torch / native |")
    print("|---|---|---|---|")
    for r in rows:
        extra = "".join(f" ({k}: {v:.0f} us)" for k, v in r.items()
                        if k not in ("what", "native", "torch"))
        print(f"| {r['what']}{extra} | {r['native']:.1f} | {r['torch']:.1f} | "
              f"{r['torch'] / r['native']:.2f}x |")
    write_json(a.out, {"machine": machine, "cpu": machine["cpu"], "threads": a.threads,
                       "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
