#!/usr/bin/env bash
# What a bare GPU machine can check without vLLM: FlashAttention-layout gather/scatter and the
# in-place read shift on CUDA tensors, the scorers against fp64 on CPU, the scorers' cost against
# an SDPA prefill at 4K-32K tokens. Prints one table; exit status 1 on a failed row.
#
# Needs: python3 with torch (CUDA build); imports only torch and this tree; installs nothing, no
# network. Run from anywhere:  bash scripts/gpu_kernels_check.sh [--device cpu --tokens 512 ...]
# Bounded to 8 minutes (the table of a run cut short is not printed: rerun with fewer --tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$PYTHON" -c "import torch" 2>/dev/null || { echo "gpu_kernels_check: no torch in $PYTHON (set PYTHON=...)"; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$PYTHON" scripts/gpu_kernels_check.py "$@"
