"""Per-request thermostat arguments, read from vLLM's `SamplingParams.extra_args`.

Two spellings, one meaning (the fields of `entropic.ThermostatParams`):
- offline (`vllm.LLM`): `extra_args={"thermostat": {"target_entropy": 2.0, "eta": 0.2}}`;
  an empty dict means every default;
- OpenAI server: `vllm_xargs` holds only flat numbers and strings, so each field is its own
  key, `{"thermostat_target_entropy": 2.0, "thermostat_mode": "follow"}`; any one key turns
  the thermostat on (`{"thermostat_mode": "stabilize"}` for every default).
The request's `temperature` is T_0, as in entropic's engine. `entropic_trace` (a string key)
asks the processor to keep the request's per-token temperatures and entropies for
`entropic_vllm.traces`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from entropic.sampling_params import SamplingParams as EntropicSamplingParams
from entropic.sampling_params import GREEDY_BELOW, ThermostatParams

PREFIX = "thermostat_"
TRACE_KEY = "entropic_trace"
FIELDS = tuple(f.name for f in fields(ThermostatParams))


@dataclass(frozen=True)
class RequestThermostat:
    """What the processor needs of one request: the law's parameters and T_0."""

    params: ThermostatParams
    t0: float


def parse_thermostat(extra_args: Mapping[str, Any] | None,
                     temperature: float) -> RequestThermostat | None:
    """The request's thermostat, or None when it asks for none. Raises ValueError, naming
    the argument, for anything entropic's own engine would refuse."""
    if not extra_args:
        return None
    nested = extra_args.get("thermostat")
    flat = {k[len(PREFIX):]: v for k, v in extra_args.items() if k.startswith(PREFIX)}
    if nested is None and not flat:
        return None
    if nested is not None and flat:
        raise ValueError("thermostat: give either extra_args['thermostat'] (a dict) or "
                         f"'{PREFIX}<field>' keys, not both")
    given = nested if nested is not None else flat
    where = "extra_args['thermostat']" if nested is not None else f"'{PREFIX}<field>' keys"
    if not isinstance(given, Mapping):
        raise ValueError(f"thermostat: extra_args['thermostat'] must be a dict of "
                         f"{', '.join(FIELDS)}; got {type(given).__name__}")
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ValueError(f"thermostat: unknown field(s) {unknown} in {where}; "
                         f"known: {', '.join(FIELDS)}")
    for name, value in given.items():
        want = str if name == "mode" else (int, float)
        if isinstance(value, bool) or not isinstance(value, want):
            raise ValueError(f"thermostat.{name} must be "
                             f"{'a string' if name == 'mode' else 'a number'}, got {value!r}")
    if float(temperature) < GREEDY_BELOW:
        raise ValueError(f"temperature: the thermostat needs temperature >= {GREEDY_BELOW:g} "
                         f"(its T_0; vLLM samples greedily below that), got {temperature}")
    try:
        th = ThermostatParams(**{k: (float(v) if k != "mode" else v)
                                 for k, v in given.items()})
        # entropic's own check of the pair: T_0 > 0 and in range
        EntropicSamplingParams(temperature=float(temperature), thermostat=th)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    return RequestThermostat(th, min(th.t_max, max(th.t_min, float(temperature))))


def trace_key(extra_args: Mapping[str, Any] | None) -> str | None:
    """The request's trace key, validated, or None."""
    key = (extra_args or {}).get(TRACE_KEY)
    if key is None:
        return None
    if not isinstance(key, str) or not 0 < len(key) <= 128:
        raise ValueError(f"{TRACE_KEY} must be a string of 1 to 128 characters, got {key!r}")
    return key
