"""DeepSpeed ZeRO-3 on CPU: step time with a gemini_dcp checkpoint every step (async) vs none vs DeepSpeed's own
``save_checkpoint`` to local disk every step, and the restore of each, in one launch.

``examples/deepspeed_resume.py`` runs under torchrun (2 ranks, gloo, CPU, ZeRO-3 fp32, an MLP 64→W→W→1 with
AdamW) with the configs ``3:fp32:none``, ``3:fp32:async`` (``use_gemini(engine, async_save=True)``, replicas=1,
node memory) and ``3:fp32:disk`` (DeepSpeed's ``TorchCheckpointEngine`` into a directory on local disk), one after
another, ``--rounds`` times (none, async, disk, none, async, disk, ...), so the three share the launch and its load.
A step's time (rank 0) includes its ``save_checkpoint``; the first ``--warmup`` steps of each config are left out;
figures are medians over the rounds. A second launch of the same configs with one more step measures the restore:
``engine.load_checkpoint`` from the tiers (node memory) and DeepSpeed's own load from disk (page cache warm: the
files were just written; the figure a software failure sees). Run it from the venv of scripts/deepspeed_venv.sh:

    flock /work/bench.lock env PYTHONPATH=$PWD $(bash scripts/deepspeed_venv.sh | tail -1) \\
        benchmarks/bench_deepspeed.py --steps 30 --rounds 2 --width 1024 --batch 512

Results: ``benchmarks/results/deepspeed.json`` (every step's seconds, the medians, the ratios, restores, load averages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine_info, shm_dir, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "deepspeed_resume.py"
MODES = ("none", "async", "disk")


def launch(args: argparse.Namespace, root: Path, out: Path, steps: int, timing: Path) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    configs = ",".join(f"3:fp32:{m}" for _ in range(args.rounds) for m in MODES)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(SCRIPT), "--job-id", "bench", "--configs", configs,
           "--steps", str(steps), "--width", str(args.width), "--batch", str(args.batch), "--node-root", str(root),
           "--ckpt-dir", str(out / "ckpt{node}"), "--timing-json", str(timing)]
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=3600, cwd=out)
    if proc.returncode:
        raise SystemExit(f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return dict(json.loads(timing.read_text()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "deepspeed.json"))
    args = p.parse_args()
    params = 64 * args.width + args.width + args.width * args.width + args.width + args.width + 1
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "params": params,
                               "state_mb_total": round(params * 4 * 3 / 1e6, 2)}  # fp32 weights + AdamW's two moments
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR")) as tmp:
        out = Path(tmp)
        root = shm_dir("bench_deepspeed_")
        before = loadavg()
        train = launch(args, root, out, args.steps, out / "train.json")
        mid = loadavg()
        restore = launch(args, root, out, args.steps + 1, out / "restore.json")
        results["loadavg"] = {"before": before, "between": mid, "after": loadavg()}
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    loads: dict[str, list[float]] = {m: [] for m in MODES}
    for name, times in train["step_seconds"].items():
        mode = name.split("-")[2]
        per_mode[mode] += [v for k, v in times.items() if int(k) > args.warmup]
    for name, seconds in restore["load_seconds"].items():
        loads[name.split("-")[2]].append(seconds)
    med = {m: statistics.median(v) for m, v in per_mode.items()}
    results.update({
        "step_seconds": train["step_seconds"],
        "median_step_s": med,
        "ratio_gemini_async_vs_none": med["async"] / med["none"],
        "ratio_deepspeed_disk_vs_none": med["disk"] / med["none"],
        "restore_seconds": {m: loads[m] for m in ("async", "disk")},
        "median_restore_s": {m: statistics.median(loads[m]) for m in ("async", "disk")},
    })
    print(f"ZeRO-3, {results['state_mb_total']} MB of state: none {med['none'] * 1e3:.1f} ms/step, gemini async "
          f"{med['async'] * 1e3:.1f} ms ({results['ratio_gemini_async_vs_none']:.3f}x), DeepSpeed to disk "
          f"{med['disk'] * 1e3:.1f} ms ({results['ratio_deepspeed_disk_vs_none']:.3f}x); restore: gemini "
          f"{results['median_restore_s']['async'] * 1e3:.0f} ms, DeepSpeed from disk "
          f"{results['median_restore_s']['disk'] * 1e3:.0f} ms (load {results['loadavg']})", flush=True)
    write_json(Path(args.out), results)


if __name__ == "__main__":
    main()
