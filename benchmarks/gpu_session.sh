#!/usr/bin/env bash
# The GPU figures (issues 20 and 40) in one prepared run on a lent GPU machine (the device tool): build the
# extension, run the GPU tests, then the benchmarks, each stage bounded, logs and results to $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_session.sh [stages]   (stages: info build tests save async recovery nan)
# Sizing (2026-11-27, H200): build 25-34 s, tests 14-16 s, save 63-72 s, recovery 70 s, nan ~95 s, async
# ~150 s; a machine's start ~30-60 s. One device call runs at most 600 s: pick the stages to fit.
# Expects python3 with torch (CUDA) and nvcc. The GPU machine has no package index: put a crc32c wheel
# for its Python in .whl/ (ignored by git; pass carry=[".whl"] to the device tool), installed to /tmp/site.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
RES=/tmp/gpu-results  # everything goes here; packed into $OUT/results.tgz after each stage (the device tool
mkdir -p "$RES"       # brings back at most 8 files)
STAGES=${1:-"info build tests save async recovery nan"}
# The results' tag names the card that ran them (h100, h200, ...): the device tool lends either.
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h[0-9]+|a[0-9]+|b[0-9]+' | head -1 | tr 'A-Z' 'a-z')}
TAG=${TAG:-gpu}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export GEMINI_DCP_EXT_CACHE=${GEMINI_DCP_EXT_CACHE:-/tmp/gext}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# The memory tier wants a large tmpfs: /dev/shm in a container is often 64 MiB.
TIER=/dev/shm
if [ "$(df -k --output=size /dev/shm 2>/dev/null | tail -1)" -lt $((24 * 1024 * 1024)) ] 2>/dev/null; then
  mount -o remount,size=48g /dev/shm 2>/dev/null ||
    { mkdir -p /mnt/gtier && (mountpoint -q /mnt/gtier || mount -t tmpfs -o size=48g tmpfs /mnt/gtier) && TIER=/mnt/gtier; }
fi
stage() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s) $(date +%T)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n 25 "$RES/$name.log"
  [ -f "$RES/trace.json" ] && gzip -f "$RES/trace.json"
  cp benchmarks/results/recovery-"$TAG".json benchmarks/results/recovery-nan-"$TAG".json docs/img/recovery-"$TAG".png "$RES/" 2>/dev/null
  tar czf "$OUT/results.tgz" -C "$RES" .
}
stage info 60 bash -c "nvidia-smi; python3 -c 'import torch,sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; nvcc --version | tail -2; nproc; free -g; df -h /dev/shm $TIER; ulimit -l"
stage build 200 python3 -m gemini_dcp.ext.build --cuda required
stage tests 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_ext_gpu.py tests/test_device_copy.py tests/test_device_land.py tests/test_ext.py
stage save 150 python3 benchmarks/bench_gpu_save.py --gib 2 --rounds 5 --root "$TIER" --tag "$TAG" --json "$RES/gpu-save-$TAG.json" --png "$RES/bench_gpu_save.png"
stage async 240 python3 benchmarks/bench_async.py --device cuda --world 1 --model transformer --width 1536 --heads 16 \
  --seq 2048 --batch 8 --layers 4 --accum 4 --bf16 --steps 19 --skip 2 --rounds 3 --modes gemini stock \
  --shm "$TIER" --trace "$RES/trace.json" --json "$RES/async-gpu-$TAG.json" --png "$RES/async_gpu_steps.png"
stage recovery 220 python3 benchmarks/bench_recovery.py --tag "$TAG" --nproc 1 --scenarios software --no-doc --disk-dir /tmp
stage nan 120 python3 benchmarks/bench_recovery.py --tag "$TAG" --nproc 1 --scenarios nan --no-doc
ls -la "$RES" "$OUT"
