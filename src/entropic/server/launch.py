"""`entropic serve`: its command-line options and the uvicorn launch.

Kept apart from cli.py so that the shared CLI file only gains a few lines, and so that
`entropic generate` never imports FastAPI.
"""
from __future__ import annotations

import argparse
import sys


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` name clients use (default: the checkpoint's file name)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--quantization", choices=("int8", "int4"), default=None,
                   help="weight-only quantized projections (CPU, bf16 activations)")
    p.add_argument("--kernels", choices=("native", "torch"), default=None,
                   help="native: entropic's C++ CPU kernels for the small per-layer ops and "
                        "decode attention (the CPU default; compiled on first use); torch: "
                        "plain torch ops")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: local clients only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests held beyond --max-num-seqs before answering 429 (default 256)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running batch size (slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache size in GiB when --num-kv-blocks is not given")
    p.add_argument("--scheduling", choices=("fcfs", "entropic"), default="fcfs",
                   help="request ordering: fcfs, or entropic (priority with aging)")
    p.add_argument("--pruning", action="store_true",
                   help="entropic KV-block pruning in decode attention (default PruningConfig)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted."""
    import torch
    import uvicorn

    from entropic import LLM
    from entropic.control.pruning import PruningConfig
    from entropic.server.app import build_app

    if args.threads:
        torch.set_num_threads(args.threads)
    print("loading model ...", file=sys.stderr, flush=True)
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              kernels=args.kernels,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, block_size=args.block_size,
              num_kv_blocks=args.num_kv_blocks, kv_cache_gib=args.kv_cache_gib,
              scheduling=args.scheduling,
              pruning=PruningConfig() if args.pruning else None)
    print(f"loaded {llm.source} in {llm.load_seconds:.1f}s", file=sys.stderr, flush=True)
    app = build_app(llm, args.served_model_name, args.api_key, args.max_waiting)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
