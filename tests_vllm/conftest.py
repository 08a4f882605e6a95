"""tests_vllm/: entropic-vllm on the real vLLM CPU build (`make test-vllm`, part of `make test`).

vLLM runs in its own virtual environment (ENTROPIC_VLLM_PYTHON, which the make target
builds or reuses); these tests run in entropic's environment and drive it through
subprocesses (tests_vllm/vllm_runs.py, and `vllm serve`'s module for the server test).
Both sides load one HF directory of the default model (ENTROPIC_VLLM_MODEL, written by
benchmarks/make_hf_dir.py when missing): the same bf16 weights, computed in fp32.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "entropic"
torch.set_num_threads(1)


def vllm_env() -> dict[str, str]:
    """One core for vLLM's OpenMP threads. PYTHONPATH: this checkout's entropic and
    entropic-vllm, ahead of the venv's editable installs (which may point at another
    checkout), and nothing else from entropic's environment."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="1", TQDM_DISABLE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "plugins" / "vllm" / "src"),
                                           str(ROOT / "src")]))
    return env


@pytest.fixture(scope="session")
def vllm_python() -> str:
    py = os.environ.get("ENTROPIC_VLLM_PYTHON", str(CACHE / "vllm-venv" / "bin" / "python"))
    if not Path(py).exists():
        pytest.fail(f"no vLLM environment at {py}: `make test-vllm` builds it "
                    f"(or set ENTROPIC_VLLM_PYTHON to a python with vllm-cpu and entropic-vllm)")
    return py


@pytest.fixture(scope="session")
def hf_dir() -> str:
    d = Path(os.environ.get("ENTROPIC_VLLM_MODEL", CACHE / "smollm2_hf"))
    if not (d / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_hf_dir.py"), str(d)],
                       check=True)
    return str(d)


def _run(vllm_python: str, hf_dir: str, scenario: str, tmp: Path) -> dict:
    out = tmp / f"{scenario}.json"
    script, args = "vllm_runs.py", [scenario]
    if scenario.startswith("scheduler"):  # entropic's scheduler: its own script
        script, args = "sched_runs.py", scenario.split("-")[1:]
    proc = subprocess.run([vllm_python, str(ROOT / "tests_vllm" / script), *args, hf_dir,
                           str(out)], env=vllm_env(), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm_runs.py {scenario} failed ({proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def run_scenario(vllm_python, hf_dir, tmp_path_factory):
    cache: dict[str, dict] = {}
    tmp = tmp_path_factory.mktemp("vllm_runs")

    def get(scenario: str) -> dict:
        if scenario not in cache:
            cache[scenario] = _run(vllm_python, hf_dir, scenario, tmp)
        return cache[scenario]
    return get


@pytest.fixture(scope="session")
def reference(hf_dir):
    """entropic's own thermostat (its Sampler and Thermostat) over transformers' fp32 logits
    of the same weights, teacher-forced on a request's tokens: returns, per output token,
    the temperature it samples at and the model's entropy."""
    from transformers import AutoModelForCausalLM

    from entropic.control.thermostat import Thermostat
    from entropic.sampling.sampler import Sampler, SamplingBatch
    from entropic.sampling_params import SamplingParams, ThermostatParams

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def replay(prompt_ids: list[int], token_ids: list[int], thermostat: dict,
               temperature: float) -> tuple[list[float], list[float]]:
        ids = torch.tensor([prompt_ids + token_ids])
        n = len(prompt_ids)
        with torch.inference_mode():
            logits = model(ids).logits[0, n - 1:-1].float()
        params = SamplingParams(temperature=temperature, seed=0,
                                thermostat=ThermostatParams(**thermostat))
        sampler = Sampler([Thermostat()])
        temps, ents = [], []
        for i in range(len(token_ids)):
            batch = SamplingBatch(["r"], [params], [i])
            out = sampler(logits[i:i + 1].clone(), batch)
            temps.append(out.temperatures[0].item())
            ents.append(out.entropies[0].item())
        return temps, ents
    return replay
