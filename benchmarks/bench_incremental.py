"""Incremental saves (issue 23): a 90%-frozen model's per-step save, full vs incremental, same run.

    python benchmarks/bench_incremental.py               # 256 MiB per rank, 2 ranks on 2 nodes, replicas=2
    python benchmarks/bench_incremental.py --mib 64 --rounds 5 --quick   # smoke run, no files written
    python benchmarks/bench_incremental.py --dlrm        # torchrec DLRM, row deltas (bench_incremental_dlrm.py)

Two gloo ranks (spawned processes, one intra-op thread each), each its own simulated node (its own
tier root), ``replicas=2``: every save copies into the local tier and replicates to the other node.
Each rank holds a LoRA-style transformer stack: per layer four frozen ``d x d`` float32 matrices
(sharded as per-rank keys) and trainable low-rank adapters sized so that the trainable bytes are
1/10 of the state (90% frozen). Every "training step" updates the trainable tensors in place
(``add_`` under ``no_grad``, what an optimizer step does).

In the same processes, alternating per round (the machine is shared, so figures drift; alternating
cancels most of it), two writers save the same state into two job ids:

* ``full``: ``GeminiStorageWriter(keep=2, replicas=2)`` (the default, ``incremental=False``);
* ``incremental``: the same with ``incremental=True``.

Both are warmed for ``keep + 1`` saves first (every slot of the ring written once: the incremental
writer's warm-up saves are full, docs/incremental.md). Reported per writer: the ``dcp.save`` wall time
(barrier to barrier, median and [min, max] over rounds), ``last_save.bytes_written`` /
``bytes_carried`` and the replication bytes sent (``last_replication``); then ratios
incremental / full. A final check restores the newest incremental step after wiping node 1 (its
ranks restore from node 0's delta-built replica) and compares it bit-exact.

Writes benchmarks/results/incremental.json and docs/img/bench_incremental.png (matplotlib if
installed, else the plot is skipped with a message).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import fmt, median, spread  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FROZEN_SHARE = 0.9


def make_state(rank: int, mib: int, layers: int = 4) -> dict[str, Any]:
    """Per-rank keys (each rank saves its own): frozen ``d x d`` matrices and trainable adapters."""
    import torch

    g = torch.Generator().manual_seed(rank)
    per_layer = mib * (1 << 20) // layers
    d = int((per_layer * FROZEN_SHARE / 4 / 4) ** 0.5)  # four frozen d x d float32 matrices per layer
    trainable = per_layer * (1 - FROZEN_SHARE) / 4  # float32 elements of the adapters, per layer
    r = max(1, int(trainable / (4 * 2 * d)))  # four adapters (A: r x d, B: d x r) per layer
    sd: dict[str, Any] = {}
    for layer in range(layers):
        for m in ("q", "k", "v", "o"):
            sd[f"r{rank}.l{layer}.{m}.weight"] = torch.randn(d, d, generator=g)
            sd[f"r{rank}.l{layer}.{m}.lora_a"] = torch.randn(r, d, generator=g)
            sd[f"r{rank}.l{layer}.{m}.lora_b"] = torch.randn(d, r, generator=g)
    return sd


def _rank(rank: int, world: int, roots: list[str], mib: int, rounds: int, keep: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    root = roots[rank]
    sd = make_state(rank, mib)
    trainable = [v for k, v in sd.items() if "lora" in k]
    total = sum(v.numel() * v.element_size() for v in sd.values())
    frozen = sum(v.numel() * v.element_size() for k, v in sd.items() if "lora" not in k)
    writers = {
        "full": GeminiStorageWriter(root, "bench-full", keep=keep, replicas=2, timeout_s=300),
        "incremental": GeminiStorageWriter(root, "bench-incr", keep=keep, replicas=2, incremental=True, timeout_s=300),
    }
    step = 0
    out: dict[str, Any] = {"state_bytes": total, "frozen_bytes": frozen, "ops": {}}
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in writers}

    def train() -> None:
        with torch.no_grad():
            for t in trainable:
                t.add_(1e-3)

    for name, w in writers.items():  # warm-up: every slot of the ring once (incremental: full saves)
        for _ in range(keep + 1):
            train()
            dcp.save(sd, storage_writer=w, checkpoint_id=step)
            step += 1
    for i in range(rounds):
        order = list(writers) if i % 2 == 0 else list(reversed(writers))
        for name in order:
            w = writers[name]
            train()
            s = step
            secs = common.timed(lambda w=w, s=s: dcp.save(sd, storage_writer=w, checkpoint_id=s))
            step += 1
            st = w.last_save
            assert st is not None
            rep = dict(w.commit.last_replication)
            samples[name].append({"seconds": secs, "bytes_written": st.bytes_written, "bytes_carried": st.bytes_carried,
                                  "sent_bytes": rep.get("sent_bytes", 0), "replication_s": rep.get("seconds")})
    # The floor: an incremental save with nothing changed (planning, collectives, record; no copy).
    floor = []
    for _ in range(rounds):
        w = writers["incremental"]
        s = step
        floor.append(common.timed(lambda w=w, s=s: dcp.save(sd, storage_writer=w, checkpoint_id=s)))
        step += 1
    out["nothing_changed_save_s"] = median(floor)
    out["nothing_changed_save_s_range"] = spread(floor)
    for name, xs in samples.items():
        secs = [x["seconds"] for x in xs]
        out["ops"][name] = {
            "save_s": median(secs), "save_s_range": spread(secs),
            "bytes_written": xs[-1]["bytes_written"], "bytes_carried": xs[-1]["bytes_carried"],
            "sent_bytes": xs[-1]["sent_bytes"], "replication_s": median([x["replication_s"] or 0.0 for x in xs]),
        }
    newest = writers["incremental"].commit.last_committed_step
    expect = {k: v.clone() for k, v in sd.items()}
    dist.barrier()
    if rank == 1:  # node 1 replaced: its bytes come back from node 0's (delta-built) replica
        shutil.rmtree(Path(root) / "bench-incr")
    dist.barrier()
    for v in sd.values():
        v.fill_(-1.0)
    dcp.load(sd, storage_reader=GeminiStorageReader(root, "bench-incr"), checkpoint_id=newest)
    out["restore_bit_exact"] = all(torch.equal(sd[k], expect[k]) for k in sd)
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    """Incremental as a percentage of full (rank 0), with the 15% target of the issue as a line."""
    r0 = data["ranks"][0]["ops"]
    full, incr = r0["full"], r0["incremental"]
    ratios = data["ratios_incremental_over_full_rank0"]
    common.bar_chart(
        path, ["save time", "bytes copied", "bytes replicated"],
        [100 * ratios["save_time"], 100 * ratios["bytes_written"], 100 * ratios["replication_bytes"]],
        title=f"90%-frozen state, {data['mib_per_rank']} MiB/rank, 2 nodes, replicas=2: incremental as % of full",
        ylabel="% of a full save (same run)", colors=["#4C72B0", "#55A868", "#C44E52"], hlines=[(15.0, "15% target")],
        annotate=[f"{incr['save_s']:.3f} s / {full['save_s']:.3f} s",
                  f"{incr['bytes_written'] / 2**20:.1f} / {full['bytes_written'] / 2**20:.1f} MiB",
                  f"{incr['sent_bytes'] / 2**20:.1f} / {full['sent_bytes'] / 2**20:.1f} MiB"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state per rank, MiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="no JSON or plot unless --json/--png")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--dlrm", action="store_true", help="the torchrec DLRM row-delta figures instead")
    ap.add_argument("--rows", type=int, default=1 << 20, help="--dlrm: rows per table (x 128 float32)")
    ap.add_argument("--full-every", type=int, default=4, help="--dlrm: a full save every K saves")
    ap.add_argument("--cycles", type=int, default=2, help="--dlrm: full_every cycles per sweep setting")
    args = ap.parse_args()
    if args.dlrm:
        import bench_incremental_dlrm as dl

        dl.run(args.rows, args.full_every, args.cycles, [dl.pooling_for(s, args.rows) for s in dl.SHARES],
               dl.pooling_for(dl.REALISTIC, args.rows), args.quick, args.json, args.png)
        return
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    roots = [tempfile.mkdtemp(prefix=f"gemini-bench-incr{i}-", dir=base) for i in range(2)]
    try:
        res = common.spawn(_rank, 2, roots=roots, mib=args.mib, rounds=args.rounds, keep=args.keep, timeout=1800)
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    r0 = res[0]
    full, incr = r0["ops"]["full"], r0["ops"]["incremental"]
    ratios = {
        "save_time": incr["save_s"] / full["save_s"],
        "bytes_written": incr["bytes_written"] / max(1, full["bytes_written"]),
        "replication_bytes": incr["sent_bytes"] / max(1, full["sent_bytes"]),
    }
    data = {
        "what": "per-step save of a 90%-frozen LoRA-style state, 2 ranks on 2 simulated nodes, replicas=2, "
                "full (incremental=False) vs incremental=True, alternating in the same run",
        "mib_per_rank": args.mib, "rounds": args.rounds, "keep": args.keep,
        "ranks": res, "ratios_incremental_over_full_rank0": ratios,
        "restore_bit_exact": all(r["restore_bit_exact"] for r in res),
        "machine": common.machine_info(),
    }
    print(f"state per rank {r0['state_bytes'] / 2**20:.1f} MiB ({r0['frozen_bytes'] / r0['state_bytes']:.0%} frozen)")
    for name, op in r0["ops"].items():
        print(f"{name:12s} save {fmt(op['save_s'], '.4f')} s {op['save_s_range']}  written {op['bytes_written'] / 2**20:8.2f} MiB"
              f"  carried {op['bytes_carried'] / 2**20:8.2f} MiB  replicated {op['sent_bytes'] / 2**20:8.2f} MiB")
    print(f"incremental save with nothing changed (the fixed cost of a save): {fmt(r0['nothing_changed_save_s'], '.4f')} s")
    print("incremental / full:", {k: round(v, 3) for k, v in ratios.items()}, "restore bit-exact:", data["restore_bit_exact"])
    json_path = args.json or (None if args.quick else ROOT / "benchmarks/results/incremental.json")
    png_path = args.png or (None if args.quick else ROOT / "docs/img/bench_incremental.png")
    if json_path is not None:
        common.write_json(json_path, data)
        print("wrote", json_path)
    if png_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        plot(data, png_path)
        print("wrote", png_path)


if __name__ == "__main__":
    main()
