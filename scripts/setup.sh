#!/usr/bin/env bash
# One-time setup: a virtual environment in .venv with omnistage installed (editable).
#
#   scripts/setup.sh          what serving needs, nothing more (`omnistage serve`, `Omni(...)`)
#   scripts/setup.sh --test   that, plus the test toolchain: the test extras, Ray, headless
#                             Chromium and its driver (apt), and .venv-ref (the Qwen3-TTS
#                             reference); what CI runs before the tests
#
# On a machine without a GPU, torch comes from the local CPU build (torch==2.13.0) first, so
# no multi-GB CUDA wheel is ever downloaded. Running it again installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "") WITH_TESTS=0 ;;
    --test) WITH_TESTS=1 ;;
    *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
PY=.venv/bin/python
if ! $PY -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        $PY -m pip install -q torch
    else
        $PY -m pip install -q torch==2.13.0
    fi
fi
if [ "$WITH_TESTS" = 0 ]; then
    $PY -m pip install -q -e .
    exit 0
fi
$PY -m pip install -q -e ".[test,ray]"

# The playground's browser test (tests/system/entrypoints/openai/test_playground_browser.py): headless
# Chromium and its driver from Debian's packages (selenium comes with the test extras), as root
# or through passwordless sudo. Where neither can install them the test skips naming what is
# missing, so a failed install warns and goes on.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        AS_ROOT=""
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        AS_ROOT="sudo -n"
    else
        AS_ROOT="none"
    fi
    if [ "$AS_ROOT" != none ] && command -v apt-get >/dev/null 2>&1; then
        APT="$AS_ROOT env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=300"
        { $APT update && $APT install -y chromium chromium-driver; } >/dev/null \
            || echo "setup.sh: chromium / chromium-driver not installed; the browser test skips" >&2
    else
        echo "setup.sh: no apt-get as root here: chromium / chromium-driver not installed;" \
             "the browser test skips" >&2
    fi
fi

# The reference environment of the Qwen3-TTS golden tests (tests/models/qwen3_tts): the
# `qwen-tts` package pins transformers 4.57.3, which cannot share .venv with ours, so it gets
# its own, run by subprocess. Only what its 12 Hz models import (not its demo's gradio, nor
# the 25 Hz tokenizer's sox / onnxruntime / torchaudio); torch is the local CPU build. Skipped
# when present, and on GPU machines (no CUDA torch is downloaded for it); the tests then skip.
if ! command -v nvidia-smi >/dev/null 2>&1 \
        && ! .venv-ref/bin/python -c "import importlib.metadata as m, librosa, einops
m.version('qwen-tts'); assert m.version('transformers') == '4.57.3'" 2>/dev/null; then
    python3 -m venv .venv-ref
    .venv-ref/bin/python -m pip install -q torch==2.13.0 transformers==4.57.3 accelerate==1.12.0 \
        librosa soundfile einops
    .venv-ref/bin/python -m pip install -q --no-deps qwen-tts==0.1.1
fi
