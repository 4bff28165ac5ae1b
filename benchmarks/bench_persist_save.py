"""Save until durable: stock blocking ``dcp.save`` to disk vs gemini save + drain to the same disk.

Per world size (gloo ranks on this host, DTensor ``Shard(0)`` or, with ``--layout plain``,
per-rank plain tensors: 12 large + 128 small float32 tensors, ``--mib`` MiB in all), in the same processes and into the same disk directory
(``--dir``, not tmpfs):

- stock: ``dcp.save(sd, storage_writer=FileSystemWriter(dir))`` barrier to barrier;
- gemini: ``dcp.save(sd, storage_writer=GeminiStorageWriter(persistent="file://dir",
  persist_every=1))`` then ``writer.wait_persisted()`` barrier to barrier (the step's
  ``.metadata`` committed by the background drain), split into the save and the wait.

The repetitions interleave stock and gemini, and the gemini writer is built ``--lead-s``
seconds before the first save (as a trainer builds it, then trains a few steps), so gemini's
first repetition is the first drain of the process; ``--lead-s 0`` shows what is left of
the drain's start (its ``import torch``) when a save follows the writer at once. The last drained step is loaded with plain ``dcp.load`` and
compared bit for bit. ``--warmup`` untimed gemini saves come first (they fill the ring of
``keep + 1`` memory slots, whose pages a trainer's first saves fault in once); the first of
them is the first drain of the process, reported as the drain's wait alone (save returned ->
durable) against the timed ones. Writes ``benchmarks/results/persist-save.json`` with the medians, the
ratio, the first drain against the later ones, and the host's load (``uptime``).

    PYTHONPATH=$PWD python benchmarks/bench_persist_save.py --mib 1024 --reps 3 --worlds 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, median, shm_dir, spawn, write_json  # noqa: E402

N_LARGE, N_SMALL = 12, 128


def build_state(total: int, rank: int, world: int, layout: str = "dtensor") -> dict[str, Any]:
    """``total`` bytes over all ranks: DTensors ``Shard(0)`` (``dtensor``), or per-rank plain tensors (``plain``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    small_elems = max(world, (total // 16) // N_SMALL // 4 // world * world)
    large_elems = max(world, (total - small_elems * 4 * N_SMALL) // N_LARGE // 4 // world * world)
    g = torch.Generator().manual_seed(1234 + (rank if layout == "plain" else 0))
    sd: dict[str, Any] = {}
    if layout == "plain":  # each rank its own tensors (names apart, so DCP dedups nothing)
        for i in range(N_LARGE):
            sd[f"r{rank}.large.{i}"] = torch.randn(large_elems // world, generator=g)
        for i in range(N_SMALL):
            sd[f"r{rank}.small.{i}"] = torch.randn(small_elems // world, generator=g)
        return sd
    mesh = init_device_mesh("cpu", (world,))
    for i in range(N_LARGE):
        sd[f"large.{i}"] = distribute_tensor(torch.randn(large_elems, generator=g), mesh, [Shard(0)])
    for i in range(N_SMALL):
        sd[f"small.{i}"] = distribute_tensor(torch.randn(small_elems, generator=g), mesh, [Shard(0)])
    return sd


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def rank_main(rank: int, world: int, *, total: int, reps: int, disk: str, tier: str, lead_s: float,
              warmup: int, layout: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from gemini_dcp import GeminiStorageWriter

    sd = build_state(total, rank, world, layout)

    def wait_durable(w: Any, step: int) -> None:
        """``wait_persisted``; on a gemini_dcp without it (a baseline run), poll the store for the step."""
        if hasattr(w, "wait_persisted"):
            w.wait_persisted()
            return
        while step not in w.persistent.committed_steps():
            time.sleep(0.02)
    job = f"bench-w{world}"
    store = Path(disk, "gemini")
    writer = GeminiStorageWriter(root=tier, job_id=job, persistent=f"file://{store}", persist_every=1, persist_keep=2)
    time.sleep(lead_s)  # a trainer's work between building its writer and its first save
    # Warm-up saves fill the ring of keep + 1 memory slots (a trainer's first saves fault their
    # pages in once); each is drained and waited for. The first one is the first drain of the process.
    warm_save: list[float] = []
    warm_wait: list[float] = []
    for step in range(-warmup, 0):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer, checkpoint_id=step + warmup + 1000)
        t1 = time.perf_counter()
        wait_durable(writer, step + warmup + 1000)
        dist.barrier()
        warm_save.append(t1 - t0)
        warm_wait.append(time.perf_counter() - t1)
    dist.barrier()
    stock_s: list[float] = []
    save_s: list[float] = []
    durable_s: list[float] = []
    wait_s: list[float] = []
    for i in range(reps):
        target = Path(disk, f"stock-{i}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=FileSystemWriter(str(target)))
        dist.barrier()
        stock_s.append(time.perf_counter() - t0)
        step = 2000 + i
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer, checkpoint_id=step)
        t1 = time.perf_counter()
        wait_durable(writer, step)
        dist.barrier()
        t2 = time.perf_counter()
        save_s.append(t1 - t0)
        durable_s.append(t2 - t0)
        wait_s.append(t2 - t1)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
    # bit-exact: the drained step loads with plain dcp.load
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=str(store / job / f"step-{2000 + reps - 1}"))
    exact = all(torch.equal(_local(back[k]), _local(sd[k])) for k in sd)
    try:  # what the drain server reported per step (stage/write/upload seconds), for the record
        status = json.loads(Path(tier, job, "persist", "status.json").read_bytes())["steps"]
        drain = {k: {f: v for f, v in e.items() if f.endswith("seconds") or f == "state"} for k, e in status.items()}
        staged = {k: json.loads(Path(tier, job, "persist", "stage", f"step-{int(k):012d}", "staged").read_bytes())
                  for k in status if Path(tier, job, "persist", "stage", f"step-{int(k):012d}", "staged").exists()}
    except (OSError, ValueError, KeyError):
        drain, staged = {}, {}
    return {"drain_status": drain, "staged_pending": staged, "stock_s": stock_s, "gemini_save_s": save_s, "gemini_durable_s": durable_s, "gemini_wait_s": wait_s,
            "warmup_save_s": warm_save, "warmup_wait_s": warm_wait, "bit_exact": exact}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="state size in MiB, all ranks together")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--lead-s", type=float, default=3.0,
                    help="seconds between building the writer and the first save (a trainer's first steps)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed gemini saves first (fill the keep + 1 slots)")
    ap.add_argument("--layout", choices=("dtensor", "plain"), default="dtensor",
                    help="DTensor Shard(0) (the stock planner's DTensor path costs both sides alike) or plain tensors")
    ap.add_argument("--dir", default=None, help="disk directory for both stores (default: a fresh one under /tmp)")
    ap.add_argument("--out", default=str(RESULTS / "persist-save.json"))
    args = ap.parse_args()
    out: dict[str, Any] = {"mib": args.mib, "reps": args.reps, "lead_s": args.lead_s, "layout": args.layout, "uptime_before": uptime(), "cpus": os.cpu_count(),
                           "drain_env": {k: v for k, v in os.environ.items() if k.startswith("GEMINI_DCP_DRAIN")},
                           "worlds": {}}
    for world in args.worlds:
        disk = tempfile.mkdtemp(prefix="gemini-bench-persist-", dir=args.dir or "/tmp")
        tier = shm_dir("gemini-bench-persist-tier")
        try:
            res = spawn(rank_main, world, total=args.mib << 20, reps=args.reps, disk=disk, tier=str(tier),
                        lead_s=args.lead_s, warmup=args.warmup, layout=args.layout)
        finally:
            shutil.rmtree(disk, ignore_errors=True)
            shutil.rmtree(tier, ignore_errors=True)
        r0 = res[0]
        stock, durable = median(r0["stock_s"]), median(r0["gemini_durable_s"])
        row = {
            **r0, "stock_median_s": stock, "gemini_durable_median_s": durable,
            "gemini_save_median_s": median(r0["gemini_save_s"]), "ratio": durable / stock if stock else None,
            # the drain alone (save returned -> .metadata committed): the first of the process vs the timed ones
            "first_drain_wait_s": r0["warmup_wait_s"][0] if r0["warmup_wait_s"] else None,
            "later_drain_wait_median_s": median(r0["gemini_wait_s"]),
            "bit_exact_all_ranks": all(r["bit_exact"] for r in res), "uptime_after": uptime(),
        }
        print(f"world {world}: stock {stock:.3f} s, gemini until durable {durable:.3f} s (save "
              f"{row['gemini_save_median_s']:.3f} s) -> {row['ratio']:.2f}x; drain wait: first {row['first_drain_wait_s']} s, "
              f"later {row['later_drain_wait_median_s']:.3f} s; bit-exact {row['bit_exact_all_ranks']}; {row['uptime_after']}",
              flush=True)
        out["worlds"][str(world)] = row
    out["uptime_after"] = uptime()
    write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
