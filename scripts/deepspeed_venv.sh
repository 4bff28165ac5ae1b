#!/usr/bin/env bash
# The venv in which the DeepSpeed integration tests and benchmark run:
#
#   bash scripts/deepspeed_venv.sh             # prints the venv's python on its last line
#   $(bash scripts/deepspeed_venv.sh | tail -1) -m pytest tests/test_deepspeed.py tests/test_deepspeed_e2e.py
#
# A venv of its own (as the Lightning / Accelerate one), ${GEMINI_DCP_VENVS:-~/.cache/gemini_dcp/venvs}/deepspeed,
# made with --system-site-packages so that it reuses the torch (and gemini_dcp, pytest) of the python that
# builds it; deepspeed is installed with that torch held by a constraints file, so pip never replaces it
# (never pulls a CUDA build). `pip install deepspeed` builds a pure-Python wheel from the sdist without CUDA;
# on its first distributed init DeepSpeed JIT-compiles one C++ op (deepspeed_shm_comm) into the torch
# extensions cache, once per machine. Reused when present. The tests skip where deepspeed is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY=${PYTHON:-python3}
DEEPSPEED=${GEMINI_DCP_DEEPSPEED:-0.19.8}
VENV=${GEMINI_DCP_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/gemini_dcp/venvs}/deepspeed
PY=$VENV/bin/python
say() { echo "deepspeed_venv.sh: $*" >&2; }
TORCH=$("$BASE_PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
[ -x "$PY" ] || { say "creating $VENV (system site packages: torch $TORCH)"; "$BASE_PY" -m venv --system-site-packages "$VENV"; }
CONSTRAINTS=$VENV/constraints.txt
echo "torch==$TORCH" >"$CONSTRAINTS"
export PIP_CONSTRAINT=$CONSTRAINTS PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$DEEPSPEED')" 2>/dev/null; then
  say "installing deepspeed==$DEEPSPEED (torch held at $TORCH)"
  "$PY" -m pip install -q "deepspeed==$DEEPSPEED"
fi
after=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
if [ "$after" != "$TORCH" ]; then
  say "FAIL: torch changed from $TORCH to $after"
  exit 1
fi
"$PY" -m pip check >&2 || say "pip check reports conflicts (above)"
echo "$PY"
