"""entropic's control laws on vLLM (docs/vllm.md in the entropic repository).

- `entropic_vllm.thermostat.ThermostatLogitsProcessor`: the thermostat as a vLLM V1 logits
  processor (`vllm serve MODEL --logits-processors entropic_vllm:ThermostatLogitsProcessor`);
- `entropic_vllm.endpoint.EntropicEndpoint`: an endpoint plugin (`VLLM_PLUGINS=entropic`)
  that adds each token's temperature and entropy to completion responses;
- `entropic_vllm.traces.fetch_traces`: the same numbers for offline `vllm.LLM` users;
- `entropic_vllm.scheduler.EntropicScheduler` (`--scheduler-cls`): entropic's scheduling
  policy, pi(s) with aging, fed by `entropic_vllm.entropy.EntropyLogitsProcessor`;
- `entropic_vllm.pruning.PruningLogitsProcessor`: entropic's query-aware KV-block pruning
  for opted-in requests, through the attention backend it installs over vLLM's CPU_ATTN
  (`entropic_vllm.pruned_attention`).
"""
from entropic_vllm.entropy import EntropyLogitsProcessor
from entropic_vllm.params import parse_thermostat
from entropic_vllm.thermostat import ThermostatLogitsProcessor

__all__ = ["EntropyLogitsProcessor", "ThermostatLogitsProcessor", "parse_thermostat"]
