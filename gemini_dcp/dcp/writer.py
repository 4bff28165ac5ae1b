"""GeminiStorageWriter: DCP StorageWriter into node CPU memory (+ peers, + persistent).

Call order (driven by ``dcp.save``; **all ranks must call dcp.save together**):

1. ``reset(checkpoint_id)`` — the training step (int) being saved.
2. ``set_up_storage_writer(is_coordinator, ...)``.
3. ``prepare_local_plan`` / ``prepare_global_plan`` — sizes are checked against
   the free space of the tier root here, before any byte is written.
4. ``write_data`` — every rank copies its items into a pre-faulted slot of the
   node's tier and checksums them, replicates the slot to peer nodes, then all
   ranks exchange their write results (a collective on the checkpoint control
   group). Only after that exchange, which proves every rank's shards are
   written and checksummed, does each node's leader atomically write the step
   record (DCP metadata + all checksums) — the commit — and evict old steps.
   Before any byte is written, one all-reduce of three ints (carried by plan
   replay's own agreement when it replays) agrees on G, the newest step committed
   on every node: this save neither overwrites nor evicts it, so a commit that
   fails on some node (a full tmpfs at the record write, a crash) always leaves
   every node holding G.
5. ``finish`` (coordinator) — confirms the commit and hands the step to the
   persistent drain.

A SIGKILL anywhere before (4)'s record rename leaves the previous step as the
newest restorable one; records are renamed into place, never edited.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from array import array
from collections.abc import Mapping
from torch.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ..core.checksum import BLOCK_BYTES, as_bytes, checksum, copy_and_checksum, resolve_algo
from ..transport.comm import Comm, get_comm
from ..transport.p2p import transport_for
from ..peer.push import replicate
from ..core.config import parse_step, resolve_node_id
from ..options import GeminiOptions, resolve_options
from ..errors import ConfigError, InvalidStepError, TierFullError
from ..core.faults import fault_point
from ..core.launch import current_launch
from ..local.tier import LocalTier, hold_launch_lock
from ..local.records import ChecksumOverlay, RankSlot, ShardRef, StepRecord, metadata_shell_blob
from ..core.safe_pickle import restricted_loads
from ..local.slots import ALIGN, SlotFile, align, free_bytes, round_capacity, tier_full_message

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _RankReport:
    """What each rank tells every other rank when sealing a step."""

    rank: int
    node_id: str
    slot: int
    nbytes: int
    results: tuple[WriteResult, ...]
    replica_slots: tuple[RankSlot, ...] = ()  # peer replicas this rank stored for other nodes
    # Rank 0 only, on a planned save: the digest of the planner's global metadata (pickled
    # without storage_data / storage_meta, see records.metadata_shell_blob) and this save's
    # storage_meta. The pickled metadata itself rides inline when small for the world size
    # (all_gather_object pads every rank's part to the largest, so an inline blob costs every
    # rank world_size x its size) and rank 0 did not plan the same metadata last time; else it
    # follows in one broadcast, unless every rank already holds it (``known_metadata``).
    metadata_digest: bytes | None = None
    metadata_blob: bytes | None = None
    storage_meta: StorageMeta | None = None
    # Every rank: the digest of the planned metadata this writer holds from its last save.
    known_metadata: bytes | None = None
    # A save whose results match a known layout (the replayed plan's, or the last committed
    # one) sends only its checksums, in the layout's order for this rank; ``results`` is then
    # empty until :func:`_expand` rebuilds it.
    checksums: tuple[int, ...] | None = None
    # The last committed layout this rank's writer holds, as (step that committed it, chunks);
    # None when it holds none. A plain ``dcp.save`` may use the compact form only when every
    # rank reports the same basis (all hold the same layout); else it gathers again in full.
    basis: tuple[int, int] | None = None
    # Bytes per message this rank sends its slot to peers in (0: one message). Set when the
    # replication is paced (``writer.replication_pace``); receivers post matching receives.
    wire_chunk: int = 0
    # Who this rank's node is, beyond its node id: two machines configured with the same
    # GEMINI_DCP_NODE_ID (same id, another host or tier root) are refused before the commit.
    host: str = ""
    root_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the tier root
    # Rank 0 only: (launch_id, description) of its launch, recorded in the step record.
    launch: tuple[str, str] | None = None


_NO_STEP = 2**63 - 1  # "no step" in the pre-write agreement's MIN all-reduce

# Padding an inline metadata blob may cost each rank at most this much in the report gather.
INLINE_METADATA_PADDING = 16 << 20


def _inline_metadata(blob: bytes | None, world_size: int) -> bool:
    """Whether rank 0's pickled metadata goes inline in the report gather (else: one broadcast)."""
    return blob is not None and len(blob) * max(world_size - 1, 1) <= INLINE_METADATA_PADDING


