"""Plan replay for per-step saves (gemini_dcp.snapshot.replay), with real gloo ranks.

The first save is planned by ``dcp.save``; later saves of the same structure
replay that plan with one integer all-reduce of agreement instead of DCP's
planning collectives. These tests check that a replayed step is the step
``dcp.save`` would have written (same bytes, same metadata), that a structure
change on *one* rank makes *every* rank plan again (ranks never split between
the protocols), and that a failure on one rank during a replay reaches every
rank instead of leaving the others waiting in the commit.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
from gemini_dcp.snapshot.replay import PlanReplay, same_plan


@pytest.fixture
def roots() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-replay-", dir=base)
    paths = [os.path.join(d, f"node{i}") for i in range(2)]
    for p in paths:
        os.makedirs(p)
    yield paths
    shutil.rmtree(d, ignore_errors=True)


def test_same_plan_ignores_index_hints() -> None:
    a = SavePlan([WriteItem(index=MetadataIndex("w", [0], index=0), type=WriteItemType.BYTE_IO)])
    b = SavePlan([WriteItem(index=MetadataIndex("w", [0], index=3), type=WriteItemType.BYTE_IO)])
    c = SavePlan([WriteItem(index=MetadataIndex("v", [0]), type=WriteItemType.BYTE_IO)])
    assert same_plan(a, b) and not same_plan(a, c)


def _state(rank: int, step: int, extra: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    sd: dict[str, Any] = {
        f"rank{rank}.w": torch.randn(256, 64, generator=g),
        "shared": torch.full((128,), float(step)),  # replicated: deduplicated to one writer by the plan
        # replicated (same FQN and value on every rank); a non-tensor value that changes every step
        "nested": {"m": torch.randn(32, generator=torch.Generator().manual_seed(step)), "step": step},
    }
    if extra:
        sd[f"rank{rank}.extra"] = torch.randn(64, generator=g)
    return sd


def _replay_steps(rank: int, world: int, root: str) -> dict[str, Any]:
    from gemini_dcp.transport.comm import get_comm

    writer = GeminiStorageWriter(root=root, job_id="replay", keep=8)
    group = get_comm(60.0).group
    replay = PlanReplay(writer, group, no_dist=False)
    trace = []
    saved = {}
    for step in range(6):
        extra = rank == 1 and step >= 3  # a structure change on one rank only, from step 3 on
        sd = _state(rank, step, extra)
        saved[step] = sd
        before = replay.planned
        replay.save(sd, step)
        trace.append("plan" if replay.planned > before else "replay")
    # A stock dcp.save of step 5's state, for the metadata comparison.
    ref_writer = GeminiStorageWriter(root=root, job_id="reference", keep=1)
    dcp.save(saved[5], storage_writer=ref_writer, checkpoint_id=5, process_group=group)
    loaded_ok = []
    for step, sd in saved.items():
        out = _state(rank, 99, rank == 1 and step >= 3)
        out["nested"] = {"m": torch.zeros(32), "step": -1}
        dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id="replay"), checkpoint_id=step)
        ok = all(torch.equal(out[k], sd[k]) for k in sd if isinstance(sd[k], torch.Tensor))
        loaded_ok.append(ok and torch.equal(out["nested"]["m"], sd["nested"]["m"]) and out["nested"]["step"] == step)
    r1 = GeminiStorageReader(root=root, job_id="replay")
    r1.reset(5)
    r2 = GeminiStorageReader(root=root, job_id="reference")
    r2.reset(5)
    m1, m2 = r1.read_metadata(), r2.read_metadata()
    same_meta = m1.state_dict_metadata == m2.state_dict_metadata and m1.planner_data == m2.planner_data
    same_items = sorted(map(str, m1.storage_data)) == sorted(map(str, m2.storage_data))
    return {"trace": trace, "loaded_ok": loaded_ok, "same_meta": same_meta, "same_items": same_items}


@pytest.mark.timeout(240)
def test_replayed_steps_equal_planned_steps_and_replan_together(roots: list[str]) -> None:
    res = run_ranks(_replay_steps, 2, roots)
    # step 0 planned; 1-2 replayed; rank 1 changed its structure at 3: both ranks planned; then replay
    want = ["plan", "replay", "replay", "plan", "replay", "replay"]
    assert [r["trace"] for r in res] == [want, want]
    assert all(all(r["loaded_ok"]) for r in res), res
    assert all(r["same_meta"] and r["same_items"] for r in res), res


class _FailingWriter(GeminiStorageWriter):
    fail_at: int | None = None

    def _write_local(self, plan: Any, planner: Any, step: int, rank: int) -> Any:
        if step == self.fail_at:
            raise OSError(f"injected write failure at step {step}")
        return super()._write_local(plan, planner, step, rank)


def _replay_failure(rank: int, world: int, root: str) -> list[str]:
    from gemini_dcp.transport.comm import get_comm

    writer = _FailingWriter(root=root, job_id="fail", keep=3, timeout_s=60)
    writer.fail_at = 2 if rank == 1 else None
    replay = PlanReplay(writer, get_comm(60.0).group, no_dist=False)
    events = []
    for step in range(4):
        sd = _state(rank, step, False)
        try:
            replay.save(sd, step)
            events.append(f"{step}:ok")
        except Exception as exc:  # noqa: BLE001 - recorded for the parent test
            events.append(f"{step}:{type(exc).__name__}")
    reader = GeminiStorageReader(root=root, job_id="fail")
    out = _state(rank, 99, False)
    dcp.load(out, storage_reader=reader)
    events.append(f"restored:{reader.restored_step}")
    return events


@pytest.mark.timeout(240)
def test_failure_on_one_rank_during_replay_reaches_every_rank(roots: list[str]) -> None:
    res = run_ranks(_replay_failure, 2, roots, timeout=200)
    assert res[1][:4] == ["0:ok", "1:ok", "2:OSError", "3:ok"]
    assert res[0][:4] == ["0:ok", "1:ok", "2:PeerError", "3:ok"]  # told that rank 1 failed; nothing committed
    assert res[0][4] == res[1][4] == "restored:3"


def _replay_replicated(rank: int, world: int, root: str) -> dict[str, Any]:
    from gemini_dcp.transport.comm import get_comm

    writer = GeminiStorageWriter(root=root, job_id="rep", keep=2, replicas=2, timeout_s=60)
    replay = PlanReplay(writer, get_comm(60.0).group, no_dist=False)
    from gemini_dcp.local.record_codec import read_record
    from gemini_dcp.local.tier import LocalTier

    compact, kinds = [], []
    for step in range(4):
        replay.save(_state(rank, step, False), step)
        compact.append(writer.commit.last_commit_compact)
        kinds.append(type(writer.commit.committed_layout).__name__)
    tier = LocalTier(root, "rep")
    on_disk = read_record(tier.layout.record_path(3))  # decoded from the file, not the cache
    same_record = on_disk == tier.record(3) and type(on_disk.metadata.storage_data).__name__ == "ChecksumOverlay"
    ok, reader = _replace_node1_and_load(rank, root, "rep", 3)
    return {"compact": compact, "kinds": kinds, "same_record": same_record, "ok": ok, "step": reader.restored_step,
            "from": dict(reader.restored_from)}


def _replace_node1_and_load(rank: int, root: str, job: str, step: int) -> tuple[bool, GeminiStorageReader]:
    """Collective: node 1 loses its memory (a replaced machine), then every rank loads the newest
    step; (bit-exact equal to ``step``'s state, the reader)."""
    torch.distributed.barrier()
    if rank == 1:  # node 1's shards must now come from node 0's replica
        shutil.rmtree(os.path.join(root, job))
    torch.distributed.barrier()
    out = _state(rank, 99, False)
    out["nested"] = {"m": torch.zeros(32), "step": -1}
    reader = GeminiStorageReader(root=root, job_id=job)
    dcp.load(out, storage_reader=reader)
    want = _state(rank, step, False)
    ok = all(torch.equal(out[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))
    return ok and torch.equal(out["nested"]["m"], want["nested"]["m"]) and out["nested"]["step"] == step, reader


@pytest.mark.timeout(240)
def test_replayed_commit_sends_checksums_only_and_replicas_restore(roots: list[str]) -> None:
    res = run_ranks(_replay_replicated, 2, roots)
    assert [r["compact"] for r in res] == [[False, True, True, True]] * 2  # step 0 planned, then compact gathers
    # replayed records hold the recorded layout plus an array of checksums, on disk as in memory
    assert [r["kinds"] for r in res] == [["dict"] + ["ChecksumOverlay"] * 3] * 2
    assert all(r["same_record"] for r in res), res
    assert all(r["ok"] and r["step"] == 3 for r in res), res
    assert res[0]["from"]["peer"] > 0  # the replaced node's shards came from the peer replica written by a replay


def _plain_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """Plain ``dcp.save`` every step: after the first, the commit sends checksums only."""
    from gemini_dcp.local.record_codec import read_record
    from gemini_dcp.local.tier import LocalTier

    def writer() -> GeminiStorageWriter:
        return GeminiStorageWriter(root=root, job_id="plain", keep=2, replicas=2, timeout_s=60)

    w = writer()
    compact, kinds, meta = [], [], []
    for step in range(6):
        if step == 3 and rank == 1:
            w = writer()  # a fresh writer on one rank: it holds no layout, so nobody may compact
        dcp.save(_state(rank, step, False), storage_writer=w, checkpoint_id=step)
        compact.append(w.commit.last_commit_compact)
        kinds.append(type(w.commit.committed_layout).__name__)
        meta.append(w.commit.last_metadata_transfer)
        assert w.commit.planned_metadata is not None and {"rank0.w", "rank1.w", "shared"} <= set(w.commit.planned_metadata.state_dict_metadata)
    on_disk = read_record(LocalTier(root, "plain").layout.record_path(5))
    ok, reader = _replace_node1_and_load(rank, root, "plain", 5)
    return {"compact": compact, "kinds": kinds, "meta": meta, "disk": type(on_disk.metadata.storage_data).__name__, "ok": ok,
            "step": reader.restored_step, "from": dict(reader.restored_from)}


@pytest.mark.timeout(240)
def test_plain_dcp_save_commits_checksums_only_once_every_rank_holds_the_layout(roots: list[str]) -> None:
    res = run_ranks(_plain_saves, 2, roots)
    # step 0: no layout yet; 1-2 compact; 3: rank 1's writer is fresh, so both gather in full
    # (and agree on the new layout); 4-5 compact again
    assert [r["compact"] for r in res] == [[False, True, True, False, True, True]] * 2
    kinds = ["dict", "ChecksumOverlay", "ChecksumOverlay", "dict", "ChecksumOverlay", "ChecksumOverlay"]
    assert [r["kinds"] for r in res] == [kinds] * 2
    assert all(r["disk"] == "ChecksumOverlay" for r in res)
    # The planned metadata travels when it is new to some rank; unchanged, nothing is sent
    # (step 3: rank 0 did not inline it, rank 1's fresh writer lacked it, so it was broadcast).
    assert [r["meta"] for r in res] == [["inline", "none", "none", "broadcast", "none", "none"]] * 2
    assert all(r["ok"] and r["step"] == 5 for r in res), res
    assert res[1]["from"]["peer"] > 0


def _growing_values(rank: int, world: int, root: str) -> dict[str, Any]:
    """Replayed saves whose per-rank pickled value (a dataloader's buffered tokens) changes length every step."""
    from gemini_dcp.local.record_codec import read_record
    from gemini_dcp.local.record_types import ChecksumOverlay, refs_by_location
    from gemini_dcp.local.tier import LocalTier
    from gemini_dcp.transport.comm import get_comm

    writer = GeminiStorageWriter(root=root, job_id="grow", keep=2, timeout_s=60)
    replay = PlanReplay(writer, get_comm(60.0).group, no_dist=False)

    def state(step: int) -> dict[str, Any]:
        sd = _state(rank, step, False)
        # grows ~2 B per step within its room, then by 400 B at step 3: past its room (moved to the slot's end)
        sd[f"loader{rank}"] = {"buffer": list(range(7 * step + 3 * rank + (200 if step >= 3 else 0))), "step": step}
        return sd

    compact, built, moved = [], [], []
    local = writer.local_writer
    for step in range(5):
        replay.save(state(step), step)
        compact.append(writer.commit.last_commit_compact)
        built.append(local.programs_built)
        layout = writer.commit.committed_layout
        moved.append(len(layout.moved) if isinstance(layout, ChecksumOverlay) else -1)  # -1: a full layout
    # The record on disk keeps the overlay with the moved places; its fingerprint and chunk locations
    # are those of the same chunks as a plain dict.
    rec = read_record(LocalTier(root, "grow").layout.record_path(4))
    sd = rec.metadata.storage_data
    plain = dataclasses.replace(rec, metadata=dataclasses.replace(rec.metadata, storage_data=dict(sd.items())))
    same = rec.fingerprint() == plain.fingerprint() and dict(refs_by_location(sd)) == refs_by_location(dict(sd.items()))
    out = state(99)
    out[f"loader{rank}"] = {"buffer": [], "step": -1}
    dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id="grow"))
    want = state(4)
    exact = all(torch.equal(out[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))
    return {"compact": compact, "built": built, "exact": exact and out[f"loader{rank}"] == want[f"loader{rank}"],
            "moved": moved, "same": same and isinstance(sd, ChecksumOverlay)}


@pytest.mark.timeout(240)
def test_replayed_values_that_change_length_keep_the_program_and_compact_reports(roots: list[str]) -> None:
    """A pickled value of another length each save stays in the room its layout kept (no new program), or,
    past it, moves to the end of the slot (one new program); the report stays compact (checksums and the
    values' new places) and the newest step restores exactly."""
    res = run_ranks(_growing_values, 2, roots)
    for r in res:
        assert r["exact"], r
        assert r["compact"][1:] == [True] * 4, r
        assert r["built"][2] == r["built"][1] and r["built"][-1] - r["built"][1] <= 1, r  # one: the move
        # the records stay overlays: each rank's value that changed length rides in it (step 3: both ranks'
        # moved past their room), never a full layout
        assert r["moved"][0] == -1 and min(r["moved"][1:]) >= 0 and r["moved"][3] == 2 and r["same"], r


def test_compact_report_round_trip() -> None:
    from torch.distributed.checkpoint.storage import WriteResult

    from gemini_dcp.commit.reports import RankReport, compact, expand, rank_layouts
    from gemini_dcp.local.record_types import ShardRef

    def wr(rank: int, fqn: str, off: int, n: int, cs: int) -> WriteResult:
        return WriteResult(index=MetadataIndex(fqn, [0]), size_in_bytes=n,
                           storage_data=ShardRef(rank, off, n, cs, "crc32c", "float32", (n // 4,)))

    recorded = [wr(0, "a", 0, 64, 1), wr(0, "b", 64, 0, 2), wr(0, "c", 64, 128, 3), wr(1, "d", 0, 32, 4)]
    layouts = rank_layouts({w.index: w.storage_data for w in recorded})
    now = (wr(0, "a", 0, 64, 11), wr(0, "b", 64, 0, 12), wr(0, "c", 64, 128, 13))
    rep = RankReport(rank=0, node_id="n0", slot=1, nbytes=192, results=now)
    sent = compact(rep, layouts[0])
    assert sent.results == () and sent.checksums == (11, 12, 13)
    assert expand(sent, layouts) == rep
    moved = (now[0], now[1], wr(0, "c", 128, 128, 13))  # a chunk elsewhere: sent whole
    assert compact(dataclasses.replace(rep, results=moved), layouts[0]).results == moved
    assert compact(dataclasses.replace(rep, results=now[:2]), layouts[0]).checksums is None  # fewer chunks
    # A pickled value (no dtype) of another length where the layout kept its room: compact, with the length.
    pickled = [WriteResult(index=MetadataIndex("v", None), size_in_bytes=40,
                           storage_data=ShardRef(3, 0, 40, 5, "crc32c", None, None))]
    layouts3 = rank_layouts({w.index: w.storage_data for w in pickled})
    longer = RankReport(rank=3, node_id="n3", slot=0, nbytes=512, results=(
        WriteResult(index=MetadataIndex("v", None), size_in_bytes=55, storage_data=ShardRef(3, 0, 55, 6, "crc32c", None, None)),))
    sent3 = compact(longer, layouts3[3])
    assert sent3.results == () and sent3.checksums == (6,) and sent3.moved == ((0, 0, 55),)
    assert expand(sent3, layouts3) == longer
    elsewhere = dataclasses.replace(longer, results=(WriteResult(index=MetadataIndex("v", None), size_in_bytes=90,
                                                                 storage_data=ShardRef(3, 4096, 90, 7, "crc32c", None, None)),))
    sent4 = compact(elsewhere, layouts3[3])  # outgrew its room: moved to the end of the slot
    assert sent4.moved == ((0, 4096, 90),) and expand(sent4, layouts3) == elsewhere
    empty = RankReport(rank=2, node_id="n2", slot=0, nbytes=0, results=())
    assert expand(compact(empty, layouts.get(2, [])), layouts) == empty  # a rank that wrote nothing
    assert expand(None, layouts) is None


def test_an_overlay_carries_moved_values_and_refuses_other_moves() -> None:
    """Compact reports whose pickled values moved give an overlay with their places (the same items as the
    expanded reports); a report that 'moves' a tensor chunk, or an overlay naming a position outside its
    layout, is refused; the overlay pickles with its moved places and reads back equal."""
    import pickle

    from gemini_dcp.commit.reports import RankReport, SplitLayout, expand, overlay
    from gemini_dcp.errors import UntrustedDataError
    from gemini_dcp.local.record_types import ChecksumOverlay, ShardRef

    layout = {MetadataIndex("t", [0]): ShardRef(0, 0, 64, 1, "crc32c", "float32", (16,)),
              MetadataIndex("v", None): ShardRef(0, 64, 40, 2, "crc32c", None, None),
              MetadataIndex("u", None): ShardRef(1, 0, 30, 3, "crc32c", None, None)}
    split = SplitLayout.of(layout)
    reps = [RankReport(rank=0, node_id="n0", slot=0, nbytes=200, results=(), checksums=(11, 12), moved=((1, 64, 55),)),
            RankReport(rank=1, node_id="n1", slot=0, nbytes=100, results=(), checksums=(13,), moved=((0, 128, 9),))]
    ov = overlay(split, reps)
    assert isinstance(ov, ChecksumOverlay) and ov.moved == {1: (64, 55), 2: (128, 9)}
    expanded = {wr.index: wr.storage_data for rep in reps for wr in expand(rep, split.by_rank).results}  # type: ignore[union-attr]
    assert dict(ov.items()) == expanded and ov[MetadataIndex("u", None)].offset == 128
    assert dict(pickle.loads(pickle.dumps(ov)).items()) == expanded
    bad = [dataclasses.replace(reps[0], moved=((0, 64, 55),)), reps[1]]  # item 0 is a tensor chunk
    with pytest.raises(UntrustedDataError, match="not a pickled value"):
        overlay(split, bad)
    with pytest.raises(ValueError, match="not a position"):
        ChecksumOverlay(layout, [1, 2, 3], {3: (0, 1)})


def test_single_process_replay(tmp_path: Any) -> None:
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="gemini-replay1-", dir=root)
    try:
        replay = PlanReplay(GeminiStorageWriter(root=d, job_id="one", keep=2), None, no_dist=True)
        for step in range(3):
            replay.save({"w": torch.full((1000,), float(step)), "step": step}, step)
        assert (replay.planned, replay.replayed) == (1, 2)
        out = {"w": torch.zeros(1000), "step": -1}
        dcp.load(out, storage_reader=GeminiStorageReader(root=d, job_id="one"), checkpoint_id=2)
        assert torch.equal(out["w"], torch.full((1000,), 2.0)) and out["step"] == 2
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_moved_values_reach_the_store_and_restore_from_it_alone(tmp_path: Any) -> None:
    """Replayed saves whose pickled value changes length (records kept as overlays with moved places) are
    drained to the persistent store in stock layout; with the node's memory gone, the newest step restores
    from the store alone, bit-exact."""
    from gemini_dcp.local.record_types import ChecksumOverlay

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="gemini-moved-", dir=base)
    store = f"file://{tmp_path / 'store'}"
    try:
        w = GeminiStorageWriter(root=d, job_id="mv", keep=2, persistent=store, persist_every=1)
        replay = PlanReplay(w, None, no_dist=True)

        def sd(step: int) -> dict[str, Any]:
            return {"w": torch.full((1000,), float(step)), "loader": {"buf": list(range(7 * step + (300 if step >= 3 else 0)))},
                    "step": step}

        for step in range(5):
            replay.save(sd(step), step)
        layout = w.commit.committed_layout
        assert isinstance(layout, ChecksumOverlay) and layout.moved
        assert w.wait_persisted(4, timeout_s=120) == 4
        shutil.rmtree(d)  # the node's memory is gone: only the store is left
        os.makedirs(d, mode=0o700)
        out: dict[str, Any] = {"w": torch.zeros(1000), "loader": {"buf": []}, "step": -1}
        dcp.load(out, storage_reader=GeminiStorageReader(root=d, job_id="mv", persistent=store), checkpoint_id=4)
        want = sd(4)
        assert torch.equal(out["w"], want["w"]) and out["loader"] == want["loader"] and out["step"] == 4
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _key(sd: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from gemini_dcp.snapshot.replay import structure_key

    flat, mappings = flatten_state_dict(sd)
    return structure_key(flat, mappings)


def test_structure_key_sees_what_changes_a_plan_and_ignores_values() -> None:
    base = {"w": torch.zeros(4, 8), "opt": {"m": torch.zeros(8)}, "step": 1}
    k = _key(base)
    assert k is not None
    assert _key({"w": torch.ones(4, 8), "opt": {"m": torch.ones(8)}, "step": 2}) == k  # values only
    assert _key({**base, "w": torch.zeros(8, 4)}) != k  # shape
    assert _key({**base, "w": torch.zeros(4, 8, dtype=torch.bfloat16)}) != k  # dtype
    assert _key({**base, "w": torch.zeros(4, 8, requires_grad=True)}) != k  # properties in the metadata
    assert _key({**base, "extra": 3}) != k  # a new key
    assert _key({"w": base["w"], "opt.m": base["opt"]["m"], "step": 1}) != k  # same FQNs, other nesting


def test_structure_key_declines_what_it_cannot_key() -> None:
    class Sub(torch.Tensor):
        pass

    assert _key({"w": torch.zeros(3).as_subclass(Sub)}) is None  # tensor subclasses: compare full plans


def test_byte_memo_gives_torch_save_bytes_and_tells_values_apart() -> None:
    import io
    import math

    from gemini_dcp.snapshot.replay import ByteMemo

    def saved(v: Any) -> bytes:
        buf = io.BytesIO()
        torch.save(v, buf)
        return buf.getvalue()

    memo = ByteMemo()
    values = {"lr": 1e-3, "betas": (0.9, 0.95), "flag": True, "n": 1, "z": 0.0, "nan": math.nan,
              "nested": {"a": [1, 2.5, "x", None, b"raw"]}}
    for _ in range(3):  # the first save serializes, the next ones reuse
        for k, v in values.items():
            out = memo.serialize(k, v)
            assert out is not None and out.getvalue() == saved(v), k
        memo.rotate()
    assert memo.misses == len(values) and memo.hits == 2 * len(values)
    # Equal under == but not the same value: serialized again, to what torch.save writes for each.
    for k, v in [("flag", 1), ("n", True), ("z", -0.0), ("lr", math.nextafter(1e-3, 1.0)), ("betas", [0.9, 0.95])]:
        hits = memo.hits
        out = memo.serialize(k, v)
        assert out is not None and out.getvalue() == saved(v) and memo.hits == hits, k
    # Not plain: left to DCP's own torch.save.
    assert memo.serialize("t", torch.ones(2)) is None
    assert memo.serialize("obj", {"k": object()}) is None
    memo.rotate()
    memo.rotate()  # a save that did not see a value forgets it
    hits = memo.hits
    memo.serialize("lr", 1e-3)
    assert memo.hits == hits


def test_byte_memo_serialize_many_reuses_only_the_same_immutable_values() -> None:
    """The writer's one-call path: bytes of unchanged immutable values come back without pickling,
    a changed, mutable or missing value is looked at again, and every blob is what torch.save writes."""
    import io

    from gemini_dcp.snapshot.replay import ByteMemo

    def saved(v: Any) -> bytes:
        buf = io.BytesIO()
        torch.save(v, buf)
        return buf.getvalue()

    missing = object()
    memo = ByteMemo()
    fqns = ["g0.lr", "g1.lr", "g0.betas", "g0.params", "g0.obj", "g0.gone"]
    betas, params = (0.9, 0.95), [1, 2]
    lr = 3e-4
    objs: list[Any] = [lr, lr, betas, params, torch.ones(1), missing]
    out = memo.serialize_many(fqns, objs, missing)
    assert out[:4] == [saved(lr), saved(lr), saved(betas), saved(params)] and out[4] is None and out[5] is None
    assert memo.misses == 3 and memo.shared == 1  # one learning rate for both groups: one torch.save
    memo.rotate()
    hits, misses = memo.hits, memo.misses
    params.append(3)  # mutated in place: a list is never reused by identity
    lr2 = lr * 0.5  # a scheduler's new learning rate in one group
    objs2: list[Any] = [lr2, lr, tuple(betas), params, torch.ones(1), missing]  # a snapshot copies tuples
    out2 = memo.serialize_many(fqns, objs2, missing)
    assert out2[:4] == [saved(lr2), saved(lr), saved(betas), saved([1, 2, 3])] and out2[4] is None and out2[5] is None
    assert memo.misses == misses + 2 and memo.hits == hits + 2
    memo.rotate()
    out3 = memo.serialize_many(fqns, objs2, missing)  # nothing changed: the same bytes objects
    assert out3[:3] == out2[:3] and all(a is b for a, b in zip(out3[:3], out2[:3]))


def test_replayed_saves_keep_every_non_tensor_value_exact(tmp_path: Any) -> None:
    from gemini_dcp.save.local_write import direct_lookup
    from gemini_dcp.snapshot.replay import RecordingSavePlanner

    planner = RecordingSavePlanner()
    planner.state_dict = {"w": torch.ones(1)}
    assert direct_lookup(planner) is planner.state_dict  # its byte-item transform keeps the direct tensor path
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="gemini-replay-bytes-", dir=root)
    try:
        replay = PlanReplay(GeminiStorageWriter(root=d, job_id="bytes", keep=4), None, no_dist=True)
        lrs = [1e-3, 1e-3, 5e-4, 5e-4]
        for step, lr in enumerate(lrs):
            replay.save({"w": torch.full((64,), float(step)), "lr": lr, "betas": (0.9, 0.95), "step": step,
                         "sched": {"last_epoch": step, "lrs": [lr]}}, step)
        assert replay.byte_memo.hits > 0 and replay.replayed == 3
        for step, lr in enumerate(lrs):
            out = {"w": torch.zeros(64), "lr": -1.0, "betas": None, "step": -1, "sched": {"last_epoch": -1, "lrs": [0.0]}}
            dcp.load(out, storage_reader=GeminiStorageReader(root=d, job_id="bytes"), checkpoint_id=step)
            assert torch.equal(out["w"], torch.full((64,), float(step)))
            assert (out["lr"], out["betas"], out["step"]) == (lr, (0.9, 0.95), step)
            assert out["sched"] == {"last_epoch": step, "lrs": [lr]}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_fast_check_flattens_nested_state_like_dcp() -> None:
    """FastCheck.flatten takes each container's leaves with one call and still gives DCP's
    flattening (nested dicts, lists, top-level values), or None once a path is gone."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from gemini_dcp.snapshot.replay_check import FastCheck

    w = torch.ones(2)
    sd: dict[str, Any] = {"model": {"a": w, "b": torch.zeros(3)}, "step": 3,
                          "optim": {"g": {"lr": 0.1, "betas": (0.9, 0.95), "params": [1, {"x": 2}]}}, "last": 1.5}
    flat, mappings = flatten_state_dict(sd)
    fc = FastCheck.of(1, flat, mappings)
    assert fc is not None
    got = fc.flatten(sd)
    assert got is not None and list(got) == list(flat) and all(got[k] is flat[k] for k in flat)
    sd2 = dict(sd, step=4, optim={"g": dict(sd["optim"]["g"], lr=0.05)})
    got2 = fc.flatten(sd2)
    assert got2 is not None and got2["step"] == 4 and got2["optim.g.lr"] == 0.05 and got2["model.a"] is w
    assert fc.flatten({"model": {"a": w}, "step": 3, "optim": sd["optim"], "last": 1.5}) is None  # "model.b" gone
    assert fc.flatten(dict(sd, optim={"g": {"lr": 0.1, "betas": (0.9, 0.95), "params": [1]}})) is None  # list shorter
