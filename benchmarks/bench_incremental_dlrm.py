"""Incremental saves of a torchrec DLRM (issue 23): row deltas vs full saves, and a rows-touched sweep.

    python benchmarks/bench_incremental.py --dlrm                  # 2 x 512 MiB tables, 2 nodes, replicas=2
    python benchmarks/bench_incremental.py --dlrm --rows 65536 --quick   # smoke run, no files written

Two gloo ranks (spawned processes), each its own simulated node (its own tier root),
``replicas=2``. The model is torchrec's ``DLRM`` (dense arch 13 -> 256 -> 128, over arch 512 ->
1) wrapped in ``DistributedModelParallel``: two embedding tables of ``--rows`` x 128 float32
(default 1M rows: 512 MiB each, 1 GiB in all), table-wise (one per rank), updated by torchrec's
fused row-wise Adagrad in the backward kernel (``apply_optimizer_in_backward``), the dense part
data-parallel with SGD. The saved state is ``{"model": dmp.state_dict(), "optim":
dmp.fused_optimizer.state_dict()}`` (tables + per-row Adagrad state + dense weights).

One writer, ``GeminiStorageWriter(keep=1, replicas=2, incremental=True, full_every=K)``: every
K-th save is a full save (the base refresh: every byte copied and replicated, what
``incremental=False`` does every save), the others write the rows that differ from the slot's
(the save ``keep + 1`` = 2 steps earlier) and send only those rows to the peer. Full and row-delta
saves therefore alternate in the same processes, into the same slots (one ring per node: a second
writer for the baseline would double the tier memory of a 1 GiB model on the shared machine).

Each training step looks up a batch of 2048 samples with ``pooling`` ids per table drawn uniformly
from the table's rows; the realistic batch (pooling 20) touches ~4% of each table's rows per
step. The sweep varies pooling so that 0.5% .. 25% of rows are touched per step; after each change
one save is dropped (its rows span two settings). Reported per setting: ``dcp.save`` wall time
(barrier to barrier; median) of the full and the row-delta saves, bytes written into the tier and
sent to the peer (rank 0), rows written.

Restore after a node loss: the last two steps are a full save and then a row-delta save; node 1's
memory is wiped and both ranks load each step into a zeroed model (rank 1 from node 0's replica,
built by applying row deltas for the delta step); bit-exact against the trained state, and the
load throughput of each.

Writes benchmarks/results/incremental_dlrm.json and docs/img/bench_incremental_dlrm.png.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import common
from common import median

ROOT = Path(__file__).resolve().parent.parent
DIM = 128
BATCH = 2048
DENSE_IN = 13
JOB = "bench-dlrm"


def _build(world: int, rows: int) -> Any:
    import torch
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"])
              for i in range(2)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[256, DIM],
                 over_arch_layer_sizes=[512, 1], dense_device=torch.device("cpu"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05})
    cons = {f"t{i}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for i in range(2)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints=cons)
    return DistributedModelParallel(model, device=torch.device("cpu"),
                                    plan=planner.collective_plan(model, None, dist.GroupMember.WORLD))


def _state(dmp: Any) -> dict[str, Any]:
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def _locals(sd: dict[str, Any]) -> dict[str, Any]:
    """This rank's tensors of the state (local shards of sharded values), by flattened name."""
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif hasattr(v, "local_shards"):
            for j, s in enumerate(v.local_shards()):
                out[f"{prefix}#{j}"] = s.tensor
        elif hasattr(v, "detach"):
            out[prefix] = v
    walk("", sd)
    return out


