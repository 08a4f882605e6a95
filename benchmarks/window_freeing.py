"""KV blocks held over a long generation, with and without freeing the blocks that lie before
every layer's sliding window (docs/windows.md):

    PYTHONPATH=src python3 benchmarks/window_freeing.py            # ~1-3 min on 2 cores
    PYTHONPATH=src python3 benchmarks/window_freeing.py --quick

No weights are downloaded: a randomly initialised Mistral (every layer windowed) is built
with transformers' own config class and saved as an HF directory; the KV bookkeeping does
not depend on the weights. --requests sequences each generate --tokens tokens after a
--prompt-token prompt (greedy, EOS ignored), side by side. Per step the blocks in use are
recorded; the two runs' tokens must be identical. Also printed: what a per-layer-group
allocator (vLLM's hybrid KV manager) would hold for Gemma 3 270M (15 sliding layers of
window 512, 3 global), against the one block table shared by all layers that we keep.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from entropic.bench.machine import add_common_args, describe, header, write_json


def build_mistral(folder: Path, window: int, layers: int, vocab: int = 512) -> None:
    """A random tiny Mistral checkpoint and a word-level tokenizer in `folder`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=layers, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=32768,
                                     sliding_window=window, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)
    transformers.MistralForCausalLM(cfg).eval().save_pretrained(folder)
    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t3"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="t1", eos_token="t2",
                                         pad_token="t0", unk_token="t3").save_pretrained(folder)


def run(engine, prompts, tokens: int) -> dict:
    from entropic.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    held, outs = [], {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        held.append(engine.pool.num_used)
    seconds = time.perf_counter() - t0
    assert engine.pool.num_free == engine.num_blocks, "blocks leaked"
    return {"peak_blocks": max(held), "mean_blocks": statistics.fmean(held), "steps": len(held),
            "seconds": seconds, "freed": engine.scheduler.num_window_freed_blocks,
            "tokens": outs}


def hybrid_gemma3(context: int, block: int = 16, window: int = 512, sliding: int = 15,
                  full: int = 3) -> dict:
    """KV bytes of one Gemma 3 270M sequence of `context` tokens (bf16, 1 KV head of 256):
    one block table for all 18 layers (ours) against one table per layer group, the
    sliding group holding only the blocks its window reaches."""
    per_token_layer = 2 * 1 * 256 * 2  # K and V, 1 KV head, head_dim 256, bf16
    blocks = -(-context // block)
    # a window of w positions ending anywhere touches at most ceil((w - 1) / block) + 1 blocks
    window_blocks = min(blocks, -(-(window - 1) // block) + 1)
    shared = (sliding + full) * blocks * block * per_token_layer
    grouped = (full * blocks + sliding * window_blocks) * block * per_token_layer
    return {"context": context, "shared_MiB": shared / 2**20, "grouped_MiB": grouped / 2**20,
            "saved": 1 - grouped / shared}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    add_common_args(ap, threads=1, out="results/window_freeing.json", model=False,
                    quick="window 64, 256 tokens")
    a = ap.parse_args(argv)
    if a.quick:
        a.window, a.tokens, a.prompt_tokens = 64, 256, 32
    for name in ("window", "layers", "requests", "prompt_tokens", "tokens", "block_size"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    from entropic import LLM
    from entropic.engine.engine import LLMEngine

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        build_mistral(Path(tmp), a.window, a.layers)
        ctx = a.prompt_tokens + a.tokens
        need = a.requests * -(-ctx // a.block_size)
        llm = LLM(tmp, dtype="float32", block_size=a.block_size, num_kv_blocks=need,
                  max_num_batched_tokens=max(512, a.prompt_tokens), max_model_len=ctx,
                  enable_prefix_caching=False)
        g = torch.Generator().manual_seed(0)
        prompts = [[1] + torch.randint(3, 512, (a.prompt_tokens - 1,), generator=g).tolist()
                   for _ in range(a.requests)]
        eng = llm.engine
        res = {}
        for free in (True, False):
            e = LLMEngine(eng.model, eng.tokenizer, replace(eng.config, free_outside_window=free))
            res["freed" if free else "kept"] = run(e, prompts, a.tokens)
    same = res["freed"].pop("tokens") == res["kept"].pop("tokens")
    machine = describe(a.threads)
    report = {"machine": machine, "threads": a.threads,
              "args": {k: v for k, v in vars(a).items() if k != "out"},
              "identical_tokens": same, **res,
              "gemma3_270m_per_layer_group": [hybrid_gemma3(n) for n in
                                              (512, 1024, 4096, 8192, 32768)]}
    print(header(machine))
    print(json.dumps(report, indent=1))
    write_json(a.out, report)
    if not same:
        raise SystemExit("freeing changed the tokens")


if __name__ == "__main__":
    main()
