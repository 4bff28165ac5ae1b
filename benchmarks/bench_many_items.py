"""Saves at real item counts: the per-item cost of DCP, stock storage and gemini, in one run.

    python benchmarks/bench_many_items.py                       # N = 16, 738, 3000 at 36 MiB/rank (~10 min loaded)
    python benchmarks/bench_many_items.py --items 738 --mib 512 --saves 10

2 gloo ranks (each a simulated node with its own tier root), a state of N float32
DTensors sharded ``Shard(0)`` (what FSDP2 hands to DCP) of the same total size per rank for
every N, plus a step counter. For each N, in the same processes, the modes in turn:

* ``noop`` — ``dcp.save`` with a StorageWriter that writes nothing: DCP's own planning
  and collectives, the floor every DCP storage pays;
* ``stock`` — ``FileSystemWriter`` to /dev/shm (``DefaultSavePlanner``);
* ``stock_cache`` — the same with ``DefaultSavePlanner(enable_plan_caching=True)``;
* ``gemini`` — ``GeminiStorageWriter`` (``DefaultSavePlanner``);
* ``gemini_cache`` — ``GeminiStorageWriter`` with the plan cache;
* ``async`` — ``AsyncCheckpointer``: the time ``save()`` blocks the caller, and save →
  committed (``handle.wait()``).

For the ``gemini`` modes the time spent inside the writer's own StorageWriter calls during each
save is measured too (``writer_median_ms``: gemini's cost without DCP's planning around it; it
includes waiting in gemini's collectives for the other rank: one fixed-size all-gather on a
plain save, plus one all-reduce with DCP's plan cache). ``--gc-freeze`` takes Python's
collector pauses (mostly DCP's planning) out of the timed saves: ``gc.collect(); gc.freeze()``
in each rank after the warm-up.

After the saves, each mode's last step is restored ``--loads`` times (``dcp.load`` into zeroed
tensors, stock ``FileSystemReader`` or ``GeminiStorageReader``; the median of the slowest rank);
the ``gemini`` mode's also with ``gemini_dcp.fast_load`` (``fast_load_median_ms``; ``--no-fast`` skips it).

The modes take turns save by save, in a rotating order, so that on a shared host every mode
sees the same load. Each mode: 3 warm-up saves, then ``--saves`` timed ones; a figure is the median over saves
of the slowest rank (wall time barrier to barrier; for ``async`` the handle's own
``blocked_s`` / ``total_s``); "above the floor" is also given paired, as the median over
rounds of a mode's save minus the no-op save of the same round. After the timed saves every mode's last step is loaded into
zeroed tensors and compared bit-exact with the state. Writes
benchmarks/results/many_items.json; prints the table for docs/benchmarks.md with the host's
load (``uptime``) before and after: the host is shared, so prefer the ratios of one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIB, RESULTS, machine_info, median, shm_dir, spawn, write_json  # noqa: E402

MODES = ("noop", "stock", "stock_cache", "gemini", "gemini_cache", "async")


def _pyvals(n: int) -> dict[str, Any]:
    """~``n`` small non-tensor values shaped like an optimizer's flattened param groups
    (``optim.param_groups.<fqn>.lr`` ...): floats, bools, tuples, None, in nested dicts."""
    groups: dict[str, Any] = {}
    per = 10
    for i in range(max(1, n // per)):
        groups[f"layers.{i}.weight"] = {
            "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
            "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": None,
        }
    return {"param_groups": groups}


def _state(n: int, per_rank_bytes: int, rank: int, world: int, mesh: Any, pyvals: int = 0) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    cols = 64
    rows = max(1, per_rank_bytes // (n * cols * 4))
    g = torch.Generator().manual_seed(1000 * rank + n)
    sd: dict[str, Any] = {
        f"layers.{i}.weight": DTensor.from_local(torch.randn(rows, cols, generator=g), mesh, [Shard(0)], run_check=False)
        for i in range(n)
    }
    sd["step"] = 0
    if pyvals and rank == 0:  # torchtitan's optimizer param groups: on the coordinator only
        sd["optim"] = _pyvals(pyvals)
    return sd


def _noop_writer() -> Any:
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future

    class NoopWriter(StorageWriter):
        """Writes nothing: what is left of ``dcp.save`` is DCP's planning and collectives."""

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: Any) -> Any:
            return plans

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut: Future[list[WriteResult]] = Future()
            fut.set_result([WriteResult(index=it.index, size_in_bytes=0, storage_data=None) for it in plan.items])
            return fut

        def finish(self, metadata: Any, results: Any) -> None:
            pass

    return NoopWriter()


