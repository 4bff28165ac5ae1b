"""Failure domains cost nothing per save: replicated saves with ``failure_domain`` set vs unset, same run.

4 gloo ranks on this host, each its own simulated node (own tier root), ``replicas=2`` (mixed
placement), ``--mib`` MiB of float32 per rank; two writers in the same processes, one naming 2
domains of 2 nodes and one naming none, saved alternately (ABAB) ``--reps`` times after 3 untimed
saves each (slots filled); each figure is the slowest rank's ``dcp.save`` wall time, barrier to
barrier. Writes ``benchmarks/results/domains.json``: medians and the ratio (domains / none).

    python benchmarks/bench_domains.py --mib 32 --reps 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, median, remove_dir, shm_dir, spawn, write_json  # noqa: E402

DOMAINS = ["rackA", "rackA", "rackB", "rackB"]


def _run(rank: int, world: int, *, top: str, mib: int, reps: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageWriter

    root = Path(top) / f"node{rank}"
    root.mkdir(mode=0o700, exist_ok=True)
    sd = {"w": torch.randn(mib * (1 << 20) // 4)}
    writers = {
        "domains": GeminiStorageWriter(root=str(root), job_id="with", replicas=2, failure_domain=DOMAINS[rank]),
        "none": GeminiStorageWriter(root=str(root), job_id="without", replicas=2),
    }
    times: dict[str, list[float]] = {k: [] for k in writers}
    step = 0
    for rep in range(3 + reps):
        for name, w in writers.items():
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save({**sd, "step": step}, storage_writer=w, checkpoint_id=step)
            dist.barrier()
            if rep >= 3:
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32, help="MiB per rank (default 32)")
    ap.add_argument("--reps", type=int, default=10, help="timed saves per writer (default 10)")
    ap.add_argument("--json", type=Path, default=RESULTS / "domains.json")
    args = ap.parse_args(argv)
    top = shm_dir("gemini-bench-domains-")
    try:
        res: list[Any] = spawn(_run, 4, top=str(top), mib=args.mib, reps=args.reps)
    finally:
        remove_dir(top)
    # per repetition, the slowest rank (the save ends with the collective commit)
    per = {k: [max(r[k][i] for r in res) for i in range(args.reps)] for k in ("domains", "none")}
    out = {"mib_per_rank": args.mib, "reps": args.reps, "world": 4, "replicas": 2, "domains": DOMAINS,
           "save_s": per, "median_s": {k: median(v) for k, v in per.items()}}
    out["ratio_domains_vs_none"] = out["median_s"]["domains"] / out["median_s"]["none"]
    write_json(args.json, out)
    print(f"save with domains {out['median_s']['domains']:.4f} s, without {out['median_s']['none']:.4f} s: "
          f"{out['ratio_domains_vs_none']:.3f}x -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
