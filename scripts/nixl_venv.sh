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
# The wheel's module is nixl_cu12 (or nixl_cu13); the "nixl" meta package is optional
# (gemini_dcp.transport.nixl.NIXL_MODULES: the first that imports with nixl_agent).
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("nixl", "nixl_cu12", "nixl_cu13"):
    try:
        mod = importlib.import_module(name)
    except ImportError:
        continue
    if hasattr(mod, "nixl_agent"):
        print("nixl ok:", name, mod.__file__)
        break
else:
    raise SystemExit("NIXL did not install: none of nixl, nixl_cu12, nixl_cu13 imports with nixl_agent")
PY