def _rank_layouts(layout: Mapping[MetadataIndex, ShardRef]) -> dict[int, list[tuple[MetadataIndex, ShardRef]]]:
    """The recorded save's chunks per rank, in that rank's write order (the commit's dict order)."""
    out: dict[int, list[tuple[MetadataIndex, ShardRef]]] = {}
    for idx, ref in layout.items():
        out.setdefault(ref.rank, []).append((idx, ref))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _SplitLayout:
    """A recorded layout split per rank: computed once per layout, not once per save."""

    source: Mapping[MetadataIndex, ShardRef]  # the layout, kept for identity
    by_rank: dict[int, list[tuple[MetadataIndex, ShardRef]]]
    # The layout lists the ranks' chunks in ascending rank order, each rank's together: the
    # ranks' checksums concatenated in rank order are then in the layout's own order.
    rank_ordered: bool

    @classmethod
    def of(cls, layout: Mapping[MetadataIndex, ShardRef]) -> "_SplitLayout":
        ranks = [ref.rank for ref in layout.values()]
        return cls(layout, _rank_layouts(layout), all(a <= b for a, b in zip(ranks, ranks[1:])))


def _base_layout(layout: Mapping[MetadataIndex, ShardRef]) -> Mapping[MetadataIndex, ShardRef]:
    """The chunk locations under ``layout``: an overlay's shared layout (every save of one
    structure has the same one), else ``layout`` itself. Checksums aside, the two agree."""
    return layout.layout if isinstance(layout, ChecksumOverlay) else layout


def _agreed_basis(reports: list["_RankReport"]) -> bool:
    """Every rank holds the same last committed layout (same commit step, same chunk count)."""
    first = reports[0].basis
    return first is not None and all(rep.basis == first for rep in reports)


def _overlay(split: _SplitLayout, reports: list[_RankReport]) -> ChecksumOverlay | None:
    """This save's storage_data as the layout plus checksums, when every report is compact."""
    if not split.rank_ordered or any(rep.checksums is None for rep in reports):
        return None
    ordered = sorted(reports, key=lambda rep: rep.rank)
    sums = array("Q")
    for rep in ordered:
        sums.extend(rep.checksums)  # type: ignore[arg-type]
    return ChecksumOverlay(split.source, sums) if len(sums) == len(split.source) else None


def _compact(report: _RankReport, mine: list[tuple[MetadataIndex, ShardRef]]) -> _RankReport:
    """``report`` with its results replaced by their checksums when they match ``mine``
    (the recorded layout of this rank) in everything but the checksums; else unchanged."""
    res = report.results
    if len(res) != len(mine):
        return report
    for wr, (idx, ref) in zip(res, mine):
        if wr.index != idx or wr.storage_data.with_checksum(ref.checksum) != ref:
            return report
    return dataclasses.replace(report, results=(), checksums=tuple(wr.storage_data.checksum for wr in res))


def _expand(report: _RankReport | None, layouts: dict[int, list[tuple[MetadataIndex, ShardRef]]]) -> _RankReport | None:
    """Rebuild the results of a compact report from the recorded layout of its rank."""
    if report is None or report.checksums is None:
        return report
    mine = layouts.get(report.rank, [])
    results = tuple(
        WriteResult(
            index=idx,
            size_in_bytes=ref.length,
            storage_data=ref.with_checksum(cs),
        )
        for (idx, ref), cs in zip(mine, report.checksums, strict=True)
    )
    return dataclasses.replace(report, results=results, checksums=None)


