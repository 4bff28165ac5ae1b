#!/usr/bin/env bash
# Build a venv with NIXL (UCX backend) beside the system's torch, without replacing it.
# `pip install nixl-cu12` alone pulls a CUDA torch (several GB) although NIXL never imports
# torch: install it with --no-deps plus the one runtime dependency it imports (numpy).
# Usage: scripts/nixl_venv.sh [VENV_DIR]   (default /work/venvs/nixl; GEMINI_DCP_NIXL=<spec> overrides the pin)
set -euo pipefail
VENV=${1:-/work/venvs/nixl}
SPEC=${GEMINI_DCP_NIXL:-nixl-cu12==1.5.1}
PY=${PYTHON:-python}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps "$SPEC" numpy
"$VENV/bin/python" -c 'import nixl._api as n; print("nixl ok:", n.__file__)'
