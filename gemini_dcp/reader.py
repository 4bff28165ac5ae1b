"""GeminiStorageReader: DCP StorageReader that restores from the fastest surviving copy.

Call order (driven by ``dcp.load``; **all ranks must call dcp.load together**):

1. ``reset(checkpoint_id)`` — optional: a step to load (default: the newest restorable).
2. ``read_metadata`` — collective: every rank reports what its node holds, all
   ranks run the same decision (:func:`restore_plan.decide`) and agree on one
   step; the step record is broadcast from a node that has it.
3. ``prepare_global_plan`` (coordinator) — assigns, for each chunk a rank needs
   and its node does not hold, a peer rank that holds it, spreading bytes over
   the holders.
4. ``read_data`` — collective: local chunks are verified and copied from the
   mmap'd slot files (zero copy until the final copy into the live tensors);
   peer chunks arrive over the checkpoint control group; a chunk whose checksum
   fails is fetched again from another copy (peer, then persistent); finally the
   per-tier byte counts are summed over all ranks into ``restored_from``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
import time
import traceback
from torch.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, LoadItemType, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .checksum import as_bytes, checksum, checksum_then_copy
from .compat import failed_metadata, raise_if_failed
from .comm import Comm, get_comm
from .config import parse_step, resolve_node_id
from .errors import ChecksumMismatchError, GeminiError, ShardUnavailableError
from .faults import fault_point
from .local_tier import LocalTier
from .records import ShardRef, StepRecord
from .restore_plan import NodeView, RestoreDecision, StepView, Unrestorable, decide, unrestorable_error
from .slots import ReadOnlySlot

if TYPE_CHECKING:
    from .peer import Tally

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "persistent")
ItemKey = tuple[int, int]  # (saving rank, offset in its slot): one stored item


class GeminiStorageReader(StorageReader):
    """Load DCP checkpoints from node memory, peer memory, then persistent storage.

    After ``dcp.load``: ``restored_step`` is the step loaded, ``restored_from``
    maps tier name → bytes read from it summed over all ranks (``rank_restored_from``:
    this rank only), ``restore_seconds`` the wall time of the restore.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        job_id: str | None = None,
        *,
        persistent: str | None = None,
        timeout_s: float = 300.0,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        self.tier = LocalTier(root, job_id)
        self.root: Path = self.tier.root
        self.job_id: str = self.tier.job_id
        self.node_id = resolve_node_id(self.root)
        self.timeout_s = timeout_s
        self.process_group = process_group
        self.persistent = None
        if persistent is not None:
            from .persistent import PersistentTier  # noqa: PLC0415

            self.persistent = PersistentTier(persistent, self.job_id, timeout_s=timeout_s)  # every store call bounded
        self._requested: int | None = None
        self._metadata_error: Exception | None = None
        self._decision: RestoreDecision | None = None
        self._record: StepRecord | None = None
        self._local: dict[int, Path] = {}
        self._maps: dict[Path, ReadOnlySlot] = {}
        self._t0 = 0.0
        self.restored_step: int | None = None
        self.restored_from: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.rank_restored_from: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.restore_seconds: float | None = None

    # ---- StorageReader API -------------------------------------------------------------
    @property
    def checkpoint_id(self) -> int | None:
        return self._requested

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Select a step. With a step given (as ``dcp.load(..., checkpoint_id=step)`` does
        on every rank), the collective restore decision runs here, so an unknown or
        unrestorable step raises our error directly instead of inside DCP's wrapper."""
        self._requested = None if checkpoint_id is None else parse_step(checkpoint_id)
        self._decision = None
        self._record = None
        if self._requested is not None:
            self._decide()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Collective: agree on the step to restore and return its DCP metadata.

        A call with arguments is DCP's "rank-local metadata" retry after this call raised
        (torch >= 2.10); it runs no collective (the other ranks are not in it) and answers with
        a stand-in that re-raises the first error (``compat.failed_metadata``), so that the
        error reaches the caller on torch releases whose ``dcp.load`` drops it.
        """
        if args or kwargs:
            if self._metadata_error is None:
                raise ShardUnavailableError("gemini_dcp has no rank-local metadata: the restore decision is collective.")
            return failed_metadata(self._metadata_error)
        self._metadata_error = None
        try:
            return self._read_metadata()
        except Exception as exc:
            self._metadata_error = exc
            raise

    def _read_metadata(self) -> Metadata:
        if self._decision is None:
            self._decide()
        if self._record is None:
            assert self.persistent is not None and self._decision is not None
            return self.persistent.read_metadata(self._decision.step)
        return self._record.metadata

    def _decide(self) -> None:
        """Collective: gather every node's view, decide, broadcast the chosen record."""
        self._t0 = time.perf_counter()
        comm = self._comm()
        view: NodeView | None = None
        local_error: BaseException | None = None
        try:
            view = self._node_view(comm.rank)
        except GeminiError as exc:
            local_error = exc
        persisted: list[int] = []
        if self.persistent is not None and comm.rank == 0:
            persisted = self.persistent.committed_steps()
        views = comm.all_gather_object(view)
        persisted = comm.broadcast_object(persisted, src=0)
        if local_error is not None:
            raise local_error
        if any(v is None for v in views):
            raise ShardUnavailableError("another rank could not read its tier root; see its error.")
        try:
            decision = decide(views, self._requested, self.job_id, persisted)  # same result on every rank
        except ShardUnavailableError as exc:
            problems = getattr(exc, "problems", ())
            if not problems:
                raise
            raise unrestorable_error(self.job_id, problems, bool(persisted), self._describe(comm, problems)) from None
        self._local = {}
        if decision.fingerprint is None:
            self._decision, self._record = decision, None
            return
        record = self.tier.record(decision.step) if comm.rank == decision.record_src else None
        record = comm.broadcast_object(record, src=decision.record_src)  # type: ignore[arg-type]
        assert record is not None
        mine = self.tier.record(decision.step)
        if mine is not None and mine.fingerprint() == decision.fingerprint:
            for s in mine.slots:
                self._local[s.rank] = self.tier.slot_path(s.rank, s.slot)
        self._decision, self._record = decision, record
        self._adopt_lost_parts(views, comm.rank)

    def _adopt_lost_parts(self, views: Sequence[NodeView], rank: int) -> None:
        """Hand a lost node's part of the pending persistent step to this node's drain (``gemini_dcp.adopt``)."""
        from .adopt import adopt_lost_parts  # noqa: PLC0415

        try:
            adopt_lost_parts(self.tier, views, rank)
        except Exception as exc:  # noqa: BLE001 - the restore stands; the next drained step completes the store
            log.warning("could not hand the lost nodes' part of the pending drain to this node: %s", exc)

    def _describe(self, comm: Comm, problems: Sequence[Unrestorable]) -> dict[tuple[int, str], Any]:
        """Collective (every rank reached the same ``problems``): the rank → node map and byte
        counts of each unrestorable record, from a rank whose node holds it, to name the lost nodes."""
        details: dict[tuple[int, str], Any] = {}
        for p in problems:
            mine = None
            if comm.rank == p.src:
                rec = self.tier.record(p.step)
                if rec is not None and rec.fingerprint() == p.fingerprint:
                    mine = (rec.rank_nodes, rec.rank_nbytes)
            details[(p.step, p.fingerprint)] = comm.broadcast_object(mine, src=p.src)
        return details

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        raise_if_failed(metadata)  # read_metadata's error, on torch releases whose dcp.load dropped it
        fault_point("load.after_decide")
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: pick a peer source for every chunk a rank's node does not hold."""
        if self._decision is None or self._record is None or not self._decision.node_ranks:
            return plans
        from .peer import assign_sources  # noqa: PLC0415

        needs = [sorted({self._key(it) for it in p.items}) for p in plans]
        routes = assign_sources(needs, self._decision, self._record, set())
        return [dataclasses.replace(p, storage_data=routes[r]) for r, p in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Collective: restore this rank's chunks from local memory, peers, then persistent."""
        comm = self._comm()
        counts = dict.fromkeys(TIERS, 0)
        error: BaseException | None = None
        from .peer import Tally  # noqa: PLC0415

        tallies: list[Tally] | None = None
        try:
            tallies = self._read_all(plan, planner, comm, counts)  # already exchanged when nothing failed
        except GeminiError as exc:
            error = exc
        if tallies is None:
            tallies = comm.all_gather_object(Tally([], [], counts, error is None))
        if error is not None or not all(t.ok for t in tallies):
            # Release the slot mappings now: the error (kept by DCP and the caller) must not
            # keep zero-copy views of tier memory alive through its traceback's frames — a
            # process that kept them until interpreter exit could abort while tearing down.
            self._maps.clear()
            if error is not None:
                traceback.clear_frames(error.__traceback__)
                raise error
            raise ShardUnavailableError("another rank failed to restore its shards; see its error.")
        self.rank_restored_from = counts
        self.restored_from = {tier: sum(t.counts[tier] for t in tallies) for tier in TIERS}
        assert self._decision is not None
        self.restored_step = self._decision.step
        self.restore_seconds = time.perf_counter() - self._t0
        self._release_maps()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str] | int) -> bool:
        from .writer import GeminiStorageWriter  # noqa: PLC0415

        return GeminiStorageWriter.validate_checkpoint_id(checkpoint_id)

    # ---- internals -----------------------------------------------------------------------
    def _release_maps(self) -> None:
        """Unmap the slot files off the restore's critical path.

        Nothing references the mappings once every chunk is copied into the live
        tensors, but tearing down the page tables of a populated mapping costs
        ~15 ms per GiB (a serving rank maps its own slots and the replicas it
        serves): a daemon thread drops them while training resumes.
        """
        maps, self._maps = self._maps, {}
        if maps:
            threading.Thread(target=maps.clear, name="gemini-dcp-unmap", daemon=True).start()

    def _comm(self) -> Comm:
        return get_comm(self.timeout_s, self.process_group)

    def _node_view(self, rank: int) -> NodeView:
        steps: list[StepView] = []
        for step, rec in self.tier.records().items():
            steps.append(
                StepView(
                    step=step,
                    fingerprint=rec.fingerprint(),
                    world_size=rec.world_size,
                    held_ranks=rec.held_ranks(),
                    created_unix=rec.created_unix,
                    complete=rec.complete,
                )
            )
        return NodeView(rank, self.node_id, tuple(steps), tuple(self.tier.other_jobs()), str(self.root))

    def _ref(self, index: MetadataIndex) -> ShardRef:
        assert self._record is not None
        return self._record.metadata.storage_data[index]

    def _key(self, item: ReadItem) -> ItemKey:
        ref = self._ref(item.storage_index)
        return (ref.rank, ref.offset)

    def _local_bytes(self, ref: ShardRef) -> torch.Tensor | None:
        path = self._local.get(ref.rank)
        if path is None:
            return None
        m = self._maps.get(path)
        if m is None:
            try:
                m = ReadOnlySlot(path)
            except FileNotFoundError:
                return None
            self._maps[path] = m
        if ref.offset + ref.length > m.size:
            return None
        return m.view(ref.offset, ref.length)

    def _read_all(
        self, plan: LoadPlan, planner: LoadPlanner, comm: Comm, counts: dict[str, int]
    ) -> list[Tally] | None:
        """Restore this rank's chunks into ``counts``; every rank's :class:`~gemini_dcp.peer.Tally`
        when the counts were already exchanged (nothing to repair anywhere), else None."""
        if self._record is None:  # persistent only
            assert self.persistent is not None and self._decision is not None
            counts["persistent"] += self.persistent.read_items(self._decision.step, plan, planner)
            return None
        by_key: dict[ItemKey, list[ReadItem]] = {}
        for item in plan.items:
            by_key.setdefault(self._key(item), []).append(item)
        routes = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        remote: set[ItemKey] = set(routes.get("recv", {}))
        failed: dict[ItemKey, str] = {}
        from .peer import fetch_remote, refs_by_key, start_transfer  # noqa: PLC0415

        # Post the peer sends and receives first: gloo moves them while this rank
        # restores its own chunks below (a serving rank feeds its requesters at once).
        refs = refs_by_key(self._record)
        first = start_transfer(self, comm, routes, by_key, planner, refs)
        for key, items in by_key.items():
            if key in remote:
                continue
            ref = self._ref(items[0].storage_index)
            buf = self._local_bytes(ref)
            if buf is None:
                failed[key] = "missing"
                continue
            if self._apply(items, ref, buf, planner):
                counts["local"] += ref.length
                fault_point("load.mid_copy")  # at least one chunk landed in the live tensors
            else:
                failed[key] = "checksum"
                log.warning("local copy of %s is corrupt; fetching another copy", _describe(items[0], ref, self._record.step))
        return fetch_remote(self, comm, planner, by_key, routes, failed, counts, refs, first)

    def _apply(self, items: list[ReadItem], ref: ShardRef, buf: torch.Tensor, planner: LoadPlanner) -> bool:
        """Verify ``buf`` against ``ref`` and copy it into every destination; False on checksum mismatch."""
        direct = direct_destination(items, ref, planner)
        if direct is not None:
            item, dest, dst_bytes = direct
            if checksum_then_copy(dst_bytes, buf, ref.algo) != ref.checksum:
                return False
            planner.commit_tensor(item, dest)
            return True
        if checksum(buf, ref.algo) != ref.checksum:
            return False
        for item in items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(buf.numpy().tobytes()))
                continue
            stored = buf.view(getattr(torch, ref.dtype or "uint8")).view(ref.shape or (-1,))
            src = stored
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, off, length)
            dest = planner.resolve_tensor(item).detach()
            dest.copy_(src)
            planner.commit_tensor(item, dest)
        return True


