"""Command line: `entropic generate "prompt"`, an interactive `entropic chat`, and
`entropic serve` (the OpenAI-compatible server)."""
from __future__ import annotations

import argparse
import sys
import time

from entropic.cli_args import add_load_args, load_kwargs, loaded_line
from entropic.speculative.config import add_speculative_args


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_load_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_speculative_args(p)


def _build(args):
    import torch

    from entropic import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    print("loading model ...", file=sys.stderr, flush=True)
    # one conversation at a time: one running request (what quantization="auto" sizes for)
    llm = LLM(**load_kwargs(args), progress=True, max_model_len=None, max_num_seqs=1)
    print(loaded_line(llm), file=sys.stderr, flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed)
    return llm, params


def _stream(llm, prompt, params) -> tuple[str, object]:
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    return (last.text if last else ""), last


def cmd_generate(args) -> int:
    llm, params = _build(args)
    prompt = args.prompt
    if not args.raw:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    t0 = time.perf_counter()
    _, out = _stream(llm, prompt, params)
    if out is not None and args.stats:
        n = len(out.token_ids)
        dt = time.perf_counter() - t0
        ents = out.entropies
        mean_h = sum(ents) / len(ents) if ents else float("nan")
        spec = out.speculation
        extra = (f", {spec.tokens_per_forward:.2f} tokens per forward pass, "
                 f"{spec.accepted_tokens}/{spec.drafted_tokens} drafted tokens accepted"
                 if spec is not None else "")
        print(f"[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s, TTFT {out.metrics.ttft:.3f}s, "
              f"finish={out.finish_reason}, mean entropy {mean_h:.3f} nats{extra}]",
              file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm, params = _build(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("chat: type a message; empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(history)
        if len(ids) + params.max_tokens > llm.engine.max_model_len:
            print("(conversation too long for the context; starting over)", file=sys.stderr)
            history = history[:1] if args.system else []
            history.append({"role": "user", "content": line})
            ids = llm.tokenizer.apply_chat_template(history)
        text, _ = _stream(llm, ids, params)
        history.append({"role": "assistant", "content": text})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="entropic", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt (streamed)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the model's chat template")
    g.add_argument("--no-stats", dest="stats", action="store_false")
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat")
    c.add_argument("--system", default=None, help="system prompt")
    _add_model_args(c)
    c.set_defaults(func=cmd_chat)
    from entropic.server.launch import add_serve_args, serve
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see README)")
    add_serve_args(s)
    s.set_defaults(func=serve)
    from entropic.bench.command import add_parsers as add_bench_parsers
    b = sub.add_parser("bench", help="benchmarks: `entropic bench ablation` (docs/ablation.md)")
    add_bench_parsers(b.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
