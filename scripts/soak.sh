#!/usr/bin/env bash
# The feature soak (outside CI): random trials of tests/soak_trials.py, every feature drawn with a
# probability and combined freely, every fault (signals at every named phase, node wipes, flipped
# bytes, ENOSPC, stale locks), each a real multi-process job on simulated nodes. Trials accumulate
# into ONE file, benchmarks/results/soak.json (written atomically every few trials: a killed soak
# loses nothing); docs/reliability.md's table is made from it by scripts/soak_table.py.
#
#   scripts/soak.sh [TRIALS=1000] [SEED=$(date +%s)] [DEADLINE_UNIX=0]
#
# A long soak in the background, at the lowest priority:
#   PYTHONPATH=$PWD nohup nice -n 19 scripts/soak.sh 100000 > /tmp/soak.log 2>&1 &
# A failing trial is reproduced by its seed (in the file's "failures"):
#   PYTHONPATH=$PWD python tests/soak_trials.py --seed-only SEED
# (The older kill-at-a-phase harness alone: python tests/fault_harness.py --trials N --out FILE.)
# Exit status: 0 when every trial passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
TRIALS="${1:-1000}"
SEED="${2:-$(date +%s)}"
DEADLINE="${3:-0}"
echo "soak: ${TRIALS} trials, seed ${SEED} -> benchmarks/results/soak.json"
exec python tests/soak_trials.py --trials "${TRIALS}" --seed "${SEED}" --deadline "${DEADLINE}"
