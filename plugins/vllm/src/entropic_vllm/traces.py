"""Fetching per-token traces from the thermostat processors inside vLLM's workers.

The processor lives in the worker process; the client (the OpenAI server's front end, or an
offline `vllm.LLM`) reaches it through vLLM's `collective_rpc` by method name. The method is
added to the worker by vLLM's own extension mechanism:

    vllm serve MODEL ... --worker-extension-cls entropic_vllm.traces.TraceWorkerExtension
    LLM(MODEL, ..., worker_extension_cls="entropic_vllm.traces.TraceWorkerExtension")

(vLLM's multiprocess executor, the CPU backend's default, passes only method names or
callables to its workers, and callables cross its engine-core socket only with
VLLM_ALLOW_INSECURE_SERIALIZATION=1: a named method needs neither.)
"""
from __future__ import annotations

from typing import Any

from entropic_vllm.thermostat import ThermostatLogitsProcessor

METHOD = "entropic_pop_traces"
STATS_METHOD = "entropic_pruning_stats"
EXTENSION = "entropic_vllm.traces.TraceWorkerExtension"


class TraceWorkerExtension:
    """Mixed into vLLM's worker class: one collective_rpc method."""

    def entropic_pop_traces(self, keys: list[str]) -> dict[str, dict[str, list[float]]]:
        runner = getattr(self, "model_runner", None)
        batch = getattr(runner, "input_batch", None)
        procs = getattr(getattr(batch, "logitsprocs", None), "all", ())
        out: dict[str, dict[str, list[float]]] = {}
        for p in procs:
            if isinstance(p, ThermostatLogitsProcessor):
                out.update(p.pop_traces(list(keys)))
        return out

    def entropic_pruning_stats(self, reset: bool = True) -> dict[str, int]:
        """The pruning backend's counters in this worker (entropic_vllm.pruning.PruningStats),
        reset once read unless `reset` is False."""
        from entropic_vllm.pruning import SHARED
        return SHARED.pop_stats(reset)


def _merge(results: list[dict]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for r in results:
        out.update(r or {})
    return out


def fetch_traces(llm: Any, keys: list[str]) -> dict[str, dict[str, list[float]]]:
    """From an offline `vllm.LLM` built with the extension: the traces of the requests whose
    extra_args carried these `entropic_trace` keys (each returned once, then forgotten)."""
    return _merge(llm.collective_rpc(METHOD, args=(list(keys),)))


async def fetch_traces_async(engine_client: Any,
                             keys: list[str]) -> dict[str, dict[str, list[float]]]:
    """The same from the OpenAI server's engine client. With data parallelism a request ran
    on one of several engines, and `collective_rpc` reaches only the first: ask each engine
    (its core client's `call_utility_all_async`, one result list per engine)."""
    core = getattr(engine_client, "engine_core", None)
    ask_all = getattr(core, "call_utility_all_async", None)
    if ask_all is None:
        return _merge(await engine_client.collective_rpc(METHOD, args=(list(keys),)))
    per_engine = await ask_all("collective_rpc", METHOD, None, (list(keys),), None)
    return _merge([r for workers in per_engine for r in workers])


def fetch_pruning_stats(llm: Any, reset: bool = True) -> dict[str, int]:
    """From an offline `vllm.LLM` built with the extension: the pruning counters of its
    workers, summed (entropic_vllm.pruning.PruningStats)."""
    total: dict[str, int] = {}
    for r in llm.collective_rpc(STATS_METHOD, args=(reset,)):
        for k, v in (r or {}).items():
            total[k] = total.get(k, 0) + v
    return total
