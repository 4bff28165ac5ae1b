#!/usr/bin/env bash
# The NIXL lane (issue 43): build the NIXL venv (scripts/nixl_venv.sh, beside the system torch)
# and run the peer tier's NIXL tests in it, over UCX sm,tcp and tcp on loopback. The default
# lane (scripts/test.sh) runs the same file without NIXL: its NIXL tests skip there.
# Usage: scripts/test_nixl.sh [VENV_DIR] [pytest args...]   (default /work/venvs/nixl)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/work/venvs/nixl}
shift || true
bash scripts/nixl_venv.sh "$VENV"
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout=900 tests/test_nixl_transport.py "$@"
