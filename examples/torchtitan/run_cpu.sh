#!/usr/bin/env bash
# torchtitan's llama3 debugmodel on CPU (2 ranks, FSDP2 over gloo), checkpointing every step into
# gemini_dcp's memory tier beside torchtitan's own interval checkpoints.
#   bash examples/torchtitan/run_cpu.sh [OUT_DIR] [extra torchtitan flags...]
# Needs torchtitan 0.3.0 in the python that runs it (PYTHON=...; see README.md here). Environment knobs:
#   STEPS (10), INTERVAL (4: torchtitan's folder checkpoints), NPROC (2), MAX_RESTARTS (1),
#   SEQ_LEN (64) and LOCAL_BATCH (2): the training shape (the issue's reference setup is 256 x 2),
#   JOB_ID (titan-example: gemini_dcp's job id; torchrun --standalone makes a new run id per launch, so the
#   job id is set here for a relaunch to find its steps, as torchtitan finds its folder),
#   GEMINI_ASYNC (true: per-step saves through AsyncCheckpointer, overlapping the next step; false: blocking),
#   AC (default: torchtitan's own activation checkpointing, selective for llama3; none, full, selective: that mode),
#   PIN_CORES (1: each rank pinned to its own share of the CPUs, as CPU training is deployed; 0: unpinned),
#   TITAN_FAIL_AT_STEP / TITAN_FAIL_RANK / TITAN_DUMP_FINAL (launch.py), GEMINI_DCP_ROOT (tier root).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${1:-outputs/torchtitan}"; shift || true
mkdir -p "$OUT"
[ -f "$OUT/assets/tokenizer/tokenizer.json" ] || "$PYTHON" "$HERE/make_assets.py" "$OUT/assets" >/dev/null
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # restarted ranks must not read the dead attempt's store address
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TITAN_PIN_CORES="${PIN_CORES:-1}"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
  --max-restarts "${MAX_RESTARTS:-1}" --monitor-interval 0.1 \
  "$HERE/launch.py" --module llama3 --config llama3_debugmodel \
  --hf_assets_path "$OUT/assets/tokenizer" --dataloader.dataset_path "$OUT/assets/data" \
  --dump_folder "$OUT/dump" \
  --training.steps "${STEPS:-10}" --training.seq_len "${SEQ_LEN:-64}" --training.local_batch_size "${LOCAL_BATCH:-2}" \
  --training.disable_cuda_graphs --training.mixed_precision_param float32 \
  --parallelism.spmd_backend partial_dtensor --parallelism.data_parallel_shard_degree "${NPROC:-2}" \
  --comm.trace_buf_size 0 --validator.no-enable --debug.seed 0 \
  --checkpoint.enable --checkpoint.interval "${INTERVAL:-4}" --checkpoint.no-last-save-model-only \
  --override.imports "gemini_dcp.integrations.torchtitan.gemini_checkpoint={\"gemini_job_id\": \"${JOB_ID:-titan-example}\", \"gemini_async\": ${GEMINI_ASYNC:-true}}" \
  "$@" ${AC:+activation-checkpoint:$AC}
