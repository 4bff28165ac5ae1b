"""First durable save of a process vs later ones (issue 36): save + ``wait_persisted`` per step.

    python benchmarks/bench_first_durable.py                   # 64 MiB, 3 fresh processes per gap, gaps 0 and 5 s
    python benchmarks/bench_first_durable.py --mib 256 --runs 5 --gaps 0 2 5

Each run is a fresh process on a fresh tier root and store (no drain server running): it builds a
``GeminiStorageWriter(persistent="file://...", persist_every=1)``, waits ``gap`` seconds (the time a
job spends between building its writer and its first save: model setup, the first steps), then
saves and waits until durable, four steps in a row. The figure is the first step's
save + ``wait_persisted`` time over the median of the later three, same process. The writer starts
the node's drain server at construction; the server imports its upload side (torch) in the
background, which is what a first save right after construction waits for.

Writes benchmarks/results/first_durable.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

CHILD = r"""
import json, os, sys, time, tempfile, torch
import torch.distributed.checkpoint as dcp
from gemini_dcp import GeminiStorageWriter
mib, gap, base = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
root = tempfile.mkdtemp(dir=base); os.chmod(root, 0o700)
store = tempfile.mkdtemp()
n = mib << 18  # float32 elements
sd = {f"t{i}": torch.randn(n // 4) for i in range(4)}
w = GeminiStorageWriter(root=root, job_id="first", persistent=f"file://{store}", persist_every=1)
time.sleep(gap)
out = []
for step in range(1, 5):
    for v in sd.values():
        v.add_(1)
    t = time.perf_counter()
    dcp.save(sd, storage_writer=w, checkpoint_id=step)
    saved = time.perf_counter() - t
    w.wait_persisted(step, timeout_s=300)
    out.append({"step": step, "save_s": saved, "durable_s": time.perf_counter() - t})
print(json.dumps(out))
"""


def run(mib: int, gap: float, shm: str) -> list[dict[str, float]]:
    # The run's drain process outlives it (it idles up to a minute, then exits once its directory is gone):
    # the cleanup may race with its last writes.
    with tempfile.TemporaryDirectory(dir=shm, ignore_cleanup_errors=True) as base:
        r = subprocess.run([sys.executable, "-c", CHILD, str(mib), str(gap), base], capture_output=True, text=True,
                           timeout=900, cwd=base)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="state size (MiB, default 64)")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per gap (default 3)")
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.0, 5.0], help="seconds from construction to the first save")
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--json", type=Path, default=common.RESULTS / "first_durable.json")
    args = ap.parse_args(argv)
    load_before = common.loadavg()
    rows = []
    for gap in args.gaps:
        for i in range(args.runs):
            steps = run(args.mib, gap, args.shm)
            later = statistics.median(s["durable_s"] for s in steps[1:])
            rows.append({"gap_s": gap, "run": i, "steps": steps, "first_durable_s": steps[0]["durable_s"],
                         "later_durable_median_s": later, "first_over_later": steps[0]["durable_s"] / later})
            print(f"gap {gap:4.1f} s run {i}: first {steps[0]['durable_s']:.3f} s, later {later:.3f} s "
                  f"-> {steps[0]['durable_s'] / later:.2f}x")
    summary = {str(g): statistics.median(r["first_over_later"] for r in rows if r["gap_s"] == g) for g in args.gaps}
    print("median first/later by gap:", {k: round(v, 2) for k, v in summary.items()})
    common.write_json(args.json, {"benchmark": "first_durable", "machine": common.machine_info(),
                                  "config": {"mib": args.mib, "runs": args.runs, "gaps": args.gaps,
                                             "persist_every": 1, "store": "file://"},
                                  "loadavg_before": load_before, "runs": rows, "median_first_over_later": summary})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
