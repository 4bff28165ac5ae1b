"""The cost of the health check: save time with ``nonfinite="mark"`` against ``"ignore"``, one run.

    python benchmarks/bench_health.py                      # 1 GiB/rank and 738 items (36 MiB/rank)
    python benchmarks/bench_health.py --gib 0.25 --saves 5 # shorter

2 gloo ranks, each a simulated node with its own tier root. Two writers per rank, one per mode,
each with its own job (``keep=1``); the modes take turns save by save (the order flips every
round), so on a shared host both see the same load. Two states:

* ``1gib`` — ~1 GiB per rank of float32 DTensors ``Shard(0)`` (``common.make_state``): large
  items, the extension's fused copy+CRC+count (``copy_crc32c_count``) multi-threaded;
* ``738`` — 738 float32 DTensors of 36 MiB per rank in all (FSDP2-like): small items, the grouped
  fused path (one ``copy_crc32c_count`` per item).

A figure is the median over rounds of the slowest rank's save (barrier to barrier), and the
paired overhead the median over rounds of mark/ignore - 1. Every step is also checked to be
marked healthy, and one NaN is put into rank 1's state before a last pair of saves to check that
the mark save marks it. Writes benchmarks/results/health.json.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIB, RESULTS, machine_info, median, shm_dir, spawn, write_json  # noqa: E402

MODES = ("mark", "ignore")


def _many_items(n: int, mib: int, rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    per = max(world, (mib * MIB) // 4 // n // world * world)  # float32 values per item (global)
    g = torch.Generator().manual_seed(rank)
    sd: dict[str, Any] = {}
    for i in range(n):
        local = torch.empty(per // world, dtype=torch.float32).uniform_(generator=g)
        sd[f"layers.{i // 8}.p{i % 8}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                            shape=torch.Size((per,)), stride=(1,))
    return sd


def _rank(rank: int, world: int, *, which: str, gib: float, items: int, mib: int, saves: int, warmup: int,
          roots: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from common import make_state, timed

    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.local.tier import LocalTier

    sd = make_state(int(gib * (1 << 30)) * world, rank, world) if which == "1gib" else _many_items(items, mib, rank, world)
    writers = {m: GeminiStorageWriter(root=roots[rank], job_id=f"health-{which}-{m}", keep=1, nonfinite=m) for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # this process's CPU seconds (all its threads) per save
    step = 0
    for rnd in range(warmup + saves):
        order = MODES if rnd % 2 == 0 else tuple(reversed(MODES))
        step += 1
        for m in order:
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            dt = timed(lambda m=m: dcp.save(sd, storage_writer=writers[m], checkpoint_id=step))
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            if rnd >= warmup:
                times[m].append(dt)
                cpu[m].append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
    healthy = LocalTier(roots[rank], f"health-{which}-mark").record(step).healthy
    # One NaN in rank 1's first tensor: the mark writer must mark the next step.
    t = next(v for v in sd.values() if isinstance(v, torch.Tensor))
    local = t.to_local() if hasattr(t, "to_local") else t
    if rank == 1:
        local.view(-1)[123] = float("nan")
    step += 1
    for m in MODES:
        dcp.save(sd, storage_writer=writers[m], checkpoint_id=step)
    marked = LocalTier(roots[rank], f"health-{which}-mark").record(step).healthy is False
    seen = writers["mark"].last_save.nonfinite if writers["mark"].last_save is not None else {}
    dist.barrier()
    for w in writers.values():  # each rank has its own root: free the slots before the next state
        w.tier.remove_job()
    return {"times": times, "cpu": cpu, "healthy_before": healthy, "marked_after_nan": marked, "nonfinite_seen": seen}


def kernel(nbytes: int, reps: int) -> dict[str, Any]:
    """The extension's ops alone, one thread, alternated: copy_with_crc32c against copy_crc32c_count
    (float32), from DRAM (a buffer of ``nbytes``) and in cache (512 KiB)."""
    import torch

    from gemini_dcp.ext import loader

    if not loader.load():
        return {"skipped": "the C++ extension is not loaded"}
    out: dict[str, Any] = {}
    for name, n in (("dram", nbytes), ("cache", 512 << 10)):
        src = torch.randn(n // 4).view(torch.uint8)
        dst = torch.empty(n, dtype=torch.uint8)
        plain, counted = [], []
        for _ in range(reps if name == "dram" else 10 * reps):
            t0 = time.perf_counter()
            torch.ops.gemini_dcp.copy_with_crc32c(dst, src, 1, 0)
            t1 = time.perf_counter()
            torch.ops.gemini_dcp.copy_crc32c_count(dst, src, 1, 1, 0)
            t2 = time.perf_counter()
            plain.append(t1 - t0)
            counted.append(t2 - t1)
        out[name] = {"bytes": n, "copy_crc_gbps_best": round(n / min(plain) / 1e9, 2),
                     "copy_crc_count_gbps_best": round(n / min(counted) / 1e9, 2),
                     "overhead_of_minima_pct": round(100 * (min(counted) / min(plain) - 1), 2),
                     "overhead_paired_pct": round(100 * (median([b / a for a, b in zip(plain, counted)]) - 1), 2)}
        print(f"kernel {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="GiB per rank of the large state")
    ap.add_argument("--items", type=int, default=738)
    ap.add_argument("--mib", type=int, default=36, help="MiB per rank of the many-items state")
    ap.add_argument("--saves", type=int, default=8, help="timed rounds per state (each round: one save per mode)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--states", default="1gib,738")
    ap.add_argument("--json", default=str(RESULTS / "health.json"))
    args = ap.parse_args()
    world = 2
    out: dict[str, Any] = {"config": {**vars(args), "world": world, "modes": list(MODES)}, "machine": machine_info(),
                           "results": {}}
    out["kernel"] = kernel(256 << 20, 15)
    for which in args.states.split(","):
        roots = [str(shm_dir(f"bench-health-{r}")) for r in range(world)]
        t0 = time.perf_counter()
        res = spawn(_rank, world, which=which, gib=args.gib, items=args.items, mib=args.mib, saves=args.saves,
                    warmup=args.warmup, roots=roots)
        times = res[0]["times"]  # barrier to barrier: the same on every rank (the slowest rank's)
        ratios = [a / b for a, b in zip(times["mark"], times["ignore"])]
        # CPU seconds of a save summed over the ranks: less sensitive than wall time to other jobs on a shared host.
        cpu = {m: [sum(r["cpu"][m][i] for r in res) for i in range(len(times[m]))] for m in MODES}
        cpu_ratios = [a / b for a, b in zip(cpu["mark"], cpu["ignore"]) if b > 0]
        row = {
            "cpu_mark_median_ms": round(1e3 * median(cpu["mark"]), 2),
            "cpu_ignore_median_ms": round(1e3 * median(cpu["ignore"]), 2),
            "cpu_overhead_paired_pct": round(100 * (median(cpu_ratios) - 1), 2),
            "mark_min_ms": round(1e3 * min(times["mark"]), 2),
            "ignore_min_ms": round(1e3 * min(times["ignore"]), 2),
            "overhead_of_mins_pct": round(100 * (min(times["mark"]) / min(times["ignore"]) - 1), 2),
            "mark_median_ms": round(1e3 * median(times["mark"]), 2),
            "ignore_median_ms": round(1e3 * median(times["ignore"]), 2),
            "overhead_paired_pct": round(100 * (median(ratios) - 1), 2),
            "overhead_of_medians_pct": round(100 * (median(times["mark"]) / median(times["ignore"]) - 1), 2),
            "mark_ms": [round(1e3 * x, 2) for x in times["mark"]],
            "ignore_ms": [round(1e3 * x, 2) for x in times["ignore"]],
            "healthy_before": [r["healthy_before"] for r in res],
            "marked_after_nan": [r["marked_after_nan"] for r in res],
            "nonfinite_seen": [r["nonfinite_seen"] for r in res],
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        out["results"][which] = row
        print(f"{which}: mark {row['mark_median_ms']} ms, ignore {row['ignore_median_ms']} ms, "
              f"overhead {row['overhead_paired_pct']}% (paired median), {row['overhead_of_medians_pct']}% (of medians), "
              f"{row['overhead_of_mins_pct']}% (of minima); CPU {row['cpu_mark_median_ms']} vs {row['cpu_ignore_median_ms']} ms, "
              f"{row['cpu_overhead_paired_pct']}% (paired); "
              f"marked after NaN: {row['marked_after_nan']}", flush=True)
    out["machine_after"] = {"loadavg_1_5_15": machine_info()["loadavg_1_5_15"]}
    write_json(Path(args.json), out)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
