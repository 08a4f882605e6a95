"""The public face: `LLM` wires a checkpoint, the engine and its hooks together."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import fields
from typing import Iterator, Sequence

import torch

from entropic.config import (
    EngineConfig,
    choose_dtype,
    choose_quantization,
    confirm_int4,
)
from entropic.control.clock import EntropicClock
from entropic.control.estimators import (
    EntropyEstimate,
    choose_estimator,
    make_estimator,
)
from entropic.control.pruning import EntropicBlockPruner, PruningConfig
from entropic.control.scheduling import EntropicPolicy, EntropicSchedulingConfig
from entropic.control.thermostat import Thermostat
from entropic.engine.engine import LLMEngine
from entropic.engine.policy import SchedulingPolicy
from entropic.kernels import check_kernels
from entropic.model.linear import check_quantization
from entropic.model.llama import LlamaModel
from entropic.model.loader import load_checkpoint
from entropic.outputs import RequestOutput
from entropic.sampling.sampler import LogitsProcessor
from entropic.sampling_params import SamplingParams
from entropic.speculative import SpeculativeConfig, Speculator
from entropic.speculative.draft_model import make_proposer

log = logging.getLogger("entropic")

Prompt = str | Sequence[int]
Conversation = list[dict]


class LLM:
    """An offline engine: `LLM().generate(prompts, SamplingParams(...))`.

    `model` is a local GGUF file, a Hugging Face directory (config.json + safetensors), or
    None for the embedded SmolLM2-135M-Instruct. `dtype="auto"` (the default) picks the fastest
    format for this CPU (bf16 where it has bf16 arithmetic, fp32 where bf16 would be
    emulated; `llm.dtype_reason` says which and why); "bfloat16" or "float32" force one;
    `quantization="int4"` (a GGUF's Q4 weights as they are, others rounded to 4-bit groups)
    or "int8" runs the projections on weight-only quantized kernels (bf16 activations, CPU);
    "auto" (the default) picks int4 only for a checkpoint stored in 4 bits, on a CPU where
    int4 was measured faster than floats at every batch up to `max_num_seqs` (in practice a
    one-request engine such as `entropic generate`), else None, the float path
    (`llm.quantization_reason` says which and why). `kernels` "native" (the default on the CPU) runs the small
    per-layer ops and decode attention on entropic's C++ kernels, compiled on first use
    (`entropic.kernels`); "torch" runs plain torch ops. KV capacity is `num_kv_blocks` blocks or `kv_cache_gib` GiB.
    `scheduling` is "fcfs" (default) or "entropic" (priority by expected entropy reduction
    per unit cost, with aging; tuned by `scheduling_config`); `policy` overrides both.
    `pruning` (a PruningConfig; None, the default, is dense attention) lets decode steps
    attend only the KV blocks whose entropic contribution clears an entropy-dependent
    threshold, and optionally evict blocks under memory pressure.
    `speculative_config` (a SpeculativeConfig or a dict of its fields, e.g.
    {"method": "ngram", "num_speculative_tokens": 8}; None, the default, is off) drafts
    tokens by prompt lookup (or a draft model) that decode steps verify in one pass; the
    entropy gate decides when and how far. Greedy and seeded outputs are token-identical
    to decoding without it.
    `entropy_estimator` ("auto", the default, "exact", "topK" or "topK+tail") is how each
    step's entropy is measured for the outputs and the control laws; "auto" chooses from
    measured cost (`control.estimators.choose_estimator`; `llm.entropy_estimator_reason`
    says what and why); a request's `SamplingParams.entropy_estimator` overrides it.
    `enable_prefix_caching` (on by default) lets a request start on the KV blocks of an
    earlier request with the same prefix (a shared system prompt, a chat's earlier turns)
    instead of computing them again (docs/prefix_caching.md).
    """

    def __init__(self, model: str | None = None, dtype: str | torch.dtype = "auto", *,
                 quantization: str | None = "auto", kernels: str | None = None,
                 device: str = "cpu", block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, num_kv_blocks: int | None = None,
                 kv_cache_gib: float = 1.0, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True,
                 seed: int | None = None, progress: bool = False,
                 scheduling: str = "fcfs",
                 scheduling_config: EntropicSchedulingConfig | None = None,
                 policy: SchedulingPolicy | None = None,
                 pruning: PruningConfig | None = None,
                 speculative_config: SpeculativeConfig | dict | None = None,
                 entropy_estimator: str = "auto",
                 processors: Sequence[LogitsProcessor] = ()) -> None:
        config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              num_kv_blocks=num_kv_blocks, kv_cache_gib=kv_cache_gib,
                              max_model_len=max_model_len,
                              enable_prefix_caching=enable_prefix_caching)
        asked_quantization = quantization
        quantization, self.quantization_reason = choose_quantization(
            quantization, dtype=dtype, device=device, kernels=kernels, max_num_seqs=max_num_seqs)
        torch_dtype, self.dtype_reason = choose_dtype(dtype, device, quantization)
        check_quantization(quantization, torch_dtype, device)
        if kernels is not None:
            check_kernels(kernels, device)
        if scheduling not in ("fcfs", "entropic"):
            raise ValueError(f"scheduling must be 'fcfs' or 'entropic', got {scheduling!r}")
        if pruning is not None and not isinstance(pruning, PruningConfig):
            raise TypeError(f"pruning must be a PruningConfig or None, got {type(pruning).__name__}")
        spec = speculative_config
        if isinstance(spec, dict):
            unknown = set(spec) - {f.name for f in fields(SpeculativeConfig)}
            if unknown:
                raise ValueError(f"speculative_config: unknown field(s) {sorted(unknown)}")
            spec = SpeculativeConfig(**spec)
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise TypeError(f"speculative_config must be a SpeculativeConfig, a dict or None, "
                            f"got {type(spec).__name__}")
        if not isinstance(entropy_estimator, str):
            raise TypeError(f"entropy_estimator must be a string, got "
                            f"{type(entropy_estimator).__name__}")
        if entropy_estimator != "auto":
            make_estimator(entropy_estimator)  # a clear ValueError for a bad name, before loading
        if seed is not None:
            torch.manual_seed(seed)
        t0 = time.perf_counter()
        ckpt = load_checkpoint(model, progress=progress, keep_int4=quantization == "int4")
        quantization, self.quantization_reason = confirm_int4(
            quantization, self.quantization_reason, asked_quantization, ckpt.tensors)
        if quantization is None and asked_quantization == "auto":
            torch_dtype, self.dtype_reason = choose_dtype(dtype, device, None)
        self.quantization = quantization
        net = LlamaModel(ckpt.config, ckpt.tensors, torch_dtype, device,
                         quantization=quantization, kernels=kernels)
        del ckpt.tensors
        self.source = ckpt.source
        self.tokenizer = ckpt.tokenizer
        # Entropic control plugs into the engine's hooks: the entropy estimate (exact unless
        # chosen otherwise) comes first in the sampler chain, so every law reads it; the
        # thermostat acts only on requests that ask for it; the clock only measures.
        if entropy_estimator == "auto":
            native = net.backend.native
            entropy_estimator, self.entropy_estimator_reason = choose_estimator(
                ckpt.config.vocab_size, native, min(max_num_seqs, 64), device)
        else:
            self.entropy_estimator_reason = (f"{entropy_estimator}: set explicitly "
                                             "(LLM(entropy_estimator=...), --entropy-estimator)")
        self.entropy_estimate = EntropyEstimate(entropy_estimator)
        log.info("entropy estimator %s", self.entropy_estimator_reason)
        self.thermostat = Thermostat(self.entropy_estimate)
        self.clock = EntropicClock()
        if policy is None and scheduling == "entropic":
            policy = EntropicPolicy(self.clock, scheduling_config)  # the engine binds it
        self.pruner = EntropicBlockPruner(pruning, block_size) if pruning is not None else None
        self.speculator = (Speculator(spec, make_proposer(spec, self.tokenizer, device))
                           if spec is not None else None)
        self.engine = LLMEngine(net, self.tokenizer, config, policy,
                                [self.entropy_estimate, self.thermostat, *processors],
                                self.clock, self.pruner,
                                self.speculator)
        self.engine.stats.dtype_reason = self.dtype_reason
        self.engine.stats.quantization = quantization
        self.engine.stats.quantization_reason = self.quantization_reason
        log.info("dtype %s", self.dtype_reason)
        log.info("quantization %s", self.quantization_reason)
        self.load_seconds = time.perf_counter() - t0
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # ---- batch API -------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = self._params_list(params, len(prompts))
        return self._run(prompts, plist, use_tqdm)

    def chat(self, conversations: Conversation | Sequence[Conversation],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(list(c)) for c in conversations]
        return self._run(prompts, self._params_list(params, len(prompts)), use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield an output (with `text_delta`) each time the request gets a token.

        Other requests already in the engine keep running alongside. Closing the
        generator early aborts the request and frees its blocks."""
        params = params or SamplingParams()
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"params: got {len(plist)} SamplingParams for {n} prompts")
        return plist

    def _run(self, prompts: list[Prompt], plist: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        eng = self.engine
        for i, (p, sp) in enumerate(zip(prompts, plist)):  # validate all before adding any
            try:
                eng.validate(p, sp)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        now = time.perf_counter()
        for rid, p, sp in zip(ids, prompts, plist):
            eng.add_request(rid, p, sp, arrival_time=now)
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while len(results) < len(ids):
                for out in eng.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    eng.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
