"""Step time of the Lightning and Accelerate examples with a gemini_dcp checkpoint every step vs none, in one run.

Each example runs under torchrun (2 ranks, CPU, gloo) with ``--save-blocks B``: gemini_dcp saves the state after
steps 1..B, 2B+1..3B, ... and not after B+1..2B, ...; a step's time (rank 0) includes its save. The figure is the
median time of the steps that save against the median of those that do not, in the same run and so under the
same load (the first block, warm-up, is left out). Run it from the venv of scripts/integrations_venv.sh:

    flock /work/bench.lock env PYTHONPATH=$PWD $(bash scripts/integrations_venv.sh | tail -1) \\
        benchmarks/bench_integrations.py --steps 48 --blocks 4 --width 4096 --batch 2048

Results: ``benchmarks/results/integrations.json`` (every step's seconds, the medians, the ratio, load averages).
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
EXAMPLES = {"lightning": "examples/lightning_resume.py", "accelerate": "examples/accelerate_resume.py",
            "accelerate-async": "examples/accelerate_resume.py"}  # the last: async_save=True (AsyncCheckpointer)


def run(name: str, args: argparse.Namespace, root: Path, out: Path) -> dict[str, Any]:
    timing = out / f"{name}.json"
    env = dict(os.environ, GEMINI_DCP_ROOT=str(root), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(REPO / EXAMPLES[name]), "--job-id", f"bench-{name}",
           "--steps", str(args.steps), "--save-blocks", str(args.blocks), "--width", str(args.width),
           "--batch", str(args.batch), "--timing-json", str(timing)]
    if name == "accelerate-async":
        cmd.append("--async-save")
    if name == "lightning":
        # one epoch for the whole run: the loader's iterator (and its worker) is built once, not every 4 steps
        cmd += ["--folder", str(out / "folder"), "--folder-every", str(10 * args.steps), "--epoch-steps", str(args.steps)]
    before = loadavg()
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=1800, cwd=out)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    times = {int(k): v for k, v in json.loads(timing.read_text())["step_seconds"].items()}
    b = args.blocks
    saving = {k: v for k, v in times.items() if k > 2 * b and (k - 1) // b % 2 == 0}
    plain = {k: v for k, v in times.items() if k > 2 * b and (k - 1) // b % 2 == 1}
    med_s, med_p = statistics.median(saving.values()), statistics.median(plain.values())
    return {"step_seconds": times, "median_with_checkpoint_s": med_s, "median_without_s": med_p,
            "ratio": med_s / med_p, "steps_with": len(saving), "steps_without": len(plain),
            "loadavg_before": before, "loadavg_after": loadavg()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--only", choices=sorted(EXAMPLES), nargs="*", default=["lightning", "accelerate"])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "integrations.json"))
    args = p.parse_args()
    state_mb = (65 * args.width + 1) * 4 * 3 / 1e6  # parameters + AdamW's two moments, float32
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "state_mb_total": round(state_mb, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            root = shm_dir(f"bench_{name}_")
            r = run(name, args, root, Path(tmp))
            results[name] = r
            print(f"{name}: {r['median_without_s'] * 1e3:.1f} ms/step without a checkpoint, "
                  f"{r['median_with_checkpoint_s'] * 1e3:.1f} ms with one every step: {r['ratio']:.2f}x "
                  f"(load {r['loadavg_before']} -> {r['loadavg_after']})", flush=True)
    write_json(Path(args.out), results)


if __name__ == "__main__":
    main()
