"""Incremental saves (issue 23, docs/incremental.md): unchanged tensors are carried in their slot.

In-process saves (one process, no group) test the change rule and the ring; two real gloo
processes on two simulated nodes test the peer replica, a node loss and a restart.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.errors import ChecksumMismatchError, ConfigError
from gemini_dcp.ops.inspection import inspect_root
from gemini_dcp.ops.verify import verify
from gemini_dcp.options.incremental import IncrementalOptions
from gemini_dcp.save.carry import SaveStats

JOB = "incr"
FROZEN = 64 * 1024 * 4  # bytes of the frozen tensor below


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.fixture()
def root() -> Iterator[str]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="gemini-incr-", dir=base) as d:
        yield d


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "frozen": torch.randn(256, 256, generator=g),  # 256 KiB: never changes
        "lora": torch.nn.Parameter(torch.randn(8, 256, generator=g)),
        "bias": torch.randn(256, generator=g),
    }


def _save(w: GeminiStorageWriter, sd: dict[str, object], step: int) -> SaveStats:
    dcp.save(sd, storage_writer=w, checkpoint_id=step)
    assert w.last_save is not None and w.last_save.step == step
    return w.last_save


def _load(root: str, like: dict[str, object], step: int | None = None) -> dict[str, object]:
    out = {k: (torch.full_like(v, float("nan")) if v.is_floating_point() else torch.full_like(v, -7))
           if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    dcp.load(out, storage_reader=GeminiStorageReader(root, JOB), checkpoint_id=step)
    return out


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(torch.equal(torch.as_tensor(a[k]).detach(), torch.as_tensor(b[k]).detach()) for k in a)


def _snapshot(sd: dict[str, object]) -> dict[str, object]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


# ---- options ---------------------------------------------------------------------------------------
def test_options_validated() -> None:
    assert IncrementalOptions().enabled is False
    with pytest.raises(ConfigError, match="full_every"):
        IncrementalOptions(enabled=True, full_every=0)
    with pytest.raises(ConfigError, match="incremental=True"):
        IncrementalOptions(enabled=False, full_every=3)
    with pytest.raises(ConfigError):
        IncrementalOptions(enabled="yes")  # type: ignore[arg-type]


def test_default_copies_everything(root: str) -> None:
    w = GeminiStorageWriter(root, JOB, keep=2)
    sd = _model()
    for step in range(4):
        st = _save(w, sd, step)
        assert st.bytes_carried == 0 and st.full and st.bytes_written >= FROZEN


# ---- priority 1: the local carry ----------------------------------------------------------------
def test_frozen_carried_across_ring_with_eviction(root: str) -> None:
    """keep=2: a ring of 3 slots; once each slot was written, only the trainable bytes are copied,
    every retained step restores bit-exact and verifies, and evicted steps are gone."""
    w = GeminiStorageWriter(root, JOB, keep=2, incremental=True)
    sd = _model()
    snaps = {}
    stats = []
    for step in range(8):
        with torch.no_grad():
            sd["lora"].add_(0.5)  # an in-place update, like an optimizer step
        stats.append(_save(w, sd, step))
        snaps[step] = _snapshot(sd)
    assert all(s.full for s in stats[:3])  # the first write of each slot of the ring
    for s in stats[3:]:
        assert s.bytes_carried >= FROZEN and not s.full
        assert s.bytes_written < s.bytes_carried / 10
        assert s.bytes_written + s.bytes_carried == stats[0].bytes_written
    assert w.tier.steps() == [6, 7]
    for step in (6, 7):
        assert _same(_load(root, sd, step), snaps[step])
    assert verify(root, JOB).ok
    info = {s.step: s for s in inspect_root(root, JOB).jobs[0].steps}
    assert info[7].bytes_carried == stats[7].bytes_carried and info[7].bytes_written == stats[7].bytes_written
    assert info[7].rank_bytes_carried == [stats[7].bytes_carried]


@pytest.mark.parametrize("how", ["sgd", "adam_foreach", "copy_", "load_state_dict", "index", "view", "replace"])
def test_in_place_change_never_missed(root: str, how: str) -> None:
    """A frozen-looking tensor changed through a normal path is copied, at any slot of the ring."""
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    lin = torch.nn.Linear(64, 64)
    sd: dict[str, object] = {"w": lin.weight, "b": lin.bias, "other": torch.randn(128)}
    opt: torch.optim.Optimizer | None = None
    if how == "sgd":
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    elif how == "adam_foreach":
        opt = torch.optim.Adam(lin.parameters(), lr=0.1, foreach=True)
    for step in range(4):
        _save(w, sd, step)  # warm both slots (keep=1: a ring of 2)
    for step in range(4, 8):
        if opt is not None:
            lin(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        elif how == "copy_":
            with torch.no_grad():
                lin.weight.copy_(torch.randn(64, 64))
        elif how == "load_state_dict":
            lin.load_state_dict({"weight": torch.randn(64, 64), "bias": torch.randn(64)})
        elif how == "index":
            with torch.no_grad():
                lin.weight[step, 3] = float(step)
        elif how == "view":
            with torch.no_grad():
                lin.weight.detach().view(-1)[step] += 1.0
        elif how == "replace":
            sd["w"] = torch.randn(64, 64)  # a new tensor (new storage) under the same key
        st = _save(w, sd, step)
        assert st.bytes_written >= 64 * 64 * 4, (how, st)
        assert _same(_load(root, sd, step), _snapshot(sd)), how


def test_structure_change_forces_full(root: str) -> None:
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    sd = _model()
    for step in range(3):
        _save(w, sd, step)
    assert w.last_save is not None and w.last_save.bytes_carried >= FROZEN
    sd2 = dict(sd, extra=torch.ones(16))  # a new key
    st = _save(w, sd2, 3)
    assert st.full and st.bytes_carried == 0 and st.reason == "structure changed"
    sd3 = dict(sd2, extra=torch.ones(32))  # a new shape
    st = _save(w, sd3, 4)
    assert st.full and st.reason == "structure changed"
    assert _same(_load(root, sd3, 4), _snapshot(sd3))


def test_full_every(root: str) -> None:
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True, full_every=3)
    sd = _model()
    full = [_save(w, sd, step).full for step in range(9)]
    # 0, 1: first write of each slot; then every third save copies everything.
    assert full == [True, True, False, False, True, False, False, True, False]
    assert w.last_save is not None and w.last_save.reason == "incremental"


def test_corrupt_carried_chunk_detected(root: str) -> None:
    """The carried item keeps the checksum of the bytes written: bytes damaged in the slot since
    are caught by verify and by a restore (never returned as values)."""
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    sd = _model()
    for step in range(4):
        st = _save(w, sd, step)
    assert st.bytes_carried >= FROZEN
    rec = w.tier.record(3)
    assert rec is not None
    ref = rec.metadata.storage_data[next(i for i in rec.metadata.storage_data if i.fqn == "frozen")]
    slot = rec.slot_of(0)
    assert slot is not None
    path = w.tier.slot_path(0, slot.slot)
    with open(path, "r+b") as f:
        f.seek(ref.offset + 100)
        b = f.read(1)
        f.seek(ref.offset + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    report = verify(root, JOB, 3)
    assert not report.ok
    assert [c.fqn for c in report.items if c.status == "bad"] == ["frozen"]
    with pytest.raises(BaseException) as err:  # DCP wraps the package's error in a CheckpointException (a BaseException)
        _load(root, sd, 3)
    assert isinstance(find_gemini_error(err.value), ChecksumMismatchError)


def test_new_writer_starts_full(root: str) -> None:
    """A new writer (as after a restart of the workers: no version history) copies everything first."""
    sd = _model()
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    for step in range(3):
        _save(w, sd, step)
    assert w.last_save is not None and w.last_save.bytes_carried > 0
    del w
    w2 = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    st = _save(w2, sd, 3)
    assert st.full and st.reason == "first save of this writer"
    assert _same(_load(root, sd, 3), _snapshot(sd))


# ---- real processes: two nodes, a peer replica, a node loss, a restart ------------------------------
def _dtensor_state(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    frozen = distribute_tensor(torch.randn(128, 256, generator=g), mesh, [Shard(0)])  # 64 KiB per rank
    head = torch.randn(4, 64, generator=g) + rank  # one key per rank: DCP saves a plain tensor once
    return {"frozen": frozen, f"head{rank}": head}


def _train_and_save(rank: int, world: int, root: str, steps: list[int], load_first: bool) -> dict[str, object]:
    sd = _dtensor_state(rank, world)
    if load_first:  # a restarted worker: restore (node 1's memory was wiped: from the peer copy)
        dcp.load(sd, storage_reader=GeminiStorageReader(root, JOB))
    w = GeminiStorageWriter(root, JOB, keep=2, replicas=2, incremental=True, timeout_s=60)
    out: dict[str, object] = {"stats": [], "loaded_head": sd[f"head{rank}"].clone()}  # type: ignore[union-attr]
    for step in steps:
        with torch.no_grad():
            sd[f"head{rank}"].add_(1.0)  # type: ignore[union-attr]
        dcp.save(sd, storage_writer=w, checkpoint_id=step)
        out["stats"].append(w.last_save)  # type: ignore[union-attr]
    out["head"] = sd[f"head{rank}"].clone()  # type: ignore[union-attr]
    out["frozen"] = sd["frozen"].to_local().clone()  # type: ignore[union-attr]
    out["replication"] = dict(w.commit.last_replication)
    check = _dtensor_state(rank, world)
    check[f"head{rank}"] = torch.zeros_like(check[f"head{rank}"])  # type: ignore[arg-type]
    dcp.load(check, storage_reader=GeminiStorageReader(root, JOB), checkpoint_id=steps[-1])
    out["verify_ok"] = verify(root, JOB).ok  # this node's own slots and the (delta-built) replica it holds
    out["restored_ok"] = torch.equal(check[f"head{rank}"], out["head"]) and torch.equal(  # type: ignore[arg-type]
        check["frozen"].to_local(), out["frozen"])  # type: ignore[union-attr, arg-type]
    return out


def test_two_nodes_replica_node_loss_and_restart() -> None:
    from mp_utils import node_root_factory, run_ranks, wipe

    make, cleanup = node_root_factory("gemini-incr-")
    try:
        roots = make(2)
        first = run_ranks(_train_and_save, 2, roots, timeout=180, steps=[0, 1, 2, 3, 4], load_first=False)
        for res in first:
            st = res["stats"]
            assert [s.full for s in st] == [True, True, True, False, False]
            assert st[-1].bytes_carried == 128 * 256 * 4 // 2 and st[-1].bytes_written == 4 * 64 * 4
            assert res["restored_ok"] and res["verify_ok"]
            rep = res["replication"]  # the peer got only the changed run (the head), verified
            assert rep["delta_pairs"] == 1 and rep["sent_bytes"] == rep["delta_sent_bytes"] == 4 * 64 * 4, rep
        wipe(roots[1])  # node 1 is replaced: its ranks restore from node 0's replica
        second = run_ranks(_train_and_save, 2, roots, timeout=180, steps=[5, 6, 7, 8], load_first=True)
        for r, res in enumerate(second):
            assert torch.equal(res["loaded_head"], first[r]["head"])  # step 4 restored bit-exact
            st = res["stats"]
            assert st[0].full and st[0].reason == "first save of this writer"
            assert st[-1].bytes_carried > 0
            assert res["restored_ok"]
    finally:
        cleanup()


# ---- delta replication: the pure decision --------------------------------------------------------
def test_merge_runs_and_pair_decision() -> None:
    from gemini_dcp.peer.delta import ReplicaMemory, merge_runs, pair_runs, touches

    assert merge_runs([(0, 10), (20, 5), (1 << 20, 8), (2 << 20, 0)], gap=64) == ((0, 25), (1 << 20, 8))
    rows = ((128, 4096, 16, b"\x03\x00\x00\x00"),)  # a table at 128: row 3 of 256 written
    offer = ("tok", 7, ((5, ((0, 64),), rows), (6, (), ())))
    assert pair_runs(offer, [(1, 2, "tok", 5)], src=1) == (2, ((0, 64),), rows)
    assert pair_runs(offer, [(1, 2, "tok", 6)], src=1) == (2, (), ())  # nothing changed: no bytes move
    assert pair_runs(offer, [(1, 2, "other", 5)], src=1) is None  # another writer (a restarted sender)
    assert pair_runs(offer, [(0, 2, "tok", 5)], src=1) is None  # a base of another rank
    assert pair_runs(offer, [(1, 2, "tok", 4)], src=1) is None  # a save the offer has no runs against
    assert pair_runs(None, [(1, 2, "tok", 5)], src=1) is None
    runs = ((0, 25), (100, 10))
    assert [touches(runs, o, n) for o, n in [(0, 1), (24, 8), (25, 75), (99, 2), (110, 5), (50, 0)]] == [
        True, True, False, True, False, False]
    mem = ReplicaMemory()
    mem.note(1, 2, offer)
    assert mem.bases(lambda src: 2) == ((1, 2, "tok", 7),)
    assert mem.bases(lambda src: 0) == ()  # the next replica lands in a slot holding nothing known
    mem.drop(1, 2)
    assert mem.bases(lambda src: 2) == ()


# ---- the persistent drain: complete stock-DCP steps from carried bytes ---------------------------
@pytest.mark.slow  # starts the detached drain server (through library code: the scan cannot see it)
def test_drain_writes_stock_dcp_from_carried_bytes(root: str) -> None:
    """The drain reads a step's slot in place: carried items are in it like copied ones, so the
    store gets a complete checkpoint that stock ``dcp.load`` reads without this package."""
    with tempfile.TemporaryDirectory(prefix="gemini-incr-store-") as store:
        w = GeminiStorageWriter(root, JOB, keep=1, incremental=True, persistent=f"file://{store}", persist_every=1,
                                persist_keep=1)
        sd = _model()
        for step in range(4):
            with torch.no_grad():
                sd["lora"].add_(1.0)
            st = _save(w, sd, step)
        assert st.bytes_carried >= FROZEN
        assert w.wait_persisted(3, timeout_s=120) == 3
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, checkpoint_id=os.path.join(store, JOB, "step-3"))  # stock FileSystemReader
        assert _same(out, _snapshot(sd))


def test_two_writers_of_one_job_in_one_process_never_carry_each_others_slots(root: str) -> None:
    """Writers of one job in one process share slot files: a slot the other writer wrote since is copied."""
    sd = _model()
    a = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    for step in range(3):
        _save(a, sd, step)
    b = GeminiStorageWriter(root, JOB, keep=1)  # plain writer, same slot files
    other = {k: v.detach() + 1 for k, v in sd.items()}
    _save(b, other, 3)
    _save(b, other, 4)
    st = _save(a, sd, 5)
    assert st.bytes_carried == 0 and st.reason == "slot written by another writer"
    assert _same(_load(root, sd, 5), _snapshot(sd))


def test_async_checkpointer_with_frozen_model_state_dict(root: str) -> None:
    """The zero-stall path (plan replay, optimizer guard) carries frozen weights too; a
    ``model.state_dict()`` (fresh detached tensors each call, same storages and counters) and
    BatchNorm buffers updated in place by forward are seen."""
    from gemini_dcp.snapshot import AsyncCheckpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 4))
    model[0].requires_grad_(False)  # frozen
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    ck = AsyncCheckpointer(w, optimizer=opt, model=model)
    refs = {}
    try:
        for step in range(6):
            model(torch.randn(8, 128)).sum().backward()
            opt.step()
            opt.zero_grad()
            sd = model.state_dict()
            refs[step] = {k: v.clone() for k, v in sd.items()}
            ck.save(sd, step)
        ck.wait()
    finally:
        ck.close()
    st = w.last_save
    assert st is not None and st.bytes_carried >= 128 * 128 * 4 and st.bytes_written >= 4 * 128 * 4, st
    got = _load(root, refs[5], 5)
    assert _same(got, refs[5])


# ---- torchrec: small ShardedTensor tables (below the row-delta size: copied whole, never carried) -----
# Large tables are written as row deltas: tests/test_row_delta.py.
def _torchrec_incremental(rank: int, world_size: int, root: str) -> dict[str, object]:
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType

    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=512, feature_names=[f"f{i}"])
              for i in range(2)]

    def build() -> DistributedModelParallel:
        torch.manual_seed(0)
        ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        cons = {f"t{i}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for i in range(2)}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"), constraints=cons)
        return DistributedModelParallel(ebc, device=torch.device("cpu"),
                                        plan=planner.collective_plan(ebc, None, dist.GroupMember.WORLD))

    model = build()
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True)
    stats = []
    for step in range(4):
        sd = model.state_dict()
        with torch.no_grad():  # a "training step" touches rows of table t0 only
            for shard in sd["embedding_bags.t0.weight"].local_shards():
                shard.tensor[step * 7 : step * 7 + 3].add_(1.0)
        dcp.save(sd, storage_writer=w, checkpoint_id=step)
        stats.append(w.last_save)
    expect = {k: [s.tensor.clone() for s in v.local_shards()] for k, v in model.state_dict().items()}
    target = build().state_dict()
    for t in target.values():
        for shard in t.local_shards():
            shard.tensor.zero_()
    dcp.load(target, storage_reader=GeminiStorageReader(root, JOB), checkpoint_id=3)
    ok = all(torch.equal(a, b.tensor) for k in expect for a, b in zip(expect[k], target[k].local_shards()))
    held = sorted(k for k, v in model.state_dict().items() if v.local_shards())
    return {"stats": stats, "ok": ok, "held": held}


def test_torchrec_small_tables_copied_whole_never_carried() -> None:
    """torchrec's fused optimizers update rows without bumping ``_version``: a table is never carried
    on its key; one below the row-delta size (1 MiB) is copied whole at every save."""
    pytest.importorskip("torchrec")
    from mp_utils import node_root_factory, run_ranks

    make, cleanup = node_root_factory("gemini-incr-rec-")
    try:
        (root,) = make(1)
        out = run_ranks(_torchrec_incremental, 2, [root, root], timeout=240)
        table = 512 * 16 * 4
        assert sorted(tuple(r["held"]) for r in out) == [("embedding_bags.t0.weight",), ("embedding_bags.t1.weight",)]
        for res in out:
            assert res["ok"]
            last = res["stats"][-1]
            assert last.bytes_written == table and last.bytes_carried == 0 and last.rows_written == 0, last
    finally:
        cleanup()


def test_delta_offer_runs_and_full_every_sends_whole(root: str) -> None:
    """The sender's offer: runs of the changed items against each recent save; a full_every save offers none."""
    w = GeminiStorageWriter(root, JOB, keep=1, incremental=True, full_every=4)
    sd = _model()
    offers = []
    for step in range(6):
        with torch.no_grad():
            sd["lora"].add_(1.0)
        st = _save(w, sd, step)
        offers.append((st.reason, w.local_writer.delta_offer(0, "tok", step)))
    reason, (token, seq, since) = offers[2]
    assert reason == "incremental" and token == "tok" and seq == 2
    lora = 8 * 256 * 4
    assert [b for b, _, _ in since] == [0, 1] and all(sum(n for _, n in runs) >= lora for _, runs, _ in since)
    assert all(sum(n for _, n in runs) < FROZEN for _, runs, _ in since)  # the frozen tensor is in no run
    assert all(packed == () for _, _, packed in since)  # no sharded embedding table: no row deltas
    # 0 and 1 are the ring's first writes (full), then 3 incremental saves, then the 4th is forced full.
    assert [r for r, _ in offers[2:]] == ["incremental"] * 3 + ["full_every=4"] and offers[5][1][2] == ()
