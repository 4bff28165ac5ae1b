"""Row deltas of sharded embedding tables (issue 23, docs/incremental.md "Row deltas").

Unit tests of the row compare-and-copy and of the packed peer offer; then real torchrec
processes (DistributedModelParallel, table-wise, gloo, fused row-wise Adagrad applied in the
backward kernel) on two simulated nodes with ``replicas=2``: rows written = rows that differ,
bit-exact restores (own slot, a wiped node from its peer's delta-built replica), a restart
(new writer processes), a corrupt carried row caught.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gemini_dcp.core.checksum import checksum
from gemini_dcp.peer.delta import packed_rows
from gemini_dcp.save.row_delta import copy_changed_rows, is_row_item, row_geometry

JOB = "rows"


# ---- unit: the compare-and-copy ------------------------------------------------------------------
@pytest.mark.parametrize(("shape", "dtype"), [((1000, 32), torch.float32), ((777, 3), torch.float32),
                                              ((513, 5), torch.uint8), ((4096,), torch.float32),
                                              ((300, 7), torch.float16)])
@pytest.mark.parametrize("algo", ["xxh3", "crc32c"])
def test_copy_changed_rows_writes_exactly_the_differing_rows(shape: tuple[int, ...], dtype: torch.dtype, algo: str) -> None:
    g = torch.Generator().manual_seed(3)
    src = (torch.randn(shape, generator=g) * 50).to(dtype)
    n = src.numel() * src.element_size()
    base = torch.empty(n + 3, dtype=torch.uint8)  # an odd offset: the byte compare path too
    for off in (0, 3):
        dst = base[off : off + n]
        dst.copy_(src.reshape(-1).view(torch.uint8))
        old = src.clone()
        rows = torch.unique(torch.randint(0, shape[0], (max(1, shape[0] // 40),), generator=g))
        src[rows] = (src[rows].float() + 1).to(dtype)
        really = (src.reshape(shape[0], -1).view(torch.uint8) != old.reshape(shape[0], -1).view(torch.uint8)).any(1)
        cs, delta = copy_changed_rows(dst, src, algo, block=4096)
        assert torch.equal(dst, src.reshape(-1).view(torch.uint8))
        assert cs == checksum(dst, algo)
        assert torch.equal(delta.changed, really.nonzero().view(-1))
        assert delta.bytes_written == int(really.sum()) * (n // shape[0])
        cs2, none = copy_changed_rows(dst, src, algo)  # nothing changed since: nothing written
        assert cs2 == cs and none.changed.numel() == 0


def test_row_geometry_and_row_items() -> None:
    assert row_geometry(torch.zeros(10, 4)) == (10, 16)
    assert row_geometry(torch.zeros(10, 4).t()) is None  # not contiguous
    assert row_geometry(torch.zeros(())) is None and row_geometry(torch.zeros(0, 4)) is None
    assert not is_row_item(torch.zeros(3)) and not is_row_item({"a": 1})
    with pytest.raises(ValueError, match="dst must be"):
        copy_changed_rows(torch.zeros(3, dtype=torch.uint8), torch.zeros(2, 2), "xxh3")


def test_packed_offer_checked_against_the_slot() -> None:
    """A packed row offer comes over the wire: it must fit the slot and name rows of the table."""
    idx = torch.tensor([0, 5, 9], dtype=torch.int32).numpy().tobytes()
    off, length, rb, rows = packed_rows((64, 160, 16, idx), 1024)
    assert (off, length, rb, rows.tolist()) == (64, 160, 16, [0, 5, 9])
    for bad, what in [((64, 160, 16, torch.tensor([10], dtype=torch.int32).numpy().tobytes()), "outside"),
                      ((1000, 160, 16, idx), "bad packed"), ((64, 150, 16, idx), "bad packed"),
                      ((64, 160, 0, idx), "bad packed"), ((64, 160, 16, b"\x00"), "bad packed")]:
        with pytest.raises(ValueError, match=what):
            packed_rows(bad, 1024)


# ---- real torchrec processes ---------------------------------------------------------------------
ROWS, DIM = 8192, 64  # 2 MiB per table: above the 1 MiB block, so written as row deltas


def _build(world: int, column_wise: bool = False) -> Any:
    """Two tables (table-wise), or one column-wise in two shards output as DTensor over torchrec's
    ``LocalShardsWrapper`` (``column_wise``)."""
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
              for i in range(2)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})  # fused: updated in the backward
    kind = ShardingType.COLUMN_WISE if column_wise else ShardingType.TABLE_WISE
    cons = {f"t{i}": ParameterConstraints(sharding_types=[kind.value], min_partition=DIM // 2) for i in range(2)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints=cons)
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    env.output_dtensor = column_wise
    return DistributedModelParallel(ebc, device=torch.device("cpu"), env=env,
                                    plan=planner.collective_plan(ebc, None, dist.GroupMember.WORLD))


def _state(model: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def _local(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every local shard of the state (flattened names), cloned."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif hasattr(v, "local_shards"):
            for j, s in enumerate(v.local_shards()):
                out[f"{prefix}#{j}"] = s.tensor.detach().clone()
        elif type(getattr(v, "_local_tensor", None)).__name__ == "LocalShardsWrapper":  # DTensor (output_dtensor)
            for j, t in enumerate(v._local_tensor.local_shards()):
                out[f"{prefix}#{j}"] = t.detach().clone()
    walk("", sd)
    return out


def _step(model: Any, rank: int, step: int) -> None:
    """One training step: ~1% of each table's rows looked up (the same ids on every rank)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 + step)
    n = ROWS // 100
    ids = [torch.randint(0, ROWS, (n,), generator=g) for _ in range(2)]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.cat(ids),
                                              lengths=torch.ones(2 * n, dtype=torch.int64))
    out = model(kjt)
    out.values().pow(2).sum().backward()


