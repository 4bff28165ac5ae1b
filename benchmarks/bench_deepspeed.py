"""DeepSpeed ZeRO-3 on CPU: step time with a gemini_dcp checkpoint every step (async) vs none, and DeepSpeed's
own ``save_checkpoint`` to local disk every step vs none, each in one run; and the restore of each.

``examples/deepspeed_resume.py`` runs under torchrun (2 ranks, gloo, CPU, ZeRO-3 fp32, an MLP 64→W→W→1 with
AdamW) with the configs ``3:fp32:async`` (``use_gemini(engine, async_save=True)``, replicas=1, node memory) and
``3:fp32:disk`` (DeepSpeed's ``TorchCheckpointEngine`` into one directory on local disk, shared by the ranks),
one after the other, ``--rounds`` times, with ``--save-blocks B``: each config checkpoints after steps 1..B,
2B+1..3B, ... and not after B+1..2B, ...; a step's time (rank 0) includes its ``save_checkpoint``. Each ratio is
the median step of the blocks that save against the median of those that do not (their first step left out: an
async copy of the block before may still run in it), in the same config and so under the same load; the first
two blocks are warm-up. Also recorded: the seconds inside ``save_checkpoint`` and inside the
``GeminiCheckpointEngine`` (gemini_dcp's part; the rest is DeepSpeed's own barriers and tag check). A second
launch of the same configs with one more step measures the restore: ``engine.load_checkpoint`` from the tiers
(node memory) and DeepSpeed's own load from disk (page cache warm: the files were just written; what a software
failure sees). Run it from the venv of scripts/deepspeed_venv.sh:

    flock /work/bench.lock env PYTHONPATH=$PWD $(bash scripts/deepspeed_venv.sh | tail -1) \\
        benchmarks/bench_deepspeed.py --steps 48 --blocks 4 --rounds 2 --width 1024 --batch 512

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
MODES = ("async", "disk")


def launch(args: argparse.Namespace, root: Path, out: Path, steps: int, timing: Path) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    configs = ",".join(f"3:fp32:{m}" for _ in range(args.rounds) for m in MODES)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(SCRIPT), "--job-id", "bench", "--configs", configs,
           "--steps", str(steps), "--width", str(args.width), "--batch", str(args.batch), "--node-root", str(root),
           "--ckpt-dir", str(out / "ckpt"), "--timing-json", str(timing),
           "--save-blocks", str(args.blocks)]
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=3600, cwd=out)
    if proc.returncode:
        raise SystemExit(f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return dict(json.loads(timing.read_text()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
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
    b = args.blocks
    with_save: dict[str, list[float]] = {m: [] for m in MODES}
    without: dict[str, list[float]] = {m: [] for m in MODES}
    in_save: dict[str, list[float]] = {m: [] for m in MODES}
    in_engine: list[float] = []
    for name, times in train["step_seconds"].items():
        mode = name.split("-")[2]
        for k, v in times.items():
            step = int(k)
            if step <= 2 * b:
                continue
            if (step - 1) // b % 2 == 0:
                with_save[mode].append(v)
                in_save[mode].append(train["save_seconds"][name][k])
            elif (step - 1) % b:
                without[mode].append(v)
    for name, times in train["engine_seconds"].items():
        in_engine += [v for k, v in times.items() if int(k) > 2 * b]
    loads: dict[str, list[float]] = {m: [] for m in MODES}
    for name, seconds in restore["load_seconds"].items():
        loads[name.split("-")[2]].append(seconds)
    med = {m: {"with_checkpoint_s": statistics.median(with_save[m]), "without_s": statistics.median(without[m]),
               "ratio": statistics.median(with_save[m]) / statistics.median(without[m]),
               "inside_save_checkpoint_s": statistics.median(in_save[m]),
               "steps_with": len(with_save[m]), "steps_without": len(without[m])} for m in MODES}
    results.update({
        "train": train,
        "gemini_async": med["async"],
        "deepspeed_disk": med["disk"],
        "inside_gemini_engine_s": statistics.median(in_engine),
        "restore_seconds": loads,
        "median_restore_s": {m: statistics.median(loads[m]) for m in MODES},
    })
    for m, what in (("async", "gemini_dcp async"), ("disk", "DeepSpeed to disk")):
        r = med[m]
        print(f"{what}: {r['without_s'] * 1e3:.1f} ms/step without a checkpoint, {r['with_checkpoint_s'] * 1e3:.1f} ms "
              f"with one every step: {r['ratio']:.3f}x (inside save_checkpoint {r['inside_save_checkpoint_s'] * 1e3:.2f} "
              f"ms); restore {results['median_restore_s'][m] * 1e3:.0f} ms", flush=True)
    print(f"inside GeminiCheckpointEngine: {results['inside_gemini_engine_s'] * 1e3:.2f} ms per checkpoint; "
          f"load {results['loadavg']}", flush=True)
    write_json(Path(args.out), results)


if __name__ == "__main__":
    main()
