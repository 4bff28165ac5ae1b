#!/usr/bin/env bash
# Try gemini_dcp on another torch release, installed the way a user would install it:
#
#   bash scripts/compat.sh 2.15.0 [pytest args...]
#
# 1. a venv of its own (${GEMINI_DCP_VENVS:-~/.cache/gemini_dcp/venvs}/torch-<version>, reused when present)
#    with torch==<version> (from the index: for 2.15.0 the CUDA build, ~3 GB; it runs on CPU);
# 2. `pip install -e ".[test]"` with torch held at <version> by a constraints file given in
#    PIP_CONSTRAINT: it replaces, for these installs only, any global constraints file of the machine
#    (pip.conf's `constraint`, e.g. one capping torch); the machine's file is left as it is;
# 3. scripts/install.sh: torchrec's known-good pairing for this torch where one exists (else the
#    torchrec tests skip), the C++ extension;
# 4. `gemini-dcp doctor` (its torch check must pass), then the whole suite; prints the counts.
# Record the result in docs/compat.md. CI stays on the pinned stack (scripts/test.sh).
# Exit status: the suite's (1 if the install, the torch hold or doctor's torch check failed).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ ! "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: bash scripts/compat.sh TORCH_VERSION [pytest args...]   (e.g. 2.15.0)" >&2
  exit 2
fi
VER=$1
shift
BASE_PY=${PYTHON:-python3}
# The supported range is pyproject.toml's (read by gemini_dcp/core/torch_support.py, which needs no torch).
"$BASE_PY" gemini_dcp/core/torch_support.py check "$VER" || exit 1
VENV=${GEMINI_DCP_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/gemini_dcp/venvs}/torch-$VER
PY=$VENV/bin/python
LOG=$VENV/compat-$(date -u +%Y%m%dT%H%M%SZ).log
say() { echo "compat.sh [torch $VER]: $*" >&2; }
[ -x "$PY" ] || { say "creating $VENV"; "$BASE_PY" -m venv "$VENV"; }
CONSTRAINTS=$VENV/gemini-dcp-constraints.txt
echo "torch==$VER" >"$CONSTRAINTS"
export PIP_CONSTRAINT=$CONSTRAINTS PIP_DISABLE_PIP_VERSION_CHECK=1
torch_ver() { "$PY" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])' 2>/dev/null || true; }
if [ "$(torch_ver)" != "$VER" ]; then
  say "installing torch==$VER (this can take minutes)"
  "$PY" -m pip install -q "torch==$VER"
fi
say "pip install -e \".[test]\" (torch held at $VER by $CONSTRAINTS)"
"$PY" -m pip install -q -e ".[test]"
if [ "$(torch_ver)" != "$VER" ]; then
  say "FAIL: installing the project changed torch to $(torch_ver)"
  exit 1
fi
say "torch is still $VER after installing the project"
PYTHON=$PY bash scripts/install.sh
# doctor exits 1 for host findings (e.g. a tier root on disk); only its torch line decides here.
DOCTOR_JSON=$(cd / && "$VENV/bin/gemini-dcp" doctor --json || true)
"$PY" - "$DOCTOR_JSON" <<'PYEOF' || { say "FAIL: doctor's torch check did not pass"; exit 1; }
import json, sys
checks = {c["name"]: c for c in json.loads(sys.argv[1])["checks"]}
for name in ("torch", "torchrec"):
    c = checks.get(name)
    if c:
        print(f"doctor: {name}: {c['status'].upper()} {c['detail']}", file=sys.stderr)
sys.exit(0 if checks.get("torch", {}).get("status") == "pass" else 1)
PYEOF
say "running the suite (log: $LOG)"
set +e
"$PY" -m pytest -q -p no:cacheprovider --timeout=900 -rs "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
COUNTS=$(grep -E '^=* ?[0-9]+ (passed|failed|errors?|skipped|deselected).* in [0-9.]+s' "$LOG" | tail -1 | sed -E 's/^=+ //; s/ =+$//' || true)
say "torch $("$PY" -c 'import torch; print(torch.__version__)'), Python $("$PY" -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d): ${COUNTS:-no pytest summary} (exit $rc)"
if [ "$rc" -eq 5 ]; then say "pytest collected no tests: failing"; exit 1; fi
exit "$rc"