def _zeroed(model: Any) -> dict[str, Any]:
    sd = _state(model)
    for top in sd.values():
        stack = [top]
        while stack:
            d = stack.pop()
            for v in d.values():
                if isinstance(v, dict):
                    stack.append(v)
                elif hasattr(v, "local_shards"):
                    for s in v.local_shards():
                        s.tensor.zero_()
                elif type(getattr(v, "_local_tensor", None)).__name__ == "LocalShardsWrapper":
                    for t in v._local_tensor.local_shards():
                        t.zero_()
    return sd


def _rec_phase(rank: int, world: int, root: str, steps: list[int], load_first: bool, keep: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
    from gemini_dcp.ops.verify import verify

    model = _build(world)
    out: dict[str, Any] = {"stats": [], "repl": [], "differ": []}
    if load_first:  # a restarted worker: restore the newest step (node 1 wiped: from node 0's replica)
        sd = _state(model)
        reader = GeminiStorageReader(root, JOB)
        dcp.load(sd, storage_reader=reader)
        model.fused_optimizer.load_state_dict(sd["optim"])
        out["loaded"] = _local(_state(model))
        out["restored_from"] = dict(reader.restored_from)
    w = GeminiStorageWriter(root, JOB, keep=keep, replicas=2, incremental=True, timeout_s=120)
    history: list[dict[str, torch.Tensor]] = []
    for step in steps:
        _step(model, rank, step)
        sd = _state(model)
        now = _local(sd)
        dcp.save(sd, storage_writer=w, checkpoint_id=step)
        out["stats"].append(w.last_save)
        out["repl"].append(dict(w.commit.last_replication))
        # the rows of this rank's big tables that differ from what the slot held (keep + 1 saves ago)
        if len(history) >= keep + 1:
            old = history[-(keep + 1)]
            out["differ"].append(sum(int((now[k].view(now[k].shape[0], -1) != old[k].view(old[k].shape[0], -1)).any(1).sum())
                                     for k in now if now[k].dim() == 2))
        else:
            out["differ"].append(None)
        history.append(now)
    out["final"] = history[-1]
    check = _zeroed(_build(world))
    dcp.load(check, storage_reader=GeminiStorageReader(root, JOB), checkpoint_id=steps[-1])
    got = _local(check)
    out["restored_ok"] = sorted(got) == sorted(history[-1]) and all(torch.equal(got[k], history[-1][k]) for k in got)
    out["verify_ok"] = verify(root, JOB).ok  # own slots and the delta-built replica this node holds
    out["keys"] = sorted(history[-1])
    return out


def test_torchrec_row_deltas_replica_node_loss_and_restart() -> None:
    pytest.importorskip("torchrec")
    from mp_utils import node_root_factory, run_ranks, wipe

    make, cleanup = node_root_factory("gemini-rows-")
    try:
        roots = make(2)
        keep = 1
        first = run_ranks(_rec_phase, 2, roots, timeout=400, steps=list(range(6)), load_first=False, keep=keep)
        table = ROWS * DIM * 4
        for res in first:
            assert res["restored_ok"] and res["verify_ok"]
            assert any(k.endswith("weight#0") for k in res["keys"]) and any("momentum" in k for k in res["keys"]), res["keys"]
            st = res["stats"]
            assert [s.full for s in st[: keep + 1]] == [True] * (keep + 1)
            for s, differ, repl in zip(st[keep + 1 :], res["differ"][keep + 1 :], res["repl"][keep + 1 :]):
                # exactly the rows that differ from the slot's bytes were written: fused updates included
                assert not s.full and s.reason == "incremental" and s.rows_written == differ > 0, (s, differ)
                assert s.rows_total == ROWS and s.bytes_written < table // 4, s
                # the peer got only the written rows of the table (+ the small momentum, copied whole)
                assert repl["delta_pairs"] == 1 and repl["sent_bytes"] == repl["delta_sent_bytes"], repl
                assert repl["sent_bytes"] <= s.bytes_written + 4096, (repl, s)
        wipe(roots[1])  # node 1 replaced: its rank restores from node 0's delta-built replica
        second = run_ranks(_rec_phase, 2, roots, timeout=400, steps=[6, 7, 8, 9], load_first=True, keep=keep)
        for r, res in enumerate(second):
            loaded, want = res["loaded"], first[r]["final"]
            assert sorted(loaded) == sorted(want) and all(torch.equal(loaded[k], want[k]) for k in want)  # bit-exact
            assert res["restored_from"].get("peer", 0) > 0 if r == 1 else True, res["restored_from"]
            st = res["stats"]
            assert st[0].full and st[0].reason == "first save of this writer"  # a new process: full first
            assert not st[-1].full and st[-1].rows_written == res["differ"][-1]
            assert res["restored_ok"] and res["verify_ok"]
    finally:
        cleanup()


def _corrupt_phase(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
    from gemini_dcp.errors import ChecksumMismatchError
    from gemini_dcp.ops.verify import verify

    model = _build(world)
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    for step in range(4):
        _step(model, rank, step)
        dcp.save(_state(model), storage_writer=w, checkpoint_id=step)
    st = w.last_save
    assert st is not None and 0 < st.rows_written < ROWS
    rec = w.tier.record(3)
    fqn = "model.embedding_bags.t0.weight"
    ref = next(v for k, v in rec.metadata.storage_data.items() if k.fqn == fqn)
    slot = rec.slot_of(0)
    # flip a byte of a row this save did NOT write (carried in the slot from an earlier save)
    now = _local(_state(model))["model.embedding_bags.t0.weight#0"]
    raw = open(w.tier.slot_path(0, slot.slot), "rb").read()[ref.offset : ref.offset + ref.length]
    held = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(ROWS, DIM)
    assert torch.equal(held, now)
    with open(w.tier.slot_path(0, slot.slot), "r+b") as f:
        f.seek(ref.offset + 3 * DIM * 4 + 1)
        b = f.read(1)
        f.seek(ref.offset + 3 * DIM * 4 + 1)
        f.write(bytes([b[0] ^ 0x10]))
    report = verify(root, JOB, 3)
    bad = [c.fqn for c in report.items if c.status == "bad"]
    err: BaseException | None = None
    try:
        dcp.load(_zeroed(_build(world)), storage_reader=GeminiStorageReader(root, JOB), checkpoint_id=3)
    except BaseException as exc:  # DCP wraps the package's error in a CheckpointException
        err = exc
    # the next save compares rows with the slot's bytes: the damaged row differs and is written again
    _step(model, rank, 4)
    dcp.save(_state(model), storage_writer=w, checkpoint_id=4)
    _step(model, rank, 5)
    dcp.save(_state(model), storage_writer=w, checkpoint_id=5)  # the damaged slot again (keep=1: ring of 2)
    return {"ok": report.ok, "bad": bad, "caught": err is not None and isinstance(find_gemini_error(err), ChecksumMismatchError),
            "healed": verify(root, JOB, 5).ok}


def test_torchrec_corrupt_carried_row_detected() -> None:
    pytest.importorskip("torchrec")
    from mp_utils import node_root_factory, run_ranks

    make, cleanup = node_root_factory("gemini-rows-bad-")
    try:
        (root,) = make(1)
        (res,) = run_ranks(_corrupt_phase, 1, [root], timeout=300)
        assert not res["ok"] and res["bad"] == ["model.embedding_bags.t0.weight"], res
        assert res["caught"], res
        assert res["healed"], res
    finally:
        cleanup()



def _drain_phase(rank: int, world: int, root: str, store: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageWriter

    model = _build(world)
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True, persistent=f"file://{store}", persist_every=1,
                            persist_keep=1)
    for step in range(4):
        _step(model, rank, step)
        dcp.save(_state(model), storage_writer=w, checkpoint_id=step)
    st = w.last_save
    want = _local(_state(model))
    done = w.wait_persisted(3, timeout_s=180)
    check = _zeroed(_build(world))
    dcp.load(check, checkpoint_id=f"{store}/{JOB}/step-3")  # stock FileSystemReader: no gemini_dcp in the read
    got = _local(check)
    return {"rows_written": st.rows_written if st else None, "persisted": done,
            "ok": sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)}


@pytest.mark.slow  # starts the detached drain server (through library code: the scan cannot see it)
def test_torchrec_row_delta_step_drained_as_stock_dcp() -> None:
    """A row-delta step's slot is complete: the drain writes a stock-DCP step that stock dcp.load reads."""
    pytest.importorskip("torchrec")
    import tempfile

    from mp_utils import node_root_factory, run_ranks

    make, cleanup = node_root_factory("gemini-rows-drain-")
    try:
        (root,) = make(1)
        with tempfile.TemporaryDirectory(prefix="gemini-rows-store-") as store:
            (res,) = run_ranks(_drain_phase, 1, [root], timeout=300, store=store)
        assert res["rows_written"] and res["persisted"] == 3 and res["ok"], res
    finally:
        cleanup()


def _column_wise_phase(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    model = _build(world, column_wise=True)
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    stats, history = [], []
    for step in range(4):
        _step(model, rank, step)
        sd = {"model": model.state_dict()}
        history.append(_local(sd))
        dcp.save(sd, storage_writer=w, checkpoint_id=step)
        stats.append(w.last_save)
    differ = sum(int((history[3][k] != history[1][k]).any(1).sum()) for k in history[3])
    check = {"model": _zeroed(_build(world, column_wise=True))["model"]}
    dcp.load(check, storage_reader=GeminiStorageReader(root, JOB), checkpoint_id=3)
    got = _local(check)
    return {"stats": stats, "differ": differ, "shapes": sorted(tuple(v.shape) for v in got.values()),
            "ok": sorted(got) == sorted(history[3]) and all(torch.equal(got[k], history[3][k]) for k in got)}


def test_torchrec_column_wise_dtensor_shards_as_row_deltas() -> None:
    """Column-wise shards output as DTensor over LocalShardsWrapper: each shard is a row-delta item."""
    pytest.importorskip("torchrec")
    from mp_utils import node_root_factory, run_ranks

    make, cleanup = node_root_factory("gemini-rows-cw-")
    try:
        (root,) = make(1)
        (res,) = run_ranks(_column_wise_phase, 1, [root], timeout=300)
        assert res["shapes"] == [(ROWS, DIM // 2)] * 4, res["shapes"]  # 2 tables x 2 column shards
        last = res["stats"][-1]
        assert not last.full and last.rows_total == 4 * ROWS and last.rows_written == res["differ"] > 0, res
        assert res["ok"]
    finally:
        cleanup()


def _step_ids(step: int) -> list[torch.Tensor]:
    """The ids :func:`_step` looks up at ``step`` (per table)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randint(0, ROWS, (ROWS // 100,), generator=g) for _ in range(2)]


def _corrupt_base_phase(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageWriter, find_gemini_error
    from gemini_dcp.errors import PeerError
    from gemini_dcp.ops.verify import verify

    model = _build(world)
    w = GeminiStorageWriter(root, JOB, keep=1, replicas=2, incremental=True, timeout_s=120)
    for step in range(4):
        _step(model, rank, step)
        dcp.save(_state(model), storage_writer=w, checkpoint_id=step)
    out: dict[str, Any] = {}
    if rank == 0:  # node 0 holds rank 1's replicas: damage a row the next delta will not send, in every ring slot
        rec = w.tier.record(3)
        ref = next(v for v in rec.metadata.storage_data.values()
                   if v.rank == 1 and v.length == ROWS * DIM * 4)
        touched = set(torch.cat([_step_ids(s)[t] for s in (3, 4) for t in range(2)]).tolist())
        row = next(r for r in range(ROWS) if r not in touched)
        for idx in range(2):
            path = w.tier.slot_path(1, idx)
            with open(path, "r+b") as f:
                f.seek(ref.offset + row * DIM * 4 + 2)
                b = f.read(1)
                f.seek(ref.offset + row * DIM * 4 + 2)
                f.write(bytes([b[0] ^ 0x04]))
    dist.barrier()
    _step(model, rank, 4)
    try:
        dcp.save(_state(model), storage_writer=w, checkpoint_id=4)
        out["caught"] = None
    except BaseException as exc:  # DCP may wrap the package's error
        err = find_gemini_error(exc)
        out["caught"] = (type(err).__name__ if err is not None else type(exc).__name__, str(err or exc)[:400])
        out["peer_error"] = isinstance(err, PeerError)
    _step(model, rank, 5)
    dcp.save(_state(model), storage_writer=w, checkpoint_id=5)  # no base any more: the whole slot is sent
    out["after"] = dict(w.commit.last_replication)
    out["verify_ok"] = verify(root, JOB, 5).ok
    return out


def test_torchrec_delta_onto_a_damaged_replica_base_is_caught_by_the_holder() -> None:
    """The holder applies received rows onto its base and verifies the whole table: a base damaged
    since it arrived fails the save on every rank (nothing committed), and the next save sends whole."""
    pytest.importorskip("torchrec")
    from mp_utils import node_root_factory, run_ranks

    make, cleanup = node_root_factory("gemini-rows-base-")
    try:
        roots = make(2)
        out = run_ranks(_corrupt_base_phase, 2, roots, timeout=400)
        for res in out:
            assert res["caught"] is not None and res["peer_error"], res
            assert "failed checksum" in res["caught"][1] and "rank 1" in res["caught"][1], res
            assert res["verify_ok"], res
        # rank 1's next replica is not sent as rows onto a base it failed on: its table goes whole
        assert out[1]["after"]["sent_bytes"] >= ROWS * DIM * 4, out[1]["after"]
    finally:
        cleanup()
