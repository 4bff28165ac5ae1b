"""Step time of torchtitan's trainer with a checkpoint every step: gemini_dcp (blocking / AsyncCheckpointer)
against torchtitan's own DCP checkpoints (sync / ``async``) and no checkpoint, measured in the same run.

Runs ``examples/torchtitan/run_cpu.sh`` (llama3 debugmodel on CPU, 2 ranks, FSDP2 over gloo, seq 256 x batch 2
by default — the issue's reference setup —; 80 MB of model + optimizer state in all) once per variant and reads the time between consecutive
``step:`` log lines — one iteration: the previous step's checkpoint save plus this step's forward,
backward and optimizer step. torchtitan's folder lives under /dev/shm too, so every variant writes to memory.
Needs the torchtitan venv (examples/torchtitan/README.md)::

    PYTHONPATH=$PWD /work/venv-titan/bin/python benchmarks/bench_torchtitan.py [--steps 14] [--rounds 1] \
        [--seq-len 256] [--batch 2] [--variants "no checkpoint" "gemini_dcp, AsyncCheckpointer"] [--out torchtitan]

Results: benchmarks/results/torchtitan.json, docs/img/torchtitan.png (matplotlib if installed).
Small sizes on a shared 2-core CPU: medians, with min/max; ratios are against the no-checkpoint run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import IMG, REPO, RESULTS, bar_chart, machine_info, median, shm_dir, spread, write_json  # noqa: E402

SCRIPT = REPO / "examples" / "torchtitan" / "run_cpu.sh"
OVERRIDE = "gemini_dcp.integrations.torchtitan.gemini_checkpoint"
NEVER = 10**9

# name -> (env, extra torchtitan flags)
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "no checkpoint": ({}, ["--checkpoint.no-enable"]),
    "gemini_dcp, blocking": ({"INTERVAL": str(NEVER), "GEMINI_ASYNC": "false"}, []),
    "gemini_dcp, AsyncCheckpointer": ({"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true"}, []),
    "torchtitan DCP, sync": ({"INTERVAL": "1"}, ["--override.imports", f'{OVERRIDE}={{"gemini_every": {NEVER}}}']),
    "torchtitan DCP, async": ({"INTERVAL": "1"}, ["--override.imports", f'{OVERRIDE}={{"gemini_every": {NEVER}}}',
                                                 "--checkpoint.async_mode", "async"]),
}

STEP_LINE = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step:\s+(\d+)\s")


def step_times(log: str) -> dict[int, float]:
    """First time each step's metrics line was logged (either rank)."""
    out: dict[int, float] = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        m = STEP_LINE.match(line)
        if m and int(m.group(2)) not in out:
            out[int(m.group(2))] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def run_variant(name: str, steps: int, scratch: Path, i: int, shape: dict[str, str]) -> list[float]:
    env_extra, flags = VARIANTS[name]
    out = scratch / f"v{i}"
    root = scratch / f"tier{i}"
    root.mkdir(mode=0o700)
    env = dict(os.environ, PYTHON=sys.executable, GEMINI_DCP_ROOT=str(root), JOB_ID=f"bench-{i}", STEPS=str(steps),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **shape, **env_extra)
    proc = subprocess.run(["bash", str(SCRIPT), str(out), *flags], env=env, text=True, capture_output=True,
                          timeout=900, cwd=REPO)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: run failed\n{log[-3000:]}")
    t = step_times(log)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return [t[s + 1] - t[s] for s in range(3, steps) if s in t and s + 1 in t]  # steps 1-3: warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the variants (interleaved)")
    ap.add_argument("--seq-len", type=int, default=256, help="training.seq_len (the issue's reference: 256)")
    ap.add_argument("--batch", type=int, default=2, help="training.local_batch_size")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="the variants to run ('no checkpoint' is always run: the ratios are against it)")
    ap.add_argument("--out", default="torchtitan", help="results/<out>.json and img/<out>.png")
    args = ap.parse_args()
    names = ["no checkpoint", *(n for n in args.variants if n != "no checkpoint")]
    shape = {"SEQ_LEN": str(args.seq_len), "LOCAL_BATCH": str(args.batch)}
    scratch = shm_dir("bench_titan_")
    assets = scratch / "assets-src"
    subprocess.run([sys.executable, str(SCRIPT.parent / "make_assets.py"), str(assets)], check=True, capture_output=True)
    samples: dict[str, list[float]] = {n: [] for n in names}
    i = 0
    t0 = time.time()
    for _ in range(args.rounds):
        for name in names:
            i += 1
            (scratch / f"v{i}").mkdir()
            shutil.copytree(assets, scratch / f"v{i}" / "assets")
            samples[name] += run_variant(name, args.steps, scratch, i, shape)
            print(f"{name:32s} median {median(samples[name]):.3f} s/step", flush=True)
    base = median(samples["no checkpoint"])
    rows = {
        n: {"median_s": median(v), "min_max_s": spread(v), "n": len(v),
            "ratio_vs_no_checkpoint": (median(v) / base) if base and v else None, "samples_s": v}
        for n, v in samples.items()
    }
    data = {
        "what": f"torchtitan llama3 debugmodel on CPU, 2 ranks FSDP2/gloo, seq {args.seq_len} x batch {args.batch}, "
                "checkpoint every step; iteration time = previous save + this step (steps 4..N)",
        "seq_len": args.seq_len, "local_batch": args.batch,
        "state_bytes_total": 80_059_650, "steps": args.steps, "rounds": args.rounds, "wall_s": time.time() - t0,
        "machine": machine_info(), "variants": rows,
    }
    write_json(RESULTS / f"{args.out}.json", data)
    try:
        labels = list(rows)
        bar_chart(IMG / f"{args.out}.png", labels, [rows[n]["median_s"] for n in labels],
                  errors=[rows[n]["min_max_s"] for n in labels], ylabel="s / iteration",
                  title=f"torchtitan debugmodel, CPU 2 ranks, seq {args.seq_len} x {args.batch}: a checkpoint every step",
                  annotate=[f"{rows[n]['median_s']:.3f} s ({rows[n]['ratio_vs_no_checkpoint']:.2f}x)" for n in labels])
    except ImportError:
        print("matplotlib not installed: no plot")
    for n, r in rows.items():
        print(f"{n:32s} {r['median_s']:.3f} s  {r['ratio_vs_no_checkpoint']:.2f}x  (min/max {r['min_max_s']})")


if __name__ == "__main__":
    main()
