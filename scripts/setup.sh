#!/usr/bin/env bash
# One-time setup: a virtual environment in .venv with omnistage installed (editable) and the
# test tools. On a machine without a GPU, torch comes from the local CPU build (torch==2.13.0)
# first, so no multi-GB CUDA wheel is ever downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
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
$PY -m pip install -q -e ".[test,ray]"
