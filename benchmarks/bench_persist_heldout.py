"""Issue 52's held-out check: save-until-durable of fresh writers, second save and steady, vs stock.

    python benchmarks/bench_persist_heldout.py              # 512 MiB, 3 fresh writers x 10 saves
    python benchmarks/bench_persist_heldout.py --mib 256 --reps 5

World 1, float32 state in 8 tensors. Each repetition builds a fresh ``GeminiStorageWriter`` (default
``keep``, ``persistent="file://..."`` on the disk, ``persist_every=1``) on a fresh tier root and store
and saves 10 steps, each ``dcp.save`` then ``writer.wait_persisted(step)`` (every tensor changed
between steps); then two stock blocking ``dcp.save(FileSystemWriter)`` of the same state to the same
disk (the first into new files, the second over warm ones: both are reported, the ratio uses their
median over all repetitions). Figures, medians over repetitions:

- ``durable_second_vs_stock``: the second step's save + ``wait_persisted`` / stock;
- ``durable_steady_vs_stock``: the median of steps 5-10 / stock;
- ``durable_second_vs_warm_stock``, ``durable_steady_vs_warm_stock``: the same against the second
  stock save alone (over files that exist: stock's best case);
- ``save_second_vs_tenth``: the second step's ``dcp.save`` alone / the tenth's (the slots of a fresh
  writer: the second goes into a slot grown in the background at the first plan);
- ``durable_second_vs_tenth``: the same with ``wait_persisted``.

Writes benchmarks/results/persist-heldout.json (``--json`` to change it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

STEPS = 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--disk", default="/var/tmp", help="directory on disk for the store and the stock copies")
    ap.add_argument("--json", type=Path, default=common.RESULTS / "persist-heldout.json")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from gemini_dcp import GeminiStorageWriter

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sd = {f"t{i}": torch.randn(args.mib * (1 << 20) // 32) for i in range(8)}
    mem: list[list[float]] = []
    dur: list[list[float]] = []
    stock: list[list[float]] = []
    for rep in range(args.reps):
        shm = Path(tempfile.mkdtemp(prefix="gemini-heldout-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        disk = Path(tempfile.mkdtemp(prefix="gemini-heldout-", dir=args.disk))
        try:
            (shm / "tier").mkdir(mode=0o700)
            w = GeminiStorageWriter(root=str(shm / "tier"), job_id="heldout", persistent=f"file://{disk / 'store'}",
                                    persist_every=1)
            m, d = [], []
            for step in range(1, STEPS + 1):
                for t in sd.values():
                    t.add_(1)
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=w, checkpoint_id=step)
                t1 = time.perf_counter()
                w.wait_persisted(step)
                t2 = time.perf_counter()
                m.append(round(t1 - t0, 4))
                d.append(round(t2 - t0, 4))
            s = []
            for _ in range(2):
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=FileSystemWriter(str(disk / "stock")))
                s.append(round(time.perf_counter() - t0, 4))
            mem.append(m)
            dur.append(d)
            stock.append(s)
            print(f"rep {rep}: save {m}\n       durable {d}\n       stock {s}", flush=True)
            del w
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    med = statistics.median
    base = med([x for s in stock for x in s])
    ratios = {
        "durable_second_vs_stock": med([d[1] for d in dur]) / base,
        "durable_steady_vs_stock": med([med(d[4:]) for d in dur]) / base,
        "durable_second_vs_warm_stock": med([d[1] for d in dur]) / med([x[1] for x in stock]),
        "durable_steady_vs_warm_stock": med([med(d[4:]) for d in dur]) / med([x[1] for x in stock]),
        "save_second_vs_tenth": med([m[1] for m in mem]) / med([m[STEPS - 1] for m in mem]),
        "durable_second_vs_tenth": med([d[1] for d in dur]) / med([d[STEPS - 1] for d in dur]),
    }
    out = {"mib": args.mib, "reps": args.reps, "loadavg": [round(x, 2) for x in os.getloadavg()],
           "unix": int(time.time()), "ratios": {k: round(v, 3) for k, v in ratios.items()},
           "seconds": {"save": mem, "durable": dur, "stock": stock, "stock_median": round(base, 4)}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["ratios"]), "load", out["loadavg"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