def _rank(rank: int, world: int, roots: list[str], rows: int, full_every: int, cycles: int,
          poolings: list[int], realistic: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    root = roots[rank]
    t0 = time.perf_counter()
    dmp = _build(world, rows)
    build_s = time.perf_counter() - t0
    dense_params = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    opt = torch.optim.SGD(dense_params, lr=0.01)
    gen = torch.Generator().manual_seed(7)  # the same batches on both ranks (any would do)
    mine = _locals(_state(dmp))
    state_bytes = sum(t.numel() * t.element_size() for t in mine.values())

    def train(pooling: int) -> int:
        ids = torch.randint(0, rows, (2, BATCH * pooling), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1"], values=ids.reshape(-1), lengths=torch.full((2 * BATCH,), pooling, dtype=torch.int64))
        dense = torch.randn(BATCH, DENSE_IN, generator=gen)
        labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
        logits = dmp(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()  # the tables and their Adagrad state: updated here, by the fused kernel
        opt.step()
        return int(torch.unique(ids[rank]).numel())  # rows of this rank's table touched

    w = GeminiStorageWriter(root, JOB, keep=1, replicas=2, incremental=True, full_every=full_every, timeout_s=600)
    step = 0
    samples: list[dict[str, Any]] = []

    def save(pooling: int, record: bool) -> None:
        nonlocal step
        touched = train(pooling)
        sd = _state(dmp)
        s = step
        secs = common.timed(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=s))
        st = w.last_save
        rep = dict(w.commit.last_replication)
        assert st is not None
        if record:
            samples.append({"pooling": pooling, "step": s, "seconds": secs, "full": st.full, "reason": st.reason,
                            "bytes_written": st.bytes_written, "bytes_carried": st.bytes_carried,
                            "rows_written": st.rows_written, "rows_total": st.rows_total, "touched_rows": touched,
                            "sent_bytes": rep.get("sent_bytes", 0), "replication_s": rep.get("seconds")})
        step += 1

    for _ in range(2):  # the ring's first writes (full)
        save(realistic, False)
    for pooling in poolings:
        save(pooling, False)  # its rows span the previous setting and this one
        save(pooling, False)
        for _ in range(cycles * full_every):
            save(pooling, True)
    # Restore after a node loss: the newest two steps are a full save, then a row-delta save.
    while not (w.last_save is not None and w.last_save.full):
        save(realistic, False)
    full_step = step - 1
    snap_full = {k: v.detach().clone() for k, v in _locals(_state(dmp)).items()}
    save(realistic, True)
    delta_step = step - 1
    assert w.last_save is not None and not w.last_save.full
    snap_delta = {k: v.detach().clone() for k, v in _locals(_state(dmp)).items()}
    dist.barrier()
    if rank == 1:  # node 1 replaced: its bytes come back from node 0's replica
        shutil.rmtree(Path(root) / JOB)
    dist.barrier()
    restores: dict[str, Any] = {}
    which = {"full": (full_step, snap_full), "row_delta": (delta_step, snap_delta)}
    for name in ("full", "row_delta", "row_delta", "full"):  # alternated: the first load's warm-up is shared out
        s, snap = which[name]
        sd = _state(dmp)
        for t in _locals(sd).values():
            t.detach().zero_()
        reader = GeminiStorageReader(root, JOB)
        secs = common.timed(lambda sd=sd, s=s, reader=reader: dcp.load(sd, storage_reader=reader, checkpoint_id=s))
        got = _locals(sd)
        ok = sorted(got) == sorted(snap) and all(torch.equal(got[k], snap[k]) for k in snap)
        r = restores.setdefault(name, {"step": s, "bytes": state_bytes, "seconds_passes": [], "bit_exact": True})
        r["seconds_passes"].append(secs)
        r["seconds"] = median(r["seconds_passes"])
        r["bit_exact"] = r["bit_exact"] and ok
        r["restored_from"] = dict(reader.restored_from)
    return {"state_bytes": state_bytes, "build_s": build_s, "samples": samples, "restores": restores,
            "tables": {k: list(v.shape) for k, v in mine.items() if v.dim() == 2 and v.shape[0] == rows}}


def _summary(samples: list[dict[str, Any]], poolings: list[int], rows: int) -> list[dict[str, Any]]:
    out = []
    for p in poolings:
        xs = [x for x in samples if x["pooling"] == p]
        full = [x for x in xs if x["full"]]
        delta = [x for x in xs if not x["full"]]
        if not full or not delta:
            continue
        f_s, d_s = median(x["seconds"] for x in full), median(x["seconds"] for x in delta)
        f_b, d_b = median(x["bytes_written"] for x in full), median(x["bytes_written"] for x in delta)
        f_n, d_n = median(x["sent_bytes"] for x in full), median(x["sent_bytes"] for x in delta)
        assert f_s and d_s and f_b and f_n and d_b is not None and d_n is not None
        out.append({
            "pooling": p, "touched_per_step": median(x["touched_rows"] for x in delta) / rows,
            "rows_written_share": median(x["rows_written"] / max(1, x["rows_total"]) for x in delta),
            "full_save_s": f_s, "delta_save_s": d_s, "save_time_ratio": d_s / f_s,
            "full_save_s_range": common.spread(x["seconds"] for x in full),
            "delta_save_s_range": common.spread(x["seconds"] for x in delta),
            "full_bytes_written": f_b, "delta_bytes_written": d_b, "bytes_written_ratio": d_b / f_b,
            "full_sent_bytes": f_n, "delta_sent_bytes": d_n, "peer_bytes_ratio": d_n / f_n,
            "n_full": len(full), "n_delta": len(delta),
        })
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["sweep"]
    x = [100 * r["touched_per_step"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot(x, [100 * r["save_time_ratio"] for r in rows], "o-", label="save time")
    a1.plot(x, [100 * r["peer_bytes_ratio"] for r in rows], "s-", label="bytes sent to the peer")
    a1.plot(x, [100 * r["bytes_written_ratio"] for r in rows], "^-", label="bytes written into the tier")
    a1.axvline(100 * data["realistic_touched"], color="grey", ls=":", label="realistic batch")
    a1.set_xscale("log")
    a1.set_xlabel("rows touched per step (% of each table)")
    a1.set_ylabel("row-delta save, % of a full save (same run)")
    a1.set_title(f"DLRM, 2 x {data['table_bytes'] >> 20} MiB tables, keep=1, replicas=2", fontsize=9)
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.plot(x, [r["full_save_s"] for r in rows], "o-", label="full save (full_every)")
    a2.plot(x, [r["delta_save_s"] for r in rows], "s-", label="row-delta save")
    a2.set_xscale("log")
    a2.set_xlabel("rows touched per step (% of each table)")
    a2.set_ylabel("dcp.save wall time, s (median)")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def run(rows: int, full_every: int, cycles: int, poolings: list[int], realistic: int, quick: bool,
        json_path: Path | None, png_path: Path | None) -> None:
    poolings = sorted({*poolings, realistic})
    table = rows * DIM * 4
    common.require_memory(8 * table + (2 << 30), "2 tables, their rings and replicas, snapshots")
    roots = [str(common.shm_dir(f"gemini-bench-dlrm{i}-")) for i in range(2)]
    load = common.loadavg()
    t0 = time.perf_counter()
    try:
        res = common.spawn(_rank, 2, roots=roots, rows=rows, full_every=full_every, cycles=cycles, poolings=poolings,
                           realistic=realistic, timeout=3600)
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    r0 = res[0]
    sweep = _summary(r0["samples"], poolings, rows)
    real = next(s for s in sweep if s["pooling"] == realistic)
    data = {
        "what": "torchrec DLRM (2 tables, table-wise, fused row-wise Adagrad) on 2 gloo ranks / 2 simulated nodes, "
                "replicas=2, keep=1; one incremental writer with full_every=K: full saves (the base refresh) and "
                "row-delta saves alternate in the same run; rank 0's figures",
        "rows_per_table": rows, "dim": DIM, "table_bytes": table, "total_table_bytes": 2 * table,
        "batch": BATCH, "realistic_pooling": realistic, "realistic_touched": real["touched_per_step"],
        "full_every": full_every, "cycles": cycles, "state_bytes_per_rank": [r["state_bytes"] for r in res],
        "sweep": sweep, "realistic": real,
        "restore_after_node_loss": {"rank0": r0["restores"], "rank1": res[1]["restores"]},
        "restore_bit_exact": all(v["bit_exact"] for r in res for v in r["restores"].values()),
        "samples_rank0": r0["samples"], "load_before": load, "load_after": common.loadavg(),
        "wall_s": time.perf_counter() - t0, "machine": common.machine_info(),
    }
    print(f"tables 2 x {table / 2**20:.0f} MiB, state per rank {r0['state_bytes'] / 2**20:.1f} MiB; load {load}")
    for s in sweep:
        print(f"touched {100 * s['touched_per_step']:6.2f}%/step rows written {100 * s['rows_written_share']:6.2f}%  "
              f"save full {s['full_save_s']:.3f} s delta {s['delta_save_s']:.3f} s ({s['save_time_ratio']:.2f}x)  "
              f"written {s['delta_bytes_written'] / 2**20:8.1f}/{s['full_bytes_written'] / 2**20:.1f} MiB  "
              f"peer {s['delta_sent_bytes'] / 2**20:8.1f}/{s['full_sent_bytes'] / 2**20:.1f} MiB ({s['peer_bytes_ratio']:.3f})")
    for r, res_r in enumerate(res):
        for name, v in res_r["restores"].items():
            gbs = v["bytes"] / v["seconds"] / 1e9
            print(f"rank {r} restore {name:9s} step {v['step']}: {v['seconds']:.3f} s {v['seconds_passes']} ({gbs:.2f} GB/s) "
                  f"bit-exact {v['bit_exact']} from {v['restored_from']}")
    json_path = json_path or (None if quick else ROOT / "benchmarks/results/incremental_dlrm.json")
    png_path = png_path or (None if quick else ROOT / "docs/img/bench_incremental_dlrm.png")
    if json_path is not None:
        common.write_json(json_path, data)
        print("wrote", json_path)
    if png_path is not None:
        try:
            plot(data, png_path)
            print("wrote", png_path)
        except ImportError:
            print("matplotlib is not installed: no plot")


#: Shares of a table's rows looked up per step in the sweep; the realistic batch is REALISTIC.
SHARES = (0.005, 0.01, 0.02, 0.04, 0.1, 0.25)
REALISTIC = 0.04


def pooling_for(share: float, rows: int) -> int:
    """Ids per sample and table so that a batch looks up ~``share`` of ``rows`` (with repeats)."""
    return max(1, round(share * rows / BATCH))


if __name__ == "__main__":  # pragma: no cover - use bench_incremental.py --dlrm
    raise SystemExit("run: python benchmarks/bench_incremental.py --dlrm")
