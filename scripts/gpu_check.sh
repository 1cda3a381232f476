#!/usr/bin/env bash
# Engine checks of obcache-vllm on FLASH_ATTN with vLLM 0.32's CUDA build: one summary table,
# exit status 1 on a failed check. NOT run by the project yet (see docs/user_guide/gpus.md).
#
# Installs nothing. Needs: a CUDA GPU, a Python with vllm==0.32.0 (CUDA build) and this source
# tree's dependencies (pip install -e '.[cuda]'), the converted default model
# (`obcache-vllm model pull`) or --model DIR. Takes roughly 5-15 minutes (several engine starts).
#   bash scripts/gpu_check.sh [--model DIR] [--skip-tp] [--tp-model DIR] [--keep DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
case " $* " in *" --cpu-dry-run "*) WANT_GPU=0 ;; *) WANT_GPU=1 ;; esac
WANT_GPU=$WANT_GPU "$PYTHON" - <<'PY'
import os, sys
try:
    import torch, vllm
except ImportError as exc:
    sys.exit(f"gpu_check: {exc}: needs vLLM 0.32.0 (CUDA build) in this Python")
gpu = os.environ["WANT_GPU"] == "1"
if vllm.__version__ != "0.32.0" or (gpu and not torch.cuda.is_available()):
    sys.exit(f"gpu_check: needs vLLM 0.32.0 and a CUDA GPU (vllm {vllm.__version__}, "
             f"cuda available: {torch.cuda.is_available()})")
PY
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_check.py "$@"
