"""Command-line options shared by `entropic generate`, `chat` and `serve`: how the model is
loaded. (Imports nothing heavy: `entropic serve --help` and `generate` stay light.)"""
from __future__ import annotations

import argparse


def load_kwargs(args: argparse.Namespace) -> dict:
    """The `LLM(...)` arguments of the options add_load_args added (speculative ones too)."""
    from entropic.speculative.config import speculative_from_args

    quantization = None if args.quantization == "none" else args.quantization
    return dict(model=args.model, dtype=args.dtype, quantization=quantization,
                kernels=args.kernels, enable_prefix_caching=args.enable_prefix_caching,
                entropy_estimator=args.entropy_estimator,
                speculative_config=speculative_from_args(args))


def loaded_line(llm) -> str:
    """What was loaded and how, as `generate`, `chat` and `serve` print it."""
    return (f"loaded {llm.source} in {llm.load_seconds:.1f}s; dtype {llm.dtype_reason}; "
            f"quantization {llm.quantization_reason}; "
            f"entropy {llm.entropy_estimator_reason}")


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: bfloat16 on CPUs with bf16 arithmetic, else float32), "
                        "bfloat16 or float32")
    p.add_argument("--quantization", choices=("auto", "int8", "int4", "none"), default="auto",
                   help="weight-only quantized projections (CPU, bf16 activations); auto "
                        "(default): int4 for a 4-bit checkpoint where it was measured faster "
                        "at the engine's batch size (see docs/performance.md), else none")
    p.add_argument("--kernels", choices=("native", "torch"), default=None,
                   help="native: entropic's C++ CPU kernels for the small per-layer ops and "
                        "decode attention (the CPU default; compiled on first use); torch: "
                        "plain torch ops")
    p.add_argument("--entropy-estimator", default="auto",
                   help="how each step's entropy is measured: auto (default: chosen from "
                        "measured cost, see docs/entropy.md), exact, topK or topK+tail "
                        "(e.g. top32+tail)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="share the KV of full blocks between requests with the same prefix "
                        "(default on; --no-enable-prefix-caching turns it off)")
