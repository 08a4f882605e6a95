"""entropic: entropic-time LLM inference (see README.md)."""
from entropic.sampling_params import SamplingParams, ThermostatParams

__all__ = ["LLM", "SamplingParams", "ThermostatParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the model and loader stack; import it on first use only.
    if name == "LLM":
        from entropic.llm import LLM
        return LLM
    raise AttributeError(f"module 'entropic' has no attribute {name!r}")
