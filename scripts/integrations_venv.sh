#!/usr/bin/env bash
# The venv in which the Lightning and Accelerate integration tests run:
#
#   bash scripts/integrations_venv.sh          # prints the venv's python on its last line
#   $(bash scripts/integrations_venv.sh | tail -1) -m pytest tests/test_lightning_e2e.py tests/test_accelerate_e2e.py
#
# A venv of its own (as torchtitan's), ${GEMINI_DCP_VENVS:-~/.cache/gemini_dcp/venvs}/integrations, made with
# --system-site-packages so that it reuses the torch (and gemini_dcp, pytest) of the python that builds it;
# lightning, accelerate and torchdata (its StatefulDataLoader: the Lightning e2e test's stateful loader) are
# installed with that torch held by a constraints file, so pip never replaces it (never pulls a CUDA build).
# Reused when present. The tests skip where lightning / accelerate / torchdata are absent.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY=${PYTHON:-python3}
LIGHTNING=${GEMINI_DCP_LIGHTNING:-2.6.6}
ACCELERATE=${GEMINI_DCP_ACCELERATE:-1.15.0}
TORCHDATA=${GEMINI_DCP_TORCHDATA:-0.11.0}
VENV=${GEMINI_DCP_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/gemini_dcp/venvs}/integrations
PY=$VENV/bin/python
say() { echo "integrations_venv.sh: $*" >&2; }
TORCH=$("$BASE_PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
[ -x "$PY" ] || { say "creating $VENV (system site packages: torch $TORCH)"; "$BASE_PY" -m venv --system-site-packages "$VENV"; }
CONSTRAINTS=$VENV/constraints.txt
echo "torch==$TORCH" >"$CONSTRAINTS"
export PIP_CONSTRAINT=$CONSTRAINTS PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('lightning') != '$LIGHTNING' or m.version('accelerate') != '$ACCELERATE' or m.version('torchdata') != '$TORCHDATA')" 2>/dev/null; then
  say "installing lightning==$LIGHTNING accelerate==$ACCELERATE torchdata==$TORCHDATA (torch held at $TORCH)"
  "$PY" -m pip install -q "lightning==$LIGHTNING" "accelerate==$ACCELERATE" "torchdata==$TORCHDATA"
fi
after=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
if [ "$after" != "$TORCH" ]; then
  say "FAIL: torch changed from $TORCH to $after"
  exit 1
fi
"$PY" -m pip check >&2 || say "pip check reports conflicts (above)"
echo "$PY"
