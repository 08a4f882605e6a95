"""The processor's batch bookkeeping without a model (tests_vllm/processor_checks.py, run in
the vLLM venv): moves, swaps, removal and re-admission with the same SamplingParams, a
thrown-away step, an untouched plain row, state freed with its request, validation."""
import subprocess
from pathlib import Path

from conftest import vllm_env


def test_batch_bookkeeping(vllm_python):
    script = Path(__file__).with_name("processor_checks.py")
    proc = subprocess.run([vllm_python, str(script)], env=vllm_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        proc.stdout[-2000:] + proc.stderr[-2000:]
