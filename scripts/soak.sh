#!/usr/bin/env bash
# Fault-injection soak (outside CI): N random trials of tests/fault_harness.py, each a real
# multi-process job on simulated nodes killed at a named phase (or a random one) and restarted.
#
#   scripts/soak.sh [TRIALS=1000] [SEED=$(date +%s)] [DEADLINE_UNIX=0]
#
# Writes benchmarks/results/soak-<UTC date>.json: counts per (kind, phase, signal, outcome),
# the failures, and every trial's record (seed, phase, signal, rank, nodes wiped, outcome,
# restored step, duration). A trial is reproduced by its seed:
#   python -c 'import sys; sys.path.insert(0,"tests"); import fault_harness as h; print(h.run_trial(h.random_trial(SEED)))'
# Exit status: 0 when every trial passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
TRIALS="${1:-1000}"
SEED="${2:-$(date +%s)}"
DEADLINE="${3:-0}"
OUT="benchmarks/results/soak-$(date -u +%Y-%m-%d).json"
echo "soak: ${TRIALS} trials, seed ${SEED} -> ${OUT}"
exec python tests/fault_harness.py --trials "${TRIALS}" --seed "${SEED}" --deadline "${DEADLINE}" --out "${OUT}"
