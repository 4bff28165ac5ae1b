"""The commit protocol without processes: its pure parts, and whole saves of 2-3 simulated
ranks (threads) over an in-process fake of the collectives it runs on."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.storage import WriteResult

from gemini_dcp.commit import reports as rp
from gemini_dcp.commit.agreement import NO_STEP, Agreement
from gemini_dcp.commit.hooks import NO_HOOKS, SaveHooks
from gemini_dcp.commit.protocol import (
    CommitProtocol,
    LocalWrite,
    NodeIdentity,
    SaveSpec,
    build_record,
    node_slots,
    protected_step,
)
from gemini_dcp.commit.reports import RankReport
from gemini_dcp.commit.slot_pool import SlotPool
from gemini_dcp.errors import InvalidStepError, PeerError, TierFullError
from gemini_dcp.local.record_types import ChecksumOverlay, RankSlot, ShardRef
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.options import GeminiOptions, LocalOptions, PeerOptions

T = TypeVar("T")
CHUNKS = 3  # chunks per rank


# ---- an in-process fake of the collectives (one thread per rank) ----------------------------------
class _Group:
    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=20)
        self.box: list[Any] = [None] * n


class FakeComm:
    """Satisfies :class:`gemini_dcp.commit.protocol.Collectives`; records every collective it runs."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._g = group
        self.rank = rank
        self.world_size = group.n
        self.distributed = group.n > 1
        self.group = None
        self.calls: list[str] = []

    def _exchange(self, obj: Any) -> list[Any]:
        self._g.box[self.rank] = obj
        self._g.barrier.wait()
        out = list(self._g.box)
        self._g.barrier.wait()
        return out

    def all_gather_object(self, obj: T) -> list[T]:
        self.calls.append("all_gather_object")
        return self._exchange(obj)

    def broadcast_object(self, obj: T, src: int) -> T:
        self.calls.append("broadcast_object")
        return self._exchange(obj)[src]

    def run(self, what: str, fn: Callable[..., T], *args: Any, peer: int | None = None, **kwargs: Any) -> T:
        assert what == "all_reduce" and fn is torch.distributed.all_reduce
        self.calls.append("all_reduce")
        (t,) = args
        t.copy_(torch.stack(self._exchange(t.clone())).min(dim=0).values)
        return None  # type: ignore[return-value]


def _run_ranks(n: int, body: Callable[[int, FakeComm], Any]) -> list[Any]:
    """Run ``body(rank, comm)`` on ``n`` threads; each result, or the exception it raised."""
    group = _Group(n)
    comms = [FakeComm(group, r) for r in range(n)]
    out: list[Any] = [None] * n

    def main(r: int) -> None:
        try:
            out[r] = body(r, comms[r])
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[r] = exc

    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    return out


# ---- the simulated job -----------------------------------------------------------------------------
@pytest.fixture
def roots() -> Iterator[list[str]]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    made = [tempfile.mkdtemp(prefix="gemini-cp-", dir=base) for _ in range(3)]
    yield made
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def _meta(step: int) -> Metadata:
    return Metadata(
        state_dict_metadata={f"w{i}": BytesStorageMetadata() for i in range(CHUNKS)},
        storage_meta=StorageMeta(checkpoint_id=f"gemini://cp/step-{step}"),
    )


_PLANNED = _meta(0)  # rank 0 plans the same metadata object save after save


