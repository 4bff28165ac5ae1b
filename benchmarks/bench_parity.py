"""XOR-parity peer tier benchmark (issue 22): parity vs ``replicas=2``, same state, same simulated nodes.

    python benchmarks/bench_parity.py                # 4 nodes x 1 rank, 16 MiB per rank, 3 rounds
    python benchmarks/bench_parity.py --mib 64 --rounds 5

Four simulated nodes (one rank and one tier root each), gloo on 127.0.0.1, one intra-op
thread per rank, ``parity_group=4`` (one group of 4) vs ``replicas=2`` (mixed placement).

* **save**: after ``keep + 1`` warm-up saves (the ring's slots exist and are faulted in),
  ``rounds`` timed ``dcp.save`` calls per scheme; the writer's ``last_replication`` gives the
  seconds of step 4 (parity encode, or replication) and the bytes each rank sent. In the
  parity run's processes two raw references are measured: ``raw_ring`` (each rank sends its
  S bytes to the next rank and receives S: what replication and parity put on the wire) and
  ``reduce_bxor`` (the parity done as ``dist.reduce(op=BXOR)`` of each stripe to its holder,
  the alternative to pairwise sends the implementation did not take).
* **memory**: parity and data bytes per node as the records and ``inspect`` report them, and
  the sizes of the slot files (rounded to 4 MiB capacity by the slot ring).
* **rebuild**: node 2's tier root wiped, fresh processes ``dcp.load``; ``restored_from`` says
  which bytes came from parity / peers; checked bit-exact; the raw one-way gloo transfer of
  the same bytes in the same processes.

Writes benchmarks/results/parity.json and docs/img/bench_parity.png (matplotlib, when installed).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import median  # noqa: E402

JOB = "bench-parity"
WORLD = 4
LOST = 2


def _kw(scheme: str) -> dict[str, Any]:
    return {"parity_group": 4} if scheme == "parity" else {"replicas": 2}


def save_worker(rank: int, world: int, *, total_bytes: int, rounds: int, keep: int, roots: list[str], scheme: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageWriter

    sd = common.make_state(total_bytes, rank, world, seed=1)
    writer = GeminiStorageWriter(root=roots[rank], job_id=JOB, keep=keep, **_kw(scheme))
    step = [0]

    def save() -> None:
        step[0] += 1
        dcp.save(sd, storage_writer=writer, checkpoint_id=step[0])

    for _ in range(keep + 1):
        save()
    out: dict[str, Any] = {"rank": rank, "save_s": [], "step4_s": [], "sent_bytes": 0}
    for _ in range(rounds):
        out["save_s"].append(common.timed(save))
        out["step4_s"].append(float(writer.commit.last_replication.get("seconds", 0.0)))
        out["sent_bytes"] = int(writer.commit.last_replication.get("sent_bytes", 0))
    out["fingerprint"] = common.fingerprint(sd)
    out["last_step"] = step[0]
    if scheme == "parity":
        n = torch.tensor([int(writer.commit.last_replication.get("sent_bytes", 0)) or 1])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)  # one size on every rank (rank 0 also saves the plain tensors)
        nbytes = int(n.item())
        src = torch.full((nbytes,), 7, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)

        def ring() -> None:
            works = [dist.irecv(dst, src=(rank - 1) % world), dist.isend(src, dst=(rank + 1) % world)]
            for w in works:
                w.wait()

        stripe = -(-nbytes // (world - 1))
        parts = [torch.full((stripe,), rank + 1, dtype=torch.uint8) for _ in range(world)]

        def reduce_bxor() -> None:
            for k in range(world):  # each stripe XOR-reduced onto its parity holder
                dist.reduce(parts[k], dst=k, op=dist.ReduceOp.BXOR)

        out["raw_ring_s"] = [common.timed(ring) for _ in range(rounds)]
        try:
            out["reduce_bxor_s"] = [common.timed(reduce_bxor) for _ in range(rounds)]
        except RuntimeError as exc:  # a gloo build without BXOR
            out["reduce_bxor_error"] = str(exc)
    return out


def restore_worker(rank: int, world: int, *, total_bytes: int, roots: list[str], expect: list[dict[str, int]]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader

    sd = common.make_state(total_bytes, rank, world, seed=2)
    common.scramble(sd)
    readers: list[Any] = []

    def load() -> None:
        reader = GeminiStorageReader(root=roots[rank], job_id=JOB)
        dcp.load(sd, storage_reader=reader)
        readers.append(reader)

    load_s = common.timed(load)
    rd = readers[0]
    out = {"rank": rank, "load_s": load_s, "restored_from": dict(rd.restored_from),
           "bit_exact": common.fingerprint(sd) == expect[rank]}
    nbytes = max(1, int(rd.restored_from.get("parity", 0)) + int(rd.restored_from.get("peer", 0)))
    buf = torch.full((nbytes,), 1, dtype=torch.uint8)

    def oneway() -> None:  # a survivor -> the replaced node, the bytes the restore moved
        if rank == 0:
            dist.send(buf, dst=LOST)
        elif rank == LOST:
            dist.recv(buf, src=0)

    out["raw_oneway_s"] = [common.timed(oneway) for _ in range(2)]
    return out


def _memory(roots: list[Path]) -> list[dict[str, Any]]:
    from gemini_dcp.ops.inspection import inspect_root

    rows = []
    for i, root in enumerate(roots):
        job = inspect_root(root, JOB).jobs[0]
        st = job.steps[-1]
        files = list((root / JOB / "ranks").rglob("*.bin"))
        par = st.parity or {}
        rows.append({
            "node": i, "data_bytes_here": st.bytes_here, "parity_bytes_here": par.get("parity_bytes_here", 0),
            "parity_over_data": (par.get("parity_bytes_here", 0) / st.bytes_here) if st.bytes_here else None,
            "slot_file_bytes": sum(f.stat().st_size for f in files if f.name.startswith("slot-")),
            "parity_file_bytes": sum(f.stat().st_size for f in files if f.name.startswith("parity-")),
        })
    return rows


def run_scheme(scheme: str, args: argparse.Namespace, total: int) -> dict[str, Any]:
    base = common.shm_dir(f"bench-parity-{scheme}-")
    roots = [base / f"node{i}" for i in range(WORLD)]
    for r in roots:
        r.mkdir(mode=0o700)
    try:
        save = common.spawn(save_worker, WORLD, total_bytes=total, rounds=args.rounds, keep=args.keep,
                            roots=[str(r) for r in roots], scheme=scheme)
        memory = _memory(roots)
        shutil.rmtree(roots[LOST])
        roots[LOST].mkdir(mode=0o700)
        restore = common.spawn(restore_worker, WORLD, total_bytes=total, roots=[str(r) for r in roots],
                               expect=[s["fingerprint"] for s in save])
    finally:
        common.remove_dir(base)
    rank_bytes = save[0]["sent_bytes"] if scheme == "parity" else save[1]["sent_bytes"]
    moved = restore[0]["restored_from"].get("parity", 0) + restore[0]["restored_from"].get("peer", 0)
    out = {
        "scheme": scheme,
        "save_s": median(max(s["save_s"][i] for s in save) for i in range(args.rounds)),
        "step4_s": median(max(s["step4_s"][i] for s in save) for i in range(args.rounds)),
        "sent_bytes_per_node": [s["sent_bytes"] for s in save],
        "memory": memory,
        "load_s": max(r["load_s"] for r in restore),
        "restored_from": restore[0]["restored_from"],
        "bit_exact": all(r["bit_exact"] for r in restore),
        "raw_oneway_s": median(max(r["raw_oneway_s"][i] for r in restore) for i in range(2)),
        "rebuild_gbps": moved / max(r["load_s"] for r in restore) / 1e9,
        "rank_bytes": rank_bytes,
    }
    out["raw_oneway_gbps"] = moved / out["raw_oneway_s"] / 1e9 if out["raw_oneway_s"] else None
    if scheme == "parity":
        out["raw_ring_s"] = median(max(s["raw_ring_s"][i] for s in save) for i in range(args.rounds))
        if "reduce_bxor_s" in save[0]:
            out["reduce_bxor_s"] = median(max(s["reduce_bxor_s"][i] for s in save) for i in range(args.rounds))
        else:
            out["reduce_bxor_error"] = save[0].get("reduce_bxor_error")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=16, help="MiB per rank (4 ranks).")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "parity.json")
    ap.add_argument("--png", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "img" / "bench_parity.png")
    args = ap.parse_args(argv)
    total = args.mib * WORLD << 20
    res = {s: run_scheme(s, args, total) for s in ("parity", "replicas2")}
    p, r = res["parity"], res["replicas2"]
    summary = {
        "machine": common.machine_info(), "loadavg": common.loadavg(), "mib_per_rank": args.mib, "rounds": args.rounds,
        "nodes": WORLD, "parity": p, "replicas2": r,
        "save_parity_over_replicas2": r["save_s"] / p["save_s"],  # throughput ratio (same bytes saved)
        "step4_parity_over_replicas2": r["step4_s"] / p["step4_s"],
        "rebuild_over_replicas2_restore": p["rebuild_gbps"] / r["rebuild_gbps"],
        "reduce_bxor_over_pairwise": (p.get("reduce_bxor_s") or 0) / p["step4_s"] if p.get("reduce_bxor_s") else None,
    }
    common.write_json(args.json, summary)
    print(f"{args.mib} MiB per rank, 4 nodes x 1 rank (load average {summary['loadavg']})")
    for s in (p, r):
        mem = s["memory"][0]
        print(f"  {s['scheme']:>9}: save {s['save_s']:.3f} s (step 4 {s['step4_s']:.3f} s, sent {s['sent_bytes_per_node']} B/node); "
              f"node 0 parity/data {mem['parity_bytes_here']}/{mem['data_bytes_here']} B, files slot {mem['slot_file_bytes']} "
              f"parity {mem['parity_file_bytes']} B; lost-node load {s['load_s']:.3f} s from {s['restored_from']} "
              f"({s['rebuild_gbps']:.3f} GB/s; raw one-way {s['raw_oneway_gbps'] or 0:.3f} GB/s) bit-exact {s['bit_exact']}")
    print(f"  save throughput parity / replicas=2: {summary['save_parity_over_replicas2']:.2f}x; "
          f"rebuild / replicas=2 peer restore: {summary['rebuild_over_replicas2_restore']:.2f}x; "
          f"raw ring {p['raw_ring_s']:.3f} s; reduce(BXOR) {p.get('reduce_bxor_s', float('nan')):.3f} s vs pairwise encode {p['step4_s']:.3f} s")
    try:
        common.bar_chart(
            args.png, ["save parity", "save replicas=2", "rebuild parity", "peer restore replicas=2"],
            [total / 1e9 / p["save_s"], total / 1e9 / r["save_s"], p["rebuild_gbps"], r["rebuild_gbps"]],
            title=f"parity g=4 vs replicas=2, 4 nodes x {args.mib} MiB (GB/s, same run)",
        )
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
