"""The pruning backend's block-table trimming and its processor, without a model
(tests_vllm/pruning_checks.py, run in the vLLM venv): vLLM's own CPU kernel over the trimmed
tables against fp64 attention over the kept tokens, untouched rows bit-identical, the kept
blocks against bounds taken from the keys, stale bounds voided by writes, validation."""
import subprocess
from pathlib import Path

from conftest import vllm_env


def test_block_table_trimming(vllm_python):
    script = Path(__file__).with_name("pruning_checks.py")
    proc = subprocess.run([vllm_python, str(script)], env=vllm_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        proc.stdout[-2000:] + proc.stderr[-2000:]