class Job:
    """``n`` ranks, rank r on node ``nodes[r]`` (its own tier root per node), one protocol each."""

    def __init__(self, roots: list[str], nodes: list[int], *, keep: int = 1, replicas: int = 1) -> None:
        self.options = GeminiOptions(local=LocalOptions(keep=keep), peer=PeerOptions(replicas=replicas))
        self.nodes = nodes
        self.tiers = [LocalTier(roots[n], "cp") for n in nodes]
        self.protocols = [
            CommitProtocol(
                self.tiers[r],
                NodeIdentity(node_id=f"node{n}", host=f"host{n}", root_id=(0, n), launch_id="L1",
                             launch_description="launch L1"),
                self.options,
            )
            for r, n in enumerate(nodes)
        ]
        self.comms: list[FakeComm] = []

    def write_local(self, r: int, step: int) -> LocalWrite:
        results = tuple(
            WriteResult(index=MetadataIndex(f"w{i}", [r]), size_in_bytes=64,
                        storage_data=ShardRef(r, 64 * i, 64, step * 1000 + r * 10 + i, "xxh3"))
            for i in range(CHUNKS)
        )
        slot = self.tiers[r].choose_slot(r, self.options.local.keep)
        _touch(self.tiers[r].slot_path(r, slot))  # the leader refuses to commit a record naming a missing slot
        return LocalWrite(slot=slot, results=results, nbytes=64 * CHUNKS)

    def save(self, step: int, *, fail_write: int | None = None, replicate: bool = False,
             hooks: SaveHooks = NO_HOOKS) -> list[Any]:
        def body(r: int, comm: FakeComm) -> Any:
            self.comms.append(comm)

            def write() -> LocalWrite:
                if r == fail_write:
                    raise OSError(f"injected write failure on rank {r}")
                return self.write_local(r, step)

            def repl(step_: int, reports: list[RankReport], expand: Any) -> tuple[tuple[RankSlot, ...], dict[str, Any]]:
                mine = tuple(RankSlot(rep.rank, 9, rep.nbytes) for rep in reports if rep.node_id != reports[r].node_id
                             and rep.rank % len(reports) == (r + 1) % len(reports))
                for rs in mine:
                    _touch(self.tiers[r].slot_path(rs.rank, rs.slot))
                return mine, {"sent_bytes": 0}

            spec = SaveSpec(step=step, planned=_PLANNED if r == 0 else None, use_basis=True)
            return self.protocols[r].save(comm, spec, _Steps(write, repl if replicate else None), hooks=hooks)

        self.comms = []
        return _run_ranks(len(self.nodes), body)


class _Steps:
    """The caller's steps of one save (commit.protocol.SaveSteps): a write, replicas or none, no parity."""

    protects = False

    def __init__(self, write: Callable[[], LocalWrite], repl: Callable[..., Any] | None) -> None:
        self.write_local = write
        self.replicates = repl is not None
        self._repl = repl

    def check_space(self) -> None:
        pass

    def replicate(self, step: int, reports: list[RankReport], expand: Any) -> Any:
        assert self._repl is not None
        return self._repl(step, reports, expand)

    def protect(self, step: int, reports: list[RankReport]) -> Any:
        raise AssertionError("no parity here")

    def after_commit(self, record: Any, rank: int) -> None:
        pass