class _WriterClock:
    """Wall time spent inside a writer's own StorageWriter calls during one save (gemini's own
    cost, without DCP's planning around it): this rank's sum over the calls of the save."""

    CALLS = ("reset", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data", "finish")

    def __init__(self, writer: Any) -> None:
        self.total = 0.0
        for name in self.CALLS:
            setattr(writer, name, self._timed(getattr(writer, name)))

    def _timed(self, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t0

        return call

    def take(self) -> float:
        out, self.total = self.total, 0.0
        return out


def _blank(v: Any) -> Any:
    """The nested dicts of ``v`` with -1 at every leaf: a load target for non-tensor values."""
    return {k: _blank(x) for k, x in v.items()} if isinstance(v, dict) else -1


def _restore_exact(sd: dict[str, Any], mode: str, where: Any, group: Any, loads: int = 1,
                   fast: bool = False, paths: list[str] | None = None) -> tuple[bool, list[float]]:
    """Load ``mode``'s last save into zeroed tensors ``loads`` times: (bit-exact with ``sd``, wall
    time of each load, barrier to return; the last load is the one compared). ``fast``: with
    ``gemini_dcp.fast_load`` instead of ``dcp.load`` (the path each load took is appended to ``paths``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from gemini_dcp import GeminiStorageReader, fast_load

    times: list[float] = []
    for _ in range(max(1, loads)):
        target = {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False)
                      if isinstance(v, DTensor) else _blank(v)) for k, v in sd.items()}
        if mode.startswith("stock"):
            reader = dcp.FileSystemReader(where)
        else:
            reader = GeminiStorageReader(root=where[0], job_id=where[1])
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if fast:
            got = fast_load(target, storage_reader=reader, process_group=group)
            times.append(time.perf_counter() - t0)
            if paths is not None:
                paths.append(got.path if got.path == "fast" else f"dcp ({got.reason})")
            continue
        dcp.load(target, storage_reader=reader, process_group=group)
        times.append(time.perf_counter() - t0)
    exact = all(
        torch.equal(target[k].to_local(), v.to_local()) if isinstance(v, DTensor) else target[k] == v for k, v in sd.items()
    )
    return exact, times


def _worker(rank: int, world: int, *, roots: list[str], stock_dir: str, items: list[int], per_rank_bytes: int,
            saves: int, warmup: int, modes: list[str], loads: int = 3, fast_loads: bool = True,
            gc_freeze: bool = False, pyvals: int = 0, profile: str | None = None) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh

    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.snapshot import AsyncCheckpointer
    from gemini_dcp.transport.comm import get_comm

    group = get_comm(300.0).group
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    step = 0
    for n in items:
        sd = _state(n, per_rank_bytes, rank, world, mesh, pyvals)
        writers: dict[str, Any] = {}
        clocks: dict[str, _WriterClock] = {}
        ckpt = None
        for mode in modes:
            job = f"many-{mode}-{n}"
            if mode == "async":
                ckpt = AsyncCheckpointer(GeminiStorageWriter(root=roots[rank], job_id=job, keep=2, process_group=group),
                                         interleave=False)
            elif mode.startswith("gemini"):
                writers[mode] = GeminiStorageWriter(root=roots[rank], job_id=job, keep=2, process_group=group)
                clocks[mode] = _WriterClock(writers[mode])
        walls: dict[str, list[float]] = {m: [] for m in modes}
        inside: dict[str, list[float]] = {m: [] for m in clocks}
        blocked: list[float] = []
        cpu: list[float] = []
        prof = None
        where: dict[str, Any] = {}
        saved_step: dict[str, int] = {}
        for i in range(warmup + saves):
            if gc_freeze and i == warmup:  # the collector's pauses (mostly in DCP's planning) out of the timed saves
                gc.collect()
                gc.freeze()
            # The modes take turns, in a rotating order: on a shared host each sees the same load.
            for mode in modes[i % len(modes):] + modes[: i % len(modes)]:
                job = f"many-{mode}-{n}"
                sd["step"] = step
                planner = None
                if mode.endswith("_cache"):
                    planner = DefaultSavePlanner(enable_plan_caching=True)
                    planner._cached_plans_key = job  # DCP's cache is class-level: one key per mode and N
                dist.barrier(group=group)
                t0 = time.perf_counter()
                if mode == "noop":
                    dcp.save(sd, storage_writer=_noop_writer(), process_group=group)
                elif mode.startswith("stock"):
                    path = os.path.join(stock_dir, job, f"step-{step % 2}")
                    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, overwrite=True), planner=planner,
                             process_group=group)
                    where[mode] = path
                elif mode.startswith("gemini"):
                    dcp.save(sd, storage_writer=writers[mode], checkpoint_id=step, planner=planner, process_group=group)
                    where[mode] = (roots[rank], job)
                else:
                    assert ckpt is not None
                    if profile and i == warmup and prof is None:
                        prof = _profile_thread(ckpt)
                    h = ckpt.save(sd, step)
                    h.wait()
                    where[mode] = (roots[rank], job)
                wall = time.perf_counter() - t0
                saved_step[mode] = step
                spent = clocks[mode].take() if mode in clocks else None
                if i >= warmup and spent is not None:
                    inside[mode].append(spent)
                if i >= warmup:
                    if mode == "async":
                        walls[mode].append(h.total_s)
                        blocked.append(h.blocked_s)
                        cpu.append(h.cpu_s)
                    else:
                        walls[mode].append(wall)
                step += 1
        res: dict[str, Any] = {}
        for mode in modes:
            row: dict[str, Any] = {"wall": walls[mode]}
            if mode in inside:
                row["writer"] = inside[mode]
            if mode == "async":
                assert ckpt is not None
                row["blocked"] = blocked
                row["cpu"] = cpu
                if prof is not None and profile:
                    prof.disable()
                    prof.dump_stats(f"{profile}.{rank}")
                row["plans"] = ckpt.stats().get("plans")
                cache = getattr(ckpt, "structure", None)  # None: a gemini_dcp from before the structure cache
                row["structure"] = None if cache is None else {"walks": cache.walks, "reuses": cache.reuses}
                ckpt.close()
            if mode != "noop":
                # The tensors are the same for every mode; the step counter is the mode's last save's.
                last = dict(sd, step=saved_step[mode])
                row["exact"], row["load"] = _restore_exact(last, mode, where[mode], group, loads)
                if mode == "gemini" and fast_loads:  # the same save restored with gemini_dcp.fast_load
                    row["fast_paths"] = []
                    row["fast_exact"], row["fast_load"] = _restore_exact(
                        last, mode, where[mode], group, loads, fast=True, paths=row["fast_paths"])
            res[mode] = row
        out[str(n)] = res
        dist.barrier(group=group)
    return out


def _profile_thread(ckpt: Any) -> Any:
    """cProfile in the checkpointer's background thread from its next job on (``--profile``)."""
    import cProfile

    prof = cProfile.Profile()
    done = threading.Event()
    inner = ckpt.replay.save

    def save(*a: Any, **k: Any) -> Any:
        if not done.is_set():
            done.set()
            prof.enable()
        return inner(*a, **k)

    ckpt.replay.save = save
    return prof


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, nargs="+", default=[16, 738, 3000])
    ap.add_argument("--mib", type=int, default=36, help="state per rank (MiB)")
    ap.add_argument("--saves", type=int, default=10, help="timed saves per mode and N")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--loads", type=int, default=3, help="timed restores of each mode's last save, per N")
    ap.add_argument("--no-fast", action="store_true", help="skip the gemini_dcp.fast_load restores of the gemini mode")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.collect(); gc.freeze() in each rank after the warm-up saves: the collector's pauses "
                         "(~100-200 ms per plain dcp.save at 738 items, mostly in DCP's planning) out of the figures")
    ap.add_argument("--pyvals", type=int, default=0,
                    help="add ~N small non-tensor values on rank 0 (nested dicts like optimizer param groups)")
    ap.add_argument("--profile", default=None, help="async: cProfile the background thread's timed saves to PATH.<rank>")
    ap.add_argument("--json", default=str(RESULTS / "many_items.json"))
    args = ap.parse_args()
    world = 2
    scratch = shm_dir("bench-many-")
    roots = []
    for i in range(world):
        (scratch / f"node{i}").mkdir()
        roots.append(str(scratch / f"node{i}"))
    (scratch / "stock").mkdir()
    load_before = _uptime()
    t0 = time.time()
    per_rank = spawn(_worker, world, roots=roots, stock_dir=str(scratch / "stock"), items=args.items,
                     per_rank_bytes=args.mib * MIB, saves=args.saves, warmup=args.warmup, modes=args.modes, loads=args.loads,
                     fast_loads=not args.no_fast, gc_freeze=args.gc_freeze, pyvals=args.pyvals, profile=args.profile)
    load_after = _uptime()
    shutil.rmtree(scratch, ignore_errors=True)
    table: dict[str, Any] = {}
    for n in map(str, args.items):
        row: dict[str, Any] = {}
        for mode in args.modes:
            walls = [max(ws) for ws in zip(*(r[n][mode]["wall"] for r in per_rank))]
            cell: dict[str, Any] = {"median_ms": median(walls) * 1e3, "min_ms": min(walls) * 1e3, "max_ms": max(walls) * 1e3}
            if mode == "async":
                bl = [max(bs) for bs in zip(*(r[n][mode]["blocked"] for r in per_rank))]
                cell["blocked_median_ms"] = median(bl) * 1e3
                cell["blocked_max_ms"] = max(bl) * 1e3
                # The background thread's CPU per save (``thread_time``), per rank: what it takes from training.
                cell["cpu_median_ms"] = [median(r[n][mode]["cpu"]) * 1e3 for r in per_rank]
                cell["cpu_ms"] = [[x * 1e3 for x in r[n][mode]["cpu"]] for r in per_rank]
                cell["plans"] = per_rank[0][n][mode]["plans"]
                cell["structure"] = per_rank[0][n][mode]["structure"]
            if mode != "noop":
                cell["exact"] = all(r[n][mode]["exact"] for r in per_rank)
                lw = [max(ls) for ls in zip(*(r[n][mode]["load"] for r in per_rank))]
                cell["load_median_ms"] = median(lw) * 1e3  # restore of the last save, slowest rank
                cell["loads_ms"] = [x * 1e3 for x in lw]
                if "fast_load" in per_rank[0][n][mode]:
                    fw = [max(ls) for ls in zip(*(r[n][mode]["fast_load"] for r in per_rank))]
                    cell["fast_load_median_ms"] = median(fw) * 1e3
                    cell["fast_loads_ms"] = [x * 1e3 for x in fw]
                    cell["fast_exact"] = all(r[n][mode]["fast_exact"] for r in per_rank)
                    cell["fast_paths"] = sorted({p for r in per_rank for p in r[n][mode]["fast_paths"]})
            if "writer" in per_rank[0][n][mode]:
                # gemini's own calls (slowest rank per save): its cost without DCP's planning around it.
                ww = [max(xs) for xs in zip(*(r[n][mode]["writer"] for r in per_rank))]
                cell["writer_median_ms"] = median(ww) * 1e3
            cell["saves_ms"] = [w * 1e3 for w in walls]
            row[mode] = cell
        if "noop" in row:
            floor = row["noop"]["median_ms"]
            for mode in ("gemini", "gemini_cache", "stock", "stock_cache"):
                if mode in row:
                    row[mode]["above_floor_ms"] = row[mode]["median_ms"] - floor
                    # Paired: the same round's no-op save was made next to it, under the same load.
                    diffs = [a - b for a, b in zip(row[mode]["saves_ms"], row["noop"]["saves_ms"])]
                    row[mode]["above_floor_paired_ms"] = median(diffs)
        table[n] = row
    hdr = " | ".join(["N"] + list(args.modes) + (["async blocked"] if "async" in args.modes else []))
    print(f"| {hdr} |")
    for n, row in table.items():
        cells = [f"{row[m]['median_ms']:.1f}" for m in args.modes]
        if "async" in row:
            cells.append(f"{row['async']['blocked_median_ms']:.2f}")
            print(n, "async background CPU per save, ms by rank:", [round(x, 2) for x in row["async"]["cpu_median_ms"]])
        print(f"| {n} | " + " | ".join(cells) + " |")
    for n, row in table.items():
        print(n, {m: c.get("exact") for m, c in row.items()}, "above floor (medians / paired per round):",
              {m: (round(c["above_floor_ms"], 1), round(c["above_floor_paired_ms"], 1))
               for m, c in row.items() if "above_floor_ms" in c},
              "inside the writer's calls:", {m: round(c["writer_median_ms"], 1) for m, c in row.items() if "writer_median_ms" in c})
    for n, row in table.items():
        print(n, "restore ms (median, slowest rank):", {m: round(c["load_median_ms"], 1) for m, c in row.items() if "load_median_ms" in c})
        if "fast_load_median_ms" in row.get("gemini", {}):
            g = row["gemini"]
            print(n, f"fast_load ms: {g['fast_load_median_ms']:.1f} (paths {g['fast_paths']}, exact {g['fast_exact']})")
    print("load before:", load_before)
    print("load after: ", load_after)
    res = {"config": vars(args) | {"world": world}, "machine": machine_info(), "load_before": load_before,
           "load_after": load_after, "seconds": time.time() - t0, "results": table}
    write_json(Path(args.json), res)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
