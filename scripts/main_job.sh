#!/usr/bin/env bash
# README command 1: install (if needed), then the main job on CPU.
#
# torchrun starts 2 ranks training a small transformer LM under FSDP2 (gloo), checkpointing
# EVERY step into node memory with gemini_dcp. At step 6 rank 1 is SIGKILLed (first attempt
# only); torchrun restarts the worker group, which resumes from the local memory tier and
# prints e.g.  "resumed from step 5 (tier: local, 10.0 MiB) in 1.29 s (reading the tiers 0.09 s, ...)", then finishes.
#
# Extra arguments go to examples/train_fsdp2.py (e.g. --steps 30 --fail-at-step 17).
# Env: GEMINI_DCP_ROOT (tier root, default /dev/shm/gemini_dcp), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python}

export GEMINI_DCP_ROOT=${GEMINI_DCP_ROOT:-/dev/shm/gemini_dcp}
mkdir -p "$GEMINI_DCP_ROOT" && chmod 700 "$GEMINI_DCP_ROOT"
# torchrun keeps its rendezvous store across restarts without a per-attempt key prefix, so a
# restarted worker can read a dead worker's gloo address and the restart fails or hangs:
# give every restart a fresh store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1

LOG=$(mktemp -t gemini_main_job.XXXXXX.log)
echo "== main job: torchrun --standalone --nproc-per-node 2 --max-restarts 2 examples/train_fsdp2.py (tier root $GEMINI_DCP_ROOT)"
set +e
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 2 --monitor-interval 0.1 \
  examples/train_fsdp2.py --steps 12 --fail-at-step 6 --ckpt-every 1 --cleanup --print-params-hash "$@" 2>&1 \
  | grep --line-buffered -v -E '^W[0-9]{4} .*(\*{10}|OMP_NUM_THREADS|run.py:[0-9]+\] *$)' | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e

echo
echo "== summary"
grep -E "injected failure|resumed from step|final params" "$LOG" || true
tail_loss=$(grep -E "^step +[0-9]+ +loss" "$LOG" | tail -1 || true)
[ -n "$tail_loss" ] && echo "last: $tail_loss"
if [ "$rc" -ne 0 ]; then
  echo "main job FAILED (torchrun exit $rc); log: $LOG" >&2
  exit "$rc"
fi
if ! grep -q "resumed from step" "$LOG"; then
  echo "main job finished but never resumed from a checkpoint; log: $LOG" >&2
  exit 1
fi
echo "main job OK (log: $LOG)"
