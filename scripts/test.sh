#!/usr/bin/env bash
# README command 2: install everything, lint and type-check, then run the whole test suite
# (CPU; GPU tests skip without CUDA). Extra arguments go to pytest, e.g. `-m "not slow"` for
# the fast lane (docs/contributing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python}
echo "ruff check gemini_dcp cli" >&2
"$PY" -m ruff check gemini_dcp cli || { echo "ruff found problems (see above): failing" >&2; exit 1; }
echo "mypy gemini_dcp" >&2
"$PY" -m mypy gemini_dcp || { echo "mypy found problems (see above): failing" >&2; exit 1; }
set +e
"$PY" -m pytest -q -p no:cacheprovider --timeout=900 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