def _touch(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.touch()


# ---- pure parts ------------------------------------------------------------------------------------
def test_agreement_reads_back_the_min_of_the_prewrite_values() -> None:
    assert Agreement.of([NO_STEP, 0, 0]) == Agreement(global_step=None, repeated=False, failed_step=None)
    assert Agreement.of([7, -1, -(4 + 1)]) == Agreement(global_step=7, repeated=True, failed_step=4)
    assert Agreement.of([0, 0, -1]).failed_step == 0  # step 0 is a step


def _reports(step: int, n: int = 2) -> list[RankReport]:
    return [
        RankReport(rank=r, node_id=f"node{r}", slot=step % 2, nbytes=64 * CHUNKS, results=tuple(
            WriteResult(index=MetadataIndex(f"w{i}", [r]), size_in_bytes=64,
                        storage_data=ShardRef(r, 64 * i, 64, step * 1000 + r * 10 + i, "xxh3"))
            for i in range(CHUNKS)))
        for r in range(n)
    ]


def test_compact_expand_and_overlay_round_trip() -> None:
    first, later = _reports(1), _reports(2)
    layout = {wr.index: wr.storage_data for rep in first for wr in rep.results}
    split = rp.SplitLayout.of(layout)
    assert split.rank_ordered
    sent = [rp.compact(rep, split.by_rank[rep.rank]) for rep in later]
    assert all(s.results == () and s.checksums is not None for s in sent)
    assert [rp.expand(s, split.by_rank) for s in sent] == later
    ov = rp.overlay(split, sent)
    assert isinstance(ov, ChecksumOverlay)
    assert dict(ov) == {wr.index: wr.storage_data for rep in later for wr in rep.results}
    moved = dataclasses.replace(later[1], results=later[1].results[::-1])
    assert rp.compact(moved, split.by_rank[1]) is moved  # another layout: sent whole
    assert rp.overlay(split, [sent[0], moved]) is None  # not every report compact


def test_basis_agreement_needs_the_same_basis_on_every_rank() -> None:
    reps = _reports(1, 3)
    assert not rp.agreed_basis(reps)  # nobody holds one
    same = [dataclasses.replace(r, basis=(4, 9)) for r in reps]
    assert rp.agreed_basis(same)
    assert not rp.agreed_basis([*same[:2], dataclasses.replace(reps[2], basis=(5, 9))])
    assert not rp.agreed_basis([*same[:2], reps[2]])  # a fresh writer holds none


def test_inline_metadata_is_bounded_by_the_padding_it_costs() -> None:
    assert rp.inline_metadata(b"x" * 1000, 8)
    assert not rp.inline_metadata(None, 8)
    assert not rp.inline_metadata(b"x" * (rp.INLINE_METADATA_PADDING // 3 + 1), 4)


def test_build_record_names_every_holder_and_rank_zeros_launch() -> None:
    reps = _reports(3, 3)
    reps[0] = dataclasses.replace(reps[0], launch=("L0", "launch zero"))
    reps[1] = dataclasses.replace(reps[1], replica_slots=(RankSlot(0, 5, 1), RankSlot(2, 5, 1)))
    rec = build_record(job_id="j", step=3, world_size=3, reports=reps, meta=_meta(3), overlay=None,
                       replicas=2, placement="ring", launch=("Lx", "other"))
    assert rec.complete and rec.launch_id == "L0" and rec.launch_description == "launch zero"
    assert rec.holders == {"node0": ("node0", "node1"), "node1": ("node1",), "node2": ("node1", "node2")}
    assert len(rec.metadata.storage_data) == 3 * CHUNKS and rec.rank_nbytes == (64 * CHUNKS,) * 3
    partial = build_record(job_id="j", step=3, world_size=3, reports=_reports(3, 3), meta=None, overlay=None,
                           replicas=1, placement="mixed", launch=("Lx", "other"))
    assert not partial.complete and partial.launch_id == "Lx"
    assert node_slots(reps, "node1") == (RankSlot(1, 1, 64 * CHUNKS), RankSlot(0, 5, 1), RankSlot(2, 5, 1))


def test_eviction_protects_the_step_committed_everywhere() -> None:
    one_node = [dataclasses.replace(r, node_id="n") for r in _reports(5)]
    assert protected_step(5, one_node, "n", 3) == 5  # one node: its record is the whole commit
    assert protected_step(5, _reports(5), "node0", 3) == 3  # several: G
    assert protected_step(5, _reports(5), "node0", None) is None


def test_node_identity_clash_is_refused() -> None:
    reps = _reports(1, 2)
    rp.check_node_identities(reps)
    clash = [dataclasses.replace(reps[0], node_id="n", host="a"), dataclasses.replace(reps[1], node_id="n", host="b")]
    with pytest.raises(Exception, match="more than one machine"):
        rp.check_node_identities(clash)


def test_slot_pool_lookup_budget_and_space(roots: list[str]) -> None:
    tier = LocalTier(roots[0], "pool")
    pool = SlotPool(tier, keep=1, capacity_bytes=8 << 20)
    assert pool.slot(0, 1) is pool.slot(0, 1) and pool.slot(0, 1) is not pool.slot(1, 1)
    pool.grow(pool.slot(0, 0), 4096)
    assert pool.slot(0, 0).capacity >= 4096
    pool.budget_check(1 << 20)
    with pytest.raises(TierFullError, match="capacity_bytes"):
        pool.budget_check(64 << 20)
    pool.check_space(0, 0, 5)  # nothing to reserve ahead
    with pytest.raises(TierFullError, match="capacity_bytes"):
        pool.check_space(0, 16 << 20, 1)  # two 16 MiB slots over an 8 MiB budget


# ---- whole saves over simulated ranks --------------------------------------------------------------
def test_collectives_per_save_are_fixed(roots: list[str]) -> None:
    job = Job(roots, [0, 1])
    assert all(isinstance(r, tuple) for r in job.save(1))
    assert [c.calls for c in job.comms] == [["all_reduce", "all_gather_object"]] * 2
    job.save(2, replicate=False)
    assert [c.calls for c in job.comms] == [["all_reduce", "all_gather_object"]] * 2
    job2 = Job(roots, [0, 1], replicas=2)
    job2.save(3, replicate=True)
    assert [c.calls for c in job2.comms] == [["all_reduce", "all_gather_object", "all_gather_object"]] * 2


def test_metadata_travels_once_and_the_basis_compacts_later_saves(roots: list[str]) -> None:
    job = Job(roots, [0, 1, 1], keep=2)
    job.save(1)
    assert [p.last_metadata_transfer for p in job.protocols] == ["inline"] * 3
    assert [p.last_commit_compact for p in job.protocols] == [False] * 3  # no basis yet
    job.save(2)
    assert [p.last_metadata_transfer for p in job.protocols] == ["none"] * 3  # every rank holds it
    assert [p.last_commit_compact for p in job.protocols] == [True] * 3
    rec = job.tiers[1].record(2)
    assert rec is not None and rec.complete and isinstance(rec.metadata.storage_data, ChecksumOverlay)
    want = {wr.index: wr.storage_data for r in range(3) for wr in job.write_local(r, 2).results}
    assert dict(rec.metadata.storage_data) == want
    assert rec.metadata.storage_meta == _PLANNED.storage_meta
    assert [p.planned_metadata.state_dict_metadata for p in job.protocols] == [_PLANNED.state_dict_metadata] * 3  # type: ignore[union-attr]
    # node 1 holds ranks 1 and 2: its record lists both slots; its leader is rank 1
    assert rec.held_ranks() == (1, 2) and [p.leader for p in job.protocols] == [True, True, False]


def test_a_fresh_writer_without_the_basis_makes_every_rank_gather_in_full(roots: list[str]) -> None:
    job = Job(roots, [0, 1])
    job.save(1)
    job.save(2)
    fresh = Job(roots, [0, 1]).protocols[1]
    job.protocols[1] = fresh  # rank 1 restarted its writer: it holds no basis
    assert all(isinstance(r, tuple) for r in job.save(3))
    # the reports again in full; the unchanged metadata in one broadcast (the fresh writer lacks it)
    gathers = ["all_reduce", "all_gather_object", "all_gather_object", "broadcast_object"]
    assert [c.calls for c in job.comms] == [gathers] * 2
    assert [p.last_commit_compact for p in job.protocols] == [False, False]
    rec = job.tiers[0].record(3)
    assert rec is not None and dict(rec.metadata.storage_data) == {
        wr.index: wr.storage_data for r in range(2) for wr in job.write_local(r, 3).results
    }


def test_a_failed_write_fails_the_save_on_every_rank(roots: list[str]) -> None:
    job = Job(roots, [0, 1])
    copied: list[int] = []
    out = job.save(1, fail_write=1, hooks=SaveHooks(on_local_copy_done=copied.append))
    assert isinstance(out[1], OSError) and isinstance(out[0], PeerError) and "ranks [1]" in str(out[0])
    assert copied == [1, 1]  # the copy-done hook fires even on the rank that failed
    assert job.tiers[0].steps() == [] and job.tiers[1].steps() == []


def test_a_second_save_of_a_step_is_refused_on_every_rank(roots: list[str]) -> None:
    job = Job(roots, [0, 1])
    job.save(1)
    out = job.save(1)
    assert all(isinstance(e, InvalidStepError) for e in out), out


def test_a_record_write_failing_on_one_node_never_loses_the_step_committed_everywhere(roots: list[str]) -> None:
    job = Job(roots, [0, 1], keep=1)
    for step in (1, 2, 3):
        job.save(step)
    assert job.tiers[0].steps() == job.tiers[1].steps() == [2, 3]  # keep=1, plus G=2
    real = job.tiers[1].write_record

    def full(record: Any) -> None:
        raise OSError("No space left on device")

    job.tiers[1].write_record = full  # type: ignore[method-assign]
    out = job.save(4)
    job.tiers[1].write_record = real  # type: ignore[method-assign]
    assert isinstance(out[1], OSError) and isinstance(out[0], tuple)
    # both still hold 3 (node 1 reused step 2's slot for the step that failed there)
    assert job.tiers[0].steps() == [3, 4] and job.tiers[1].steps() == [3]
    job.save(5)
    assert [p.global_step for p in job.protocols] == [3, 3]  # the MIN over nodes: 4 is not everywhere
    assert job.tiers[0].steps() == [3, 5] and job.tiers[1].steps() == [3, 5]


def test_hooks_are_one_value(roots: list[str]) -> None:
    from gemini_dcp.dcp.writer import GeminiStorageWriter

    w = GeminiStorageWriter(root=roots[0], job_id="hooks", replicas=2)
    assert w.hooks is NO_HOOKS and w.hooks.pace is None and w.hooks.on_local_copy_done is None
    assert not hasattr(w, "pace") and not hasattr(w, "replication_pace")  # one name: the hooks' field

    def pacer(n: int) -> None: ...

    pacer.block_bytes = 1 << 20  # type: ignore[attr-defined]
    w.hooks = dataclasses.replace(w.hooks, replication_pace=pacer)
    assert w.hooks == SaveHooks(replication_pace=pacer) and w.hooks.replication_pace is pacer
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.hooks.pace = pacer  # type: ignore[misc]
    job = Job(roots, [0, 1], replicas=2)
    comm = FakeComm(_Group(2), 0)
    assert job.protocols[0].wire_chunk(comm, w.hooks) == 1 << 20  # the paced message size rides in the report
    assert job.protocols[0].wire_chunk(comm, NO_HOOKS) == 0
    w.hooks = NO_HOOKS
    assert w.hooks.replication_pace is None
