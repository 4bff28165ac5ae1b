"""Per-save protocol cost: ``dcp.save`` planning every save vs. replaying the recorded plan.

    python benchmarks/bench_plan_replay.py                  # 2 ranks, 32 MiB/rank, 16 / 128 / 512 tensors (~2 min)
    python benchmarks/bench_plan_replay.py --tensors 16 1024 --saves 12

2 gloo ranks (two simulated nodes, each its own tier root), a state of N
float32 DTensors sharded ``Shard(0)`` (what FSDP2 hands to DCP) of the same
total size for every N, plus a step counter. In the same processes, blocks of
saves alternate between:

* ``planned`` — ``dcp.save(..., storage_writer=GeminiStorageWriter, planner=
  DefaultSavePlanner(enable_plan_caching=True))`` every save: what
  ``AsyncCheckpointer`` did before plan replay (DCP's own plan caching still
  runs its gather/scatter and result collectives);
* ``replay`` — ``gemini_dcp.snapshot.replay.PlanReplay.save``: the first save
  planned, the others replayed (one integer all-reduce + the commit gather).

Figures per N: median wall time per save (barrier to barrier: the slowest
rank) and median CPU time of the saving thread (the larger of the two ranks),
and the ratio replay / planned from the same run. Writes
benchmarks/results/plan_replay.json and docs/img/bench_plan_replay.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import IMG, MIB, RESULTS, bar_chart, machine_info, median, shm_dir, spawn, write_json  # noqa: E402


def _state(n: int, per_rank_bytes: int, rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = max(1, per_rank_bytes // (n * 1024 * 4))
    g = torch.Generator().manual_seed(rank)
    sd: dict[str, Any] = {
        f"layers.{i}.weight": DTensor.from_local(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)], run_check=False)
        for i in range(n)
    }
    sd["step"] = 0
    return sd


def _worker(rank: int, world: int, *, roots: list[str], tensors: list[int], per_rank_bytes: int, saves: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.snapshot.replay import PlanReplay
    from gemini_dcp.transport.comm import get_comm

    group = get_comm(300.0).group
    out: dict[str, Any] = {}
    step = 0
    for n in tensors:
        sd = _state(n, per_rank_bytes, rank, world)
        writers = {m: GeminiStorageWriter(root=roots[rank], job_id=f"bench-{m}-{n}", keep=2, process_group=group) for m in ("planned", "replay")}
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = f"bench_plan_replay.{n}"  # DCP's cache is class-level: a key of our own
        replay = PlanReplay(writers["replay"], group, no_dist=False)

        def save(mode: str, step: int) -> None:
            sd["step"] = step
            if mode == "replay":
                replay.save(sd, step)
            else:
                dcp.save(sd, storage_writer=writers[mode], checkpoint_id=step, planner=planner, process_group=group)

        rec: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in ("planned", "replay")}
        for mode in ("planned", "replay"):  # warm-up: slots created, plans recorded
            for _ in range(3):
                save(mode, step)
                step += 1
        for blk in range(saves // 2):
            for mode in (("planned", "replay") if blk % 2 == 0 else ("replay", "planned")):
                for _ in range(2):
                    dist.barrier(group=group)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    save(mode, step)
                    c1 = time.thread_time()
                    dist.barrier(group=group)
                    rec[mode]["wall"].append(time.perf_counter() - t0)
                    rec[mode]["cpu"].append(c1 - c0)
                    step += 1
        out[str(n)] = {"records": rec, "replayed": replay.replayed, "planned_saves": replay.planned, "rows": sd["layers.0.weight"].to_local().shape[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--mib", type=int, default=32, help="state per rank (MiB)")
    ap.add_argument("--saves", type=int, default=12, help="timed saves per mode and size")
    ap.add_argument("--json", default=str(RESULTS / "plan_replay.json"))
    ap.add_argument("--png", default=str(IMG / "bench_plan_replay.png"))
    args = ap.parse_args()
    world = 2
    scratch = shm_dir("bench-replay-")
    roots = []
    for i in range(world):
        (scratch / f"node{i}").mkdir()
        roots.append(str(scratch / f"node{i}"))
    per_rank = spawn(_worker, world, roots=roots, tensors=args.tensors, per_rank_bytes=args.mib * MIB, saves=args.saves)
    sizes: dict[str, Any] = {}
    print(f"{'tensors':>8s} {'planned ms':>11s} {'replay ms':>10s} {'wall ratio':>10s} {'planned cpu':>12s} {'replay cpu':>11s} {'cpu ratio':>9s}")
    for n in map(str, args.tensors):
        row: dict[str, Any] = {"replayed_saves": per_rank[0][n]["replayed"], "planned_saves_of_replay": per_rank[0][n]["planned_saves"]}
        for mode in ("planned", "replay"):
            walls = [max(ws) for ws in zip(*(r[n]["records"][mode]["wall"] for r in per_rank))]
            cpus = [max(cs) for cs in zip(*(r[n]["records"][mode]["cpu"] for r in per_rank))]
            row[mode] = {"wall_median_ms": median(walls) * 1e3, "cpu_median_ms": median(cpus) * 1e3, "saves": len(walls)}
        row["wall_ratio_replay_vs_planned"] = row["replay"]["wall_median_ms"] / row["planned"]["wall_median_ms"]
        row["cpu_ratio_replay_vs_planned"] = row["replay"]["cpu_median_ms"] / row["planned"]["cpu_median_ms"]
        sizes[n] = row
        print(
            f"{n:>8s} {row['planned']['wall_median_ms']:11.1f} {row['replay']['wall_median_ms']:10.1f} "
            f"{row['wall_ratio_replay_vs_planned']:10.2f} {row['planned']['cpu_median_ms']:12.1f} "
            f"{row['replay']['cpu_median_ms']:11.1f} {row['cpu_ratio_replay_vs_planned']:9.2f}"
        )
    res = {"config": vars(args) | {"world": world}, "machine": machine_info(), "sizes": sizes}
    write_json(Path(args.json), res)
    if args.png:
        labels, vals, colors = [], [], []
        for n, row in sizes.items():
            for mode, c in (("planned", "#c55"), ("replay", "#2a7")):
                labels.append(f"{n} tensors, {mode}")
                vals.append(row[mode]["wall_median_ms"])
                colors.append(c)
        bar_chart(
            Path(args.png), labels, vals, colors=colors, ylabel="ms per save (median, slowest rank)",
            title=f"per-step save, 2 gloo ranks, {args.mib} MiB/rank: dcp.save planning every save vs plan replay",
        )
    print(f"wrote {args.json}" + (f" and {args.png}" if args.png else ""))


if __name__ == "__main__":
    main()