class GeminiStorageWriter(StorageWriter):
    """Write DCP checkpoints into the CPU memory of this node (and of peers).

    Args:
        root: tier root on a memory-backed filesystem (default ``$GEMINI_DCP_ROOT``
            or ``/dev/shm/gemini_dcp``). Ranks sharing a root are one node.
        job_id: isolates jobs sharing a root (default ``$TORCHELASTIC_RUN_ID`` or ``"default"``).
        keep: committed steps retained in memory (default 2).
        replicas: copies of each node's shards in CPU memory, the node's own included
            (1 = local only; 2 = one peer copy).
        placement: peer placement strategy: ``"mixed"`` (default), ``"group"`` or ``"ring"``.
        checksum: ``"auto"`` (default: ``"crc32c"`` through the C++ extension's fused
            multi-threaded copy+CRC when it is built, else ``"xxh3"``), ``"xxh3"`` or ``"crc32c"``.
        capacity_bytes: optional budget for this job's slots on this node.
        timeout_s: timeout of checkpoint collectives and peer transfers (on the checkpoint
            control group; DCP's own planning gathers wait the *training* group's timeout, see
            docs/failure-semantics.md) and of every persistent-store call.
        on_peer_failure: ``"raise"`` (default) fails the save when a peer copy
            cannot be made; ``"degrade"`` commits with fewer replicas and warns.
        persistent: optional fsspec URL of the persistent tier.
        persist_every: drain every K-th committed step to ``persistent``.
        process_group: the group ``dcp.save`` runs on (default WORLD).
        options: a :class:`gemini_dcp.options.GeminiOptions` tree (e.g. ``GeminiOptions.from_env()``)
            instead of, or with, the keywords above: a keyword left at its default takes the
            options' value; a keyword and an options field set to different values is a ConfigError.

    Steps: each ``checkpoint_id`` is an int step in ``[0, 2**63)``. A step is evicted from
    a node only once every node has committed a newer one: the newest step known committed
    everywhere stays until then, so a save that commits on some nodes only (a full tmpfs at
    the record write, a crash) never leaves nodes holding different steps.

    Saving a step twice: a second save of a step *this launch* already committed is
    refused with InvalidStepError (saving model and optimizer with two ``dcp.save`` calls
    would otherwise replace one with the other: put both in one state dict, or use two
    writers with separate job ids). A step saved by another launch (before a restart)
    is replaced, and the replacement is logged.

    One live launch per job: constructing a writer holds a lock for this launch in the
    job directory while the writer lives; a second *live* launch with the same root and
    job id is refused with JobConflictError (a dead one, e.g. before a torchrun restart,
    never blocks). Records of steps newer than the one being saved are deleted only when a
    restore in this launch went back past them.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        job_id: str | None = None,
        *,
        keep: int = 2,
        replicas: int = 1,
        placement: str = "mixed",
        checksum: str = "auto",
        capacity_bytes: int | None = None,
        timeout_s: float = 300.0,
        on_peer_failure: str = "raise",
        persistent: str | None = None,
        persist_every: int = 10,
        persist_keep: int | None = 2,
        persist_keep_every: int | None = None,
        process_group: Any = None,
        options: GeminiOptions | None = None,
    ) -> None:
        super().__init__()
        # Every option is validated before anything is created (tier or persistent directories):
        # ``options`` merged with the keywords (a keyword and an options field set to different
        # values is a ConfigError), the drain settings from the environment when no options are given.
        self.gemini_options: GeminiOptions = resolve_options(
            options, root=root, job_id=job_id, keep=keep, replicas=replicas, placement=placement, checksum=checksum,
            capacity_bytes=capacity_bytes, timeout_s=timeout_s, on_peer_failure=on_peer_failure,
            persistent=persistent, persist_every=persist_every, persist_keep=persist_keep,
            persist_keep_every=persist_keep_every,
        )
        cfg = self.gemini_options
        self.options = cfg.tier_options()
        self._algo = resolve_algo(self.options.checksum)
        self.tier = LocalTier(cfg.local.root, cfg.local.job_id)
        self.root: Path = self.tier.root
        self.job_id: str = self.tier.job_id
        self.node_id = cfg.local.node_id or resolve_node_id(self.root)
        self.launch = current_launch()
        hold_launch_lock(self.tier, self.launch, self)  # JobConflictError if another live launch uses the job
        st = os.stat(self.root)
        self._root_id = (st.st_dev, st.st_ino)
        self._leader: bool | None = None  # this rank is its node's lowest rank (known after a save)
        self._failed_commit: int | None = None  # a step whose record write failed on this node
        self.global_step: int | None = None  # newest step known committed on every node (last save)
        self._warned_replicas = False
        self.process_group = process_group
        self._step: int | None = None
        self._is_coordinator = True
        self._rank = 0
        self._slots: dict[tuple[int, int], SlotFile] = {}
        self._pending_record: StepRecord | None = None
        # The newest step this writer saw committed, on every rank (dcp.save and replayed saves alike).
        self.last_committed_step: int | None = None
        self.last_save_seconds: float | None = None
        self.last_replication: dict[str, Any] = {}
        # The global metadata of the last save (rank 0's plan, known to every rank after the commit gather).
        self.planned_metadata: Metadata | None = None
        # (digest, shell) of the planned metadata of the last save (see _RankReport.metadata_digest).
        self._known_metadata: tuple[bytes | None, Metadata | None] = (None, None)
        self.last_metadata_transfer = "none"  # how the last save's metadata reached this rank
        # Where every rank's chunks of the last committed save live (index -> ShardRef), known to every rank.
        self.committed_layout: Mapping[MetadataIndex, ShardRef] | None = None
        self.last_commit_compact = False  # the last commit gather sent this rank's checksums only
        self._split: _SplitLayout | None = None  # the replay layout, split per rank (cached)
        # The chunk locations of the last committed save and the step that first committed
        # them: a plain dcp.save of the same structure sends only checksums against it.
        self._basis: tuple[tuple[int, int], Mapping[MetadataIndex, ShardRef]] | None = None
        self.persistent = None
        pcfg = cfg.persistent
        if pcfg.url is not None:
            from ..persistent.store import PersistentTier  # noqa: PLC0415 - optional tier

            self.persistent = PersistentTier(
                str(pcfg.url),
                self.job_id,
                keep=pcfg.keep,
                keep_every=pcfg.keep_every,
                writable=True,
                storage_options=dict(pcfg.storage_options) if pcfg.storage_options is not None else None,
                timeout_s=cfg.persistent_timeout_s,  # bounds every store call (probe, drain uploads)
            )
        self.persist_every = pcfg.every
        self._drainer = None
        if self.persistent is not None:
            from ..persistent.drain.client import Drainer  # noqa: PLC0415 - optional tier

            self._drainer = Drainer(self.tier, self.persistent, pcfg.every, options=pcfg.drain, keep=self.options.keep)
            self._drainer.resume()  # drains left pending by a previous worker generation
            self._drainer.start_early()  # the first due step finds its drain running (torch imported)
        # Called with the step once this rank's bytes are in the tier (before the
        # commit collectives): the async snapshot guard releases the optimizer here.
        self.on_local_copy_done: Callable[[int], None] | None = None
        # Optional pacing of the local copy (gemini_dcp.snapshot.checkpointer / interleave): called with
        # each block's size before it is copied; ``pace.block_bytes`` sets the block size.
        self.pace: Callable[[int], None] | None = None
        # Optional pacing of the peer replication, the same contract: called with each message's
        # size before this rank sends it; ``replication_pace.block_bytes`` sets the message size.
        self.replication_pace: Callable[[int], None] | None = None

    # ---- StorageWriter API -------------------------------------------------------------
    @property
    def checkpoint_id(self) -> int | None:
        return self._step

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        self._step = None if checkpoint_id is None else parse_step(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator
        self._rank = int(kwargs.get("rank", _default_rank()))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._require_step()
        self._check_space(plan)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Copy this rank's items into the tier and commit the step collectively.

        Collective over the checkpoint control group: all ranks call it (DCP does).
        """
        comm = get_comm(self.options.timeout_s, self.process_group)
        planned = getattr(planner, "metadata", None) if comm.rank == 0 else None  # the coordinator's global metadata
        results = self._write_and_commit(
            comm, plan, planner, planned if isinstance(planned, Metadata) else None, None, use_basis=True
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def write_replayed(
        self,
        plan: SavePlan,
        planner: SavePlanner,
        metadata: Metadata,
        layout: Mapping[MetadataIndex, ShardRef] | None = None,
        agreed: list[int] | None = None,
    ) -> list[WriteResult]:
        """Write ``plan`` and commit with ``metadata``, both from an earlier ``dcp.save
        of a state dict of the same structure (:mod:`gemini_dcp.snapshot.replay`).

        Call after ``reset(step)`` and ``set_up_storage_writer``; the space check of
        ``prepare_local_plan`` runs inside, so that a rank that fails it meets the
        others in the commit gather (all raise). The commit is ``write_data``'s
        (``finish`` is not needed). Collective over the checkpoint control group:
        all ranks call it together, each with its own final plan of the *same*
        earlier save.

        ``layout``: that save's :attr:`committed_layout` (the same on every rank).
        A rank whose chunks land where they did then sends only their checksums in
        the commit gather, and every rank rebuilds the write results from the
        layout; a rank whose layout differs sends them whole.

        ``agreed``: :meth:`prewrite_values` of this step already combined by MIN over all
        ranks (the caller's own agreement collective carried them); else one all-reduce runs.
        All ranks pass it, or none.
        """
        comm = get_comm(self.options.timeout_s, self.process_group)
        return self._write_and_commit(
            comm, plan, planner, None, metadata, check_space=True, layout=layout, agreed=agreed
        )

    def _write_and_commit(
        self,
        comm: Comm,
        plan: SavePlan,
        planner: SavePlanner,
        planned: Metadata | None,
        known: Metadata | None,
        *,
        check_space: bool = False,
        layout: Mapping[MetadataIndex, ShardRef] | None = None,
        use_basis: bool = False,
        agreed: list[int] | None = None,
    ) -> list[WriteResult]:
        """The body of a save. ``planned``: rank 0's metadata, sent to every rank in the
        report gather; ``known``: metadata every rank already has (nothing to send).

        ``layout``: a layout every rank holds (the replayed plan's): results matching it
        go compact. ``use_basis``: compact against this writer's last committed layout
        instead, which a rank may lack (a fresh writer): the reports say which one each
        rank holds, and unless all agree every rank gathers its full results again.
        """
        t0 = time.perf_counter()
        step = self._require_step()
        rank = comm.rank
        basis: tuple[int, int] | None = None
        if use_basis and self._basis is not None and comm.distributed:
            basis, layout = self._basis
        error: BaseException | None = None
        report: _RankReport | None = None
        planned_blob: bytes | None = None
        digest: bytes | None = None
        try:
            # First, before any byte is written: every rank reaches it (an error it raises is the
            # same on every rank, and goes through the report gather like any other).
            if agreed is not None:
                self._apply_agreement(step, agreed)
            else:
                self._agree_before_write(comm, step)
            if planned is not None and comm.distributed:
                planned_blob = metadata_shell_blob(planned)
                digest = xxhash.xxh3_128_digest(planned_blob)
            if check_space:
                self.prepare_local_plan(plan)
            fault_point("save.before_copy")
            slot_idx, slot, results, nbytes = self._write_local(plan, planner, step, rank)
            fault_point("save.after_copy")
            # Unchanged since rank 0's last save: every rank probably holds it (checked after the gather).
            inline = _inline_metadata(planned_blob, comm.world_size) and digest != self._known_metadata[0]
            report = _RankReport(
                rank=rank, node_id=self.node_id, slot=slot_idx, nbytes=nbytes, results=results,
                metadata_digest=digest, metadata_blob=planned_blob if inline else None,
                storage_meta=planned.storage_meta if digest is not None and planned is not None else None,
                known_metadata=self._known_metadata[0], basis=basis, wire_chunk=self._wire_chunk(comm),
                host=self.launch.host, root_id=self._root_id,
                launch=(self.launch.launch_id, self.launch.description) if rank == 0 else None,
            )
        except BaseException as exc:  # reported to every rank below, then re-raised
            error = exc
        finally:
            if self.on_local_copy_done is not None:
                self.on_local_copy_done(step)
        split = self._split_layout(layout)
        layouts = split.by_rank if split is not None else None
        sent = report
        if layouts is not None and report is not None:
            sent = _compact(report, layouts.get(rank, []))
        self.last_commit_compact = sent is not report
        reports = comm.all_gather_object(sent)
        self._raise_if_failed(error, reports, "writing shards into the local tier")
        fault_point("save.after_gather")
        assert report is not None
        _check_node_identities(reports)  # same result on every rank: all raise, before any commit
        if use_basis and not _agreed_basis(reports):
            # Some rank lacks this layout (or holds another): it could not rebuild compact
            # reports. Every rank sees the same reports, so all take this branch together.
            split = layouts = None
            if any(rep.checksums is not None for rep in reports):
                reports = comm.all_gather_object(report)
            self.last_commit_compact = False
        # Replayed save, every rank compact: keep the reports compact and record the layout plus
        # the checksums; otherwise rebuild every rank's write results.
        overlay = _overlay(split, reports) if split is not None else None
        if layouts is not None and overlay is None:
            reports = [_expand(rep, layouts) for rep in reports]
        meta = known if known is not None else self._gathered_metadata(comm, planned, planned_blob, reports)
        self.planned_metadata = meta
        if self.options.replicas > 1:
            self._warn_replicas_capped(len({rep.node_id for rep in reports}))
        if self.options.replicas > 1 and comm.distributed:
            expand = (lambda rep: _expand(rep, layouts)) if overlay is not None else None
            replica_slots, self.last_replication, self._node_order = replicate(
                comm, transport_for(comm), step, reports, options=self.options, tier=self.tier, slot=self.slot,
                budget_check=self.budget_check, previous_order=getattr(self, "_node_order", None),
                pace=self.replication_pace, expand=expand,
            )
            # Only the replica slots are new: every rank already has every report.
            gathered = comm.all_gather_object(replica_slots)
            reports = [dataclasses.replace(rep, replica_slots=rs) for rep, rs in zip(reports, gathered)]
            fault_point("replicate.after")
        record = self._build_record(step, comm, reports, meta, overlay)
        self.committed_layout = record.metadata.storage_data
        self._remember_basis(step, overlay, record.metadata.storage_data)
        self._commit_on_node(record, reports, rank)
        if record.complete:  # else the coordinator's finish() completes it
            self.last_committed_step = step
        self._after_commit(self._pending_record or record, rank)
        self.last_save_seconds = time.perf_counter() - t0
        return list(report.results)

    def _agree_before_write(self, comm: Comm, step: int) -> None:
        """Collective (one all-reduce of three ints on the control group, before any byte is
        written; all ranks call it): agree on G, the newest step committed on every node,
        which this save must neither overwrite nor evict; refuse on every rank a second save
        of a step this launch already committed; tell every rank about a record write that
        failed on some node at the previous save.

        A replayed save (:mod:`gemini_dcp.snapshot.replay`) carries these values in its own
        agreement all-reduce instead: :meth:`prewrite_values`, then ``write_replayed(agreed=)``.
        """
        vals = self.prewrite_values(step)
        if comm.distributed:
            vals = transport_for(comm).all_reduce_ints(vals, "min")
        self._apply_agreement(step, vals)

    def prewrite_values(self, step: int) -> list[int]:
        """This rank's part of the pre-write agreement of saving ``step``: three int64 values,
        each combined over all ranks by MIN (local work; see :meth:`_agree_before_write`).

        Each node's newest step comes from its leader (its records are renamed by the leader
        after the previous commit gather, so another rank of the node may list them too
        early); a rank that does not know yet whether it leads (a fresh writer) reports too:
        the minimum over nodes is only more conservative.
        """
        newest: int | None = None
        again = False
        try:
            steps = self.tier.steps()
            if self._leader is not False:
                newest = next((s for s in reversed(steps) if s < step and self.tier.record(s) is not None), None)
            if step in steps:
                rec = self.tier.record(step)
                again = rec is not None and bool(rec.launch_id) and rec.launch_id == self.launch.launch_id
                if rec is not None and not again and self._leader is not False:
                    log.warning(
                        "step %s of job %r in %s was saved by another launch (%s): this save replaces it.",
                        step, self.job_id, self.root, rec.launch_description or "unknown",
                    )
        except OSError as exc:  # the save itself reports an unusable tier; G stays unknown here
            log.warning("step %s: could not list this node's records: %s", step, exc)
        failed = self._failed_commit
        return [_NO_STEP if newest is None else newest, -int(again), -(failed + 1) if failed is not None else 0]

    def _apply_agreement(self, step: int, vals: list[int]) -> None:
        """Act on the agreed (MIN over ranks) :meth:`prewrite_values`: the same on every rank."""
        self._failed_commit = None
        g = None if vals[0] == _NO_STEP else vals[0]
        if vals[2] < 0:
            log.warning(
                "step %s was not committed on every node (a record write failed there): it is not restorable; "
                "step %s stays the restore point until a later save commits everywhere.", -vals[2] - 1, g,
            )
        if vals[1] < 0:
            raise InvalidStepError(
                f"step {step} was already saved by this launch ({self.launch.description}) in job {self.job_id!r}: a "
                "second dcp.save of the same step would replace the first. Save model and optimizer in one state "
                "dict (dcp.save({'model': ..., 'optim': ...})), or give each its own writer with a separate job_id."
            )
        self.global_step = g
        self.tier.begin_save(step, g)

    def _warn_replicas_capped(self, nodes: int) -> None:
        if self.options.replicas > nodes and not self._warned_replicas:
            self._warned_replicas = True
            log.warning(
                "replicas=%s but the job runs on %s node(s): each node's shards get at most %s cop%s (the node's "
                "own included). Lower replicas, or run on more nodes (ranks sharing a tier root are one node).",
                self.options.replicas, nodes, nodes, "y" if nodes == 1 else "ies",
            )

    def _wire_chunk(self, comm: Comm) -> int:
        """Message size of this rank's paced replication (0: one message, unpaced)."""
        pace = self.replication_pace
        if pace is None or self.options.replicas <= 1 or not comm.distributed:
            return 0
        return max(1, int(getattr(pace, "block_bytes", 0) or BLOCK_BYTES))

    def _gathered_metadata(
        self, comm: Comm, planned: Metadata | None, planned_blob: bytes | None, reports: list[_RankReport]
    ) -> Metadata | None:
        """Rank 0's planned metadata on every rank: the copy every rank already holds when it
        is unchanged, else from rank 0's report or — large for the world size — one broadcast
        that every rank joins (every rank sees the same reports, so all decide alike)."""
        first = reports[0]
        digest = first.metadata_digest
        if digest is None:  # one process (nothing to share), or a planner without metadata
            return planned if comm.rank == 0 else None
        held_digest, held = self._known_metadata
        if held_digest != digest or held is None:
            held = None
        if first.metadata_blob is not None:
            self.last_metadata_transfer = "inline"
            blob = first.metadata_blob
        elif all(rep.known_metadata == digest for rep in reports):
            self.last_metadata_transfer = "none"
            blob = None
        else:
            self.last_metadata_transfer = "broadcast"
            blob = comm.broadcast_object(planned_blob if comm.rank == 0 else None, src=0)
        if held is None:
            if comm.rank == 0 and planned is not None:
                held = dataclasses.replace(planned, storage_data=None, storage_meta=None)
            else:
                assert blob is not None, "metadata unchanged on every rank, yet this rank holds none"
                held = restricted_loads(blob, source="rank 0's checkpoint metadata")
        # The same shell objects save after save: records.metadata_shell_blob reuses its pickle.
        self._known_metadata = (digest, held)
        return dataclasses.replace(held, storage_meta=first.storage_meta)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: confirm the commit (writing the final metadata if the
        planner did not expose it during ``write_data``) and schedule the drain."""
        step = self._require_step()
        rec = self._pending_record
        if rec is not None and not rec.complete:
            storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
            final = dataclasses.replace(rec, metadata=dataclasses.replace(metadata, storage_data=storage_data), complete=True)
            self.tier.write_record(final)
            if self._drainer is not None:
                try:
                    self._drainer.restage(final)
                except OSError as exc:  # the in-memory commit stands; the drain still finds it in the tier
                    log.warning("step %s: could not restage the completed record for the drain: %s", step, exc)
        self.last_committed_step = step

    def _after_commit(self, record: StepRecord, rank: int) -> None:
        """Hook run on every rank once ``record`` is committed on this node (end of write_data).

        The persistent tier schedules its background drain from here: the node
        leader writes a request on tmpfs and wakes the drain server (~1 ms);
        training never waits for the upload (see ``gemini_dcp.persistent.drain``).
        """
        if self._drainer is None:
            return
        try:
            self._drainer.submit(record, rank)
        except Exception as exc:  # noqa: BLE001 - the in-memory commit stands; a drain request must not fail it
            log.warning("step %s: could not schedule the persistent drain: %s", record.step, exc)

    def wait_persisted(self, step: int | None = None, timeout_s: float | None = None) -> int | None:
        """Block until ``step`` is durable in the persistent tier; returns the newest durable step.

        Call it after the last ``dcp.save`` and before the trainer exits: the drain runs in the
        background, and the step is durable only once its ``.metadata`` is committed in the store.
        ``step`` None: the newest step this writer committed with a drain due (``persist_every``);
        a step superseded in the drain queue by a newer one is durable when that one is. Bounded:
        ``timeout_s`` None is the writer's persistent timeout (``persistent_timeout_s``). Raises
        PersistentTierError with the drain's reason when the drain failed, PersistentTimeoutError
        (a PersistentTierError) on timeout, ConfigError without ``persistent=``. Any rank may call it.
        """
        if self._drainer is None:
            raise ConfigError("wait_persisted: this writer has no persistent tier; pass persistent=<fsspec URL>.")
        return self._drainer.wait_persisted(step, timeout_s)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"gemini://{self.job_id}/step-{self._step}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str] | int) -> bool:
        try:
            parse_step(checkpoint_id)
        except InvalidStepError:
            return False
        return True

    # ---- internals -----------------------------------------------------------------------
    def _require_step(self) -> int:
        if self._step is None:
            raise InvalidStepError(
                "no step given: call dcp.save(state_dict, storage_writer=writer, checkpoint_id=step) "
                "with the training step as an int."
            )
        return self._step

    @staticmethod
    def _raise_if_failed(error: BaseException | None, reports: list[Any], what: str) -> None:
        if error is not None:
            raise error
        failed = [r for r, rep in enumerate(reports) if rep is None]
        if failed:
            from ..errors import PeerError  # noqa: PLC0415

            raise PeerError(f"ranks {failed} failed while {what}; the step was not committed (see their errors).")

    def slot(self, rank: int, idx: int) -> SlotFile:
        """This node's slot ``idx`` of ``rank`` (opened on first use)."""
        return self._slot(rank, idx)

    def budget_check(self, delta: int) -> None:
        """Raise TierFullError when growing this job's tier by ``delta`` bytes would break ``capacity_bytes``."""
        self._budget_check(delta)

    def _slot(self, rank: int, idx: int) -> SlotFile:
        key = (rank, idx)
        slot = self._slots.get(key)
        if slot is None:
            path = self.tier.slot_path(rank, idx)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            slot = SlotFile(path)
            self._slots[key] = slot
        return slot

    def _budget_check(self, delta: int) -> None:
        cap = self.options.capacity_bytes
        if cap is not None:
            used = self.tier.usage_bytes()
            if used + delta > cap:
                raise TierFullError(
                    f"job {self.job_id!r} would use {(used + delta) / 2**30:.3f} GiB in {self.root}, over its "
                    f"capacity_bytes budget of {cap / 2**30:.3f} GiB: raise capacity_bytes or lower keep."
                )

    def _check_space(self, plan: SavePlan) -> None:
        """Fail before writing when the ring of slots cannot fit in the tier root."""
        tensor_bytes = sum(_planned_bytes(item) for item in plan.items)
        if tensor_bytes == 0:
            # Nothing to reserve ahead (no tensor bytes; a few pickled items at most): the
            # write grows the slot to what it really needs, and checks the space then.
            return
        need = tensor_bytes + ALIGN * len(plan.items)
        cap = round_capacity(need)
        rank = self._rank
        missing = 0
        for idx in range(self.options.keep + 1):
            path = self.tier.slot_path(rank, idx)
            have = path.stat().st_size if path.exists() else 0
            missing += max(0, cap - have)
        if missing:
            self._budget_check(missing)
            free = free_bytes(self.root)
            if missing > free:
                raise TierFullError(
                    tier_full_message(self.root, missing, free, f"{self.options.keep + 1} slots of {cap / 2**20:.1f} MiB for rank {rank}")
                )

    def _write_local(
        self, plan: SavePlan, planner: SavePlanner, step: int, rank: int
    ) -> tuple[int, SlotFile, tuple[WriteResult, ...], int]:
        algo = self._algo
        entries: list[tuple[WriteItem, torch.Tensor, str | None, tuple[int, ...] | None]] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)  # type: ignore[arg-type]
                entries.append((item, torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8), None, None))
            else:
                t = planner.resolve_data(item)
                assert isinstance(t, torch.Tensor)
                t = t.detach()
                entries.append((item, t, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        offsets: list[int] = []
        total = 0
        for _, t, _, _ in entries:
            offsets.append(total)
            total = align(total + t.numel() * t.element_size())
        slot_idx = self.tier.choose_slot(rank, self.options.keep)
        slot = self._slot(rank, slot_idx)
        # --- async snapshot pacing: default (pace None) is the unpaced 4 MiB-block copy ---
        pace = self.pace
        block = int(getattr(pace, "block_bytes", 0) or BLOCK_BYTES)
        with slot.lock:
            slot.ensure_capacity(total, budget_check=self._budget_check)
            results: list[WriteResult] = []
            for (item, t, dtype, shape), off in zip(entries, offsets):
                n = t.numel() * t.element_size()
                dst = slot.view(off, n)
                src = as_bytes(t)
                if src is not None:
                    cs = copy_and_checksum(dst, src, algo, block, pace=pace)
                else:
                    if pace is not None and n:
                        pace(n)
                    dst.view(t.dtype).view(t.shape).copy_(t)
                    cs = checksum(dst, algo)
                ref = ShardRef(rank=rank, offset=off, length=n, checksum=cs, algo=algo, dtype=dtype, shape=shape)
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=ref))
                if len(results) == max(1, len(entries) // 2): fault_point("save.mid_copy")
        return slot_idx, slot, tuple(results), total

    def _remember_basis(
        self, step: int, overlay: ChecksumOverlay | None, storage_data: Mapping[MetadataIndex, ShardRef]
    ) -> None:
        """Keep the committed chunk locations for the next plain save to compact against.

        Decided from the gathered reports alone, so every rank keeps the same basis: an
        overlay on the kept layout keeps it (and its step); any other layout starts a new one.
        """
        base = _base_layout(storage_data)
        if overlay is not None and self._basis is not None and self._basis[1] is base:
            return
        self._basis = ((step, len(base)), base)

    def _split_layout(self, layout: Mapping[MetadataIndex, ShardRef] | None) -> _SplitLayout | None:
        if layout is None:
            return None
        layout = _base_layout(layout)
        split = self._split
        if split is None or split.source is not layout:
            split = self._split = _SplitLayout.of(layout)
        return split

    def _build_record(
        self, step: int, comm: Comm, reports: list[_RankReport], meta: Metadata | None,
        overlay: ChecksumOverlay | None = None,
    ) -> StepRecord:
        storage_data: Any = overlay
        if storage_data is None:
            storage_data = {wr.index: wr.storage_data for rep in reports for wr in rep.results}
        complete = meta is not None
        if meta is None:
            meta = Metadata(state_dict_metadata={})
        metadata = dataclasses.replace(meta, storage_data=storage_data)
        rank_nodes = tuple(rep.node_id for rep in reports)
        launch_id, launch_desc = reports[0].launch or (self.launch.launch_id, self.launch.description)
        holders: dict[str, set[str]] = {n: {n} for n in rank_nodes}
        for rep in reports:
            for rs in rep.replica_slots:
                holders[rank_nodes[rs.rank]].add(rep.node_id)
        return StepRecord(
            job_id=self.job_id,
            step=step,
            world_size=comm.world_size,
            metadata=metadata,
            rank_nodes=rank_nodes,
            rank_nbytes=tuple(rep.nbytes for rep in reports),
            holders={k: tuple(sorted(v)) for k, v in holders.items()},
            replicas=self.options.replicas,
            placement=self.options.placement,
            complete=complete,
            launch_id=launch_id,
            launch_description=launch_desc,
        )

    def _commit_on_node(self, record: StepRecord, reports: list[_RankReport], rank: int) -> None:
        """The node leader (lowest rank on this node) writes the record and evicts old steps."""
        mine = [rep for rep in reports if rep.node_id == self.node_id]
        node_record = record.for_node(
            self.node_id,
            tuple(RankSlot(rep.rank, rep.slot, rep.nbytes) for rep in mine)
            + tuple(rs for rep in mine for rs in rep.replica_slots),
        )
        self._pending_record = node_record
        self._leader = rank == min(rep.rank for rep in mine)
        if self._leader:
            fault_point("commit.before_record")
            try:
                self.tier.write_record(node_record)
            except BaseException:
                # Not committed on this node; the previous steps are untouched (nothing was evicted).
                # DCP reports this to every rank; the next save tells every rank as well.
                self._failed_commit = record.step
                raise
            fault_point("commit.after_record")
            # One node: its record is the whole commit, so the step just written is committed
            # everywhere. Several: the others' records are known at the next save's agreement.
            single = all(rep.node_id == self.node_id for rep in reports)
            g = record.step if single else self.global_step
            evicted = self.tier.retain(self.options.keep, record.step, g, self.launch.launch_id)
            fault_point("commit.after_evict")
            if evicted:
                log.debug("node %s evicted steps %s", self.node_id, evicted)


def _check_node_identities(reports: list[_RankReport]) -> None:
    """ConfigError when one node id names two machines (or two tier roots): their records
    would claim each other's slots, and no restore could ever find the step."""
    seen: dict[str, dict[tuple[str, tuple[int, int]], list[int]]] = {}
    for rep in reports:
        seen.setdefault(rep.node_id, {}).setdefault((rep.host, rep.root_id), []).append(rep.rank)
    clashes = {node: places for node, places in seen.items() if len(places) > 1}
    if clashes:
        node, places = next(iter(clashes.items()))
        where = "; ".join(
            f"ranks {ranks} on host {host} (root device/inode {rid[0]}/{rid[1]})" for (host, rid), ranks in places.items()
        )
        raise ConfigError(
            f"node id {node!r} is used by more than one machine or tier root: {where}. Nothing was committed. "
            "Every node needs its own GEMINI_DCP_NODE_ID (or leave it unset: the default is <hostname>:<root>)."
        )


def _planned_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    numel = 1
    for d in item.tensor_data.chunk.sizes:
        numel *= d
    dtype = item.tensor_data.properties.dtype
    return numel * torch.empty(0, dtype=dtype).element_size()


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