def direct_destination(
    items: list[ReadItem], ref: ShardRef, planner: LoadPlanner
) -> tuple[ReadItem, torch.Tensor, torch.Tensor] | None:
    """``(item, dest, dest bytes)`` when one read item covers the stored chunk whole and its
    destination is contiguous memory of the chunk's size: the bytes can go straight there."""
    item = _whole_item(items, ref)
    if item is None:
        return None
    dest = planner.resolve_tensor(item)
    dst_bytes = as_bytes(dest.detach())
    if dst_bytes is None or dst_bytes.numel() != ref.length:
        return None
    return item, dest, dst_bytes


def _whole_item(items: list[ReadItem], ref: ShardRef) -> ReadItem | None:
    """The single tensor ReadItem covering all of the stored chunk, if that is the case."""
    if len(items) != 1 or ref.shape is None:
        return None
    item = items[0]
    if item.type != LoadItemType.TENSOR:
        return None
    if any(o != 0 for o in item.storage_offsets) or tuple(item.lengths) != tuple(ref.shape):
        return None
    return item


def _describe(item: ReadItem, ref: ShardRef, step: int) -> str:
    idx = item.storage_index
    return f"shard {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}, saved by rank {ref.rank}"


def corrupt_error(item: ReadItem, ref: ShardRef, step: int, sources: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"{_describe(item, ref, step)} failed its {ref.algo} checksum in every copy tried ({sources}); "
        "the checkpoint bytes were corrupted in memory. Load an older step (checkpoint_id=...) or the persistent tier."
    )
