#!/usr/bin/env bash
# The feature soak (outside CI): random trials of tests/soak_trials.py, every feature drawn with a
# probability and combined freely, every fault (signals at every named phase, node wipes, flipped
# bytes, ENOSPC, stale locks), each a real multi-process job on simulated nodes. Trials accumulate
# into ONE file, benchmarks/results/soak.json (written atomically under a lock every few trials: a
# killed soak loses nothing); docs/reliability.md's table is made from it by scripts/soak_table.py.
#
#   scripts/soak.sh [TRIALS=1000] [SEED=$(date +%s)] [DEADLINE_UNIX=0]
#
# SOAK_WORKERS=N (default 1) runs N soaks side by side, each TRIALS trials from its own seed, into the
# same file. A trial mostly waits (deadlines of stopped peers, drain processes importing torch), so
# 3-4 workers on 2 cores multiply the trials per hour. SOAK_PAUSE_FILE=PATH: while PATH exists no
# worker starts a trial (touch it to borrow a quiet machine for a benchmark, remove it to go on).
#
# A long soak in the background (at the default priority: at nice 19 beside busy work its ranks
# starve past the trials' 20 s deadlines, and the raw gloo timeouts that follow read as failures):
#   SOAK_WORKERS=3 PYTHONPATH=$PWD setsid nohup scripts/soak.sh 100000 > /tmp/soak.log 2>&1 &
# A failing trial is reproduced by its seed (in the file's "failures"):
#   PYTHONPATH=$PWD python tests/soak_trials.py --seed-only SEED
# (The older kill-at-a-phase harness alone: python tests/fault_harness.py --trials N --out FILE.)
# Exit status: 0 when every trial passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
TRIALS="${1:-1000}"
SEED="${2:-$(date +%s)}"
DEADLINE="${3:-0}"
WORKERS="${SOAK_WORKERS:-1}"
PAUSE="${SOAK_PAUSE_FILE:-}"
# bytecode on: a drain process imports gemini_dcp afresh (from source on every start without it)
unset PYTHONDONTWRITEBYTECODE
# started by -c, not as a script: a forkserver child runs a script's whole body again (__mp_main__)
soak() { python -c 'import sys; sys.path.insert(0, "tests"); import soak_trials; raise SystemExit(soak_trials.main())' "$@"; }
echo "soak: ${WORKERS} x ${TRIALS} trials, seed ${SEED} -> benchmarks/results/soak.json"
pids=()
for k in $(seq 0 $((WORKERS - 1))); do
  # seeds base*1_000_003 + i: bases a prime apart never reach each other's trials
  soak --trials "${TRIALS}" --seed "$((SEED + 7919 * k))" --deadline "${DEADLINE}" \
    --pause-file "${PAUSE}" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit "${rc}"
