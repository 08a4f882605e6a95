"""The entropy board, the entropy processor's batch bookkeeping and the scheduler's startup
checks, without a model (tests_vllm/scheduler_checks.py, run in the vLLM venv)."""
import subprocess
from pathlib import Path

from conftest import vllm_env


def test_board_processor_and_startup_checks(vllm_python):
    script = Path(__file__).with_name("scheduler_checks.py")
    proc = subprocess.run([vllm_python, str(script)], env=vllm_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        proc.stdout[-2000:] + proc.stderr[-2000:]
