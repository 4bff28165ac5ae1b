"""GeminiStorageReader: DCP StorageReader that restores from the fastest surviving copy.

Call order (driven by ``dcp.load``; **all ranks must call dcp.load together**):

1. ``reset(checkpoint_id)`` — optional: a step to load (default: the newest restorable).
2. ``read_metadata`` — collective: every rank reports what its node holds, all
   ranks run the same decision (:func:`restore_plan.decide`) and agree on one
   step; the step record is broadcast from a node that has it.
3. ``prepare_global_plan`` (coordinator) — assigns, for each chunk a rank needs
   and its node does not hold, a peer rank that holds it, spreading bytes over
   the holders.
4. ``read_data`` — collective, in two phases. *Stage*: every chunk this rank needs is
   verified against its checksum before any byte of it may reach the state dict —
   local chunks in the mmap'd slot files (zero copy), peer chunks in receive buffers
   (they arrive over the checkpoint control group while the local chunks are
   verified), persistent chunks as read from the store; a chunk whose checksum fails
   is fetched again from another copy (peer, then persistent). *Apply*: only when
   every rank holds a verified copy of every chunk it needs (one all-gather, which
   also sums the per-tier byte counts into ``restored_from``) are the chunks copied
   into the live tensors, converted to the requested dtype as stock DCP converts
   them. A load that fails leaves the caller's tensors exactly as they were.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import sys
import threading
import time
import traceback
from torch.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, LoadItemType, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ..core.checksum import checksum
from ..core.chunk_sink import describe_item
from ..core.compat import failed_metadata, global_shape, raise_if_failed
from ..transport.comm import Comm, get_comm
from ..core.config import parse_step, resolve_node_id
from ..options import GeminiOptions, resolve_options
from ..errors import (
    CheckpointMismatchError,
    ChecksumMismatchError,
    GeminiError,
    IncompatibleCheckpointError,
    ShardUnavailableError,
)
from ..core.faults import fault_point
from ..core.launch import current_launch
from ..local.tier import LocalTier
from ..local.records import ShardRef, StepRecord
from ..core.restore_order import NodeView, RestoreDecision, StepView, Unrestorable, decide, unrestorable_error
from ..local.slots import ReadOnlySlot

if TYPE_CHECKING:
    from ..peer.replication import ReceiveArena, Tally

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "persistent")
ItemKey = tuple[int, int]  # (saving rank, offset in its slot): one stored item
MISMATCH_KEYS_SHOWN = 5  # offending keys named in a CheckpointMismatchError


class Staged(NamedTuple):
    """One stored chunk whose bytes were verified and wait, outside the state dict, to be applied.

    ``stored`` is the chunk as saved (its own dtype and shape): a view of verified bytes
    (an mmap'd slot, a receive buffer) or the tensor read from the persistent tier; for a
    bytes item, the raw bytes (a uint8 tensor or ``bytes``).
    """

    items: list[ReadItem]
    stored: "torch.Tensor | bytes"


class GeminiStorageReader(StorageReader):
    """Load DCP checkpoints from node memory, peer memory, then persistent storage.

    After ``dcp.load``: ``restored_step`` is the step loaded, ``restored_from``
    maps tier name → bytes read from it summed over all ranks (``rank_restored_from``:
    this rank only), ``restore_seconds`` the wall time of the restore, and
    ``restored_launch`` the description of the launch that saved the step ("" when the
    record does not say, e.g. a step read from the persistent tier alone). Known after
    ``read_metadata``: a restore across launches (a torchrun restart, or another job
    that used this job id) is logged there with both launches.

    A load is all-or-nothing: the state dict is written only after every rank has a
    verified copy of every chunk it needs, so a load that raises (corrupt bytes with
    no good copy left, lost shards, a state dict that does not match the checkpoint:
    :class:`~gemini_dcp.errors.CheckpointMismatchError`) leaves the caller's tensors
    exactly as they were. Chunks are converted to the state dict's dtypes as stock DCP
    converts them (``dest.copy_(stored)``); bytes are never reinterpreted.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        job_id: str | None = None,
        *,
        persistent: str | None = None,
        timeout_s: float = 300.0,
        process_group: Any = None,
        options: GeminiOptions | None = None,
    ) -> None:
        """``root`` / ``job_id`` as the writer's; ``persistent``: the fsspec URL of the persistent
        tier to fall back to; ``timeout_s``: of the restore collectives and every store call;
        ``options``: a :class:`gemini_dcp.options.GeminiOptions` instead of, or with, the keywords
        (a keyword left at its default takes the options' value; both set differently is a ConfigError)."""
        super().__init__()
        # Validated before any directory is touched: ``options`` merged with the keywords
        # (a keyword and an options field set to different values is a ConfigError).
        self.gemini_options: GeminiOptions = resolve_options(
            options, root=root, job_id=job_id, persistent=persistent, timeout_s=timeout_s
        )
        cfg = self.gemini_options
        self.tier = LocalTier(cfg.local.root, cfg.local.job_id)
        self.root: Path = self.tier.root
        self.job_id: str = self.tier.job_id
        self.node_id = cfg.local.node_id or resolve_node_id(self.root)
        self.timeout_s = cfg.timeout_s
        self.process_group = process_group
        self.persistent = None
        if cfg.persistent.url is not None:
            from ..persistent.store import PersistentTier  # noqa: PLC0415

            self.persistent = PersistentTier(  # every store call bounded
                str(cfg.persistent.url), self.job_id, timeout_s=cfg.persistent_timeout_s,
                storage_options=dict(cfg.persistent.storage_options) if cfg.persistent.storage_options is not None else None,
            )
        self._requested: int | None = None
        self._metadata_error: Exception | None = None
        self._decision: RestoreDecision | None = None
        self._record: StepRecord | None = None
        self._local: dict[int, Path] = {}
        self._maps: dict[Path, ReadOnlySlot] = {}
        self._arenas: list[ReceiveArena] = []  # this restore's peer receive buffers (gemini_dcp.peer.replication)
        self._staged: list[Staged] = []
        self._dests: dict[int, torch.Tensor] = {}  # id(read item) -> its resolved destination
        self._checked_planner: LoadPlanner | None = None
        self._rank_ok = True  # False: this rank will raise; it tells the others in the first agreement round
        self._stage_error: GeminiError | None = None
        self._t0 = 0.0
        self.restored_step: int | None = None
        self.restored_launch: str = ""
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
        self.restored_launch = ""
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
            decision = decide(  # same result on every rank
                views, self._requested, self.job_id, persisted if self.persistent is not None else None
            )
        except ShardUnavailableError as exc:
            problems = getattr(exc, "problems", ())
            if not problems:
                raise
            raise unrestorable_error(self.job_id, problems, bool(persisted), self._describe(comm, problems)) from None
        self._local = {}
        self.tier.record_restore(decision.step)  # steps newer here are abandoned: this launch's next save drops them
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
        self._note_launch(record, comm.rank)
        self._adopt_lost_parts(views, comm.rank)

    def _note_launch(self, record: StepRecord, rank: int) -> None:
        """Set ``restored_launch``; log (rank 0) when the step was saved by another launch.

        A torchrun restart restores what the previous launch of the run saved: that is
        logged at INFO. A launch of another run (another ``--rdzv-id``, or none: two jobs
        that share the default job id) is logged at WARNING, since it may be another
        job's checkpoint; the restore goes on either way (the key/shape check in
        ``set_up_storage_reader`` / ``read_data`` refuses another model's state).
        """
        saved_id = getattr(record, "launch_id", "") or ""
        saved_desc = getattr(record, "launch_description", "") or ""
        self.restored_launch = saved_desc
        if not saved_id or rank != 0:
            return
        me = current_launch()
        if saved_id == me.launch_id:
            return
        level = logging.INFO if _same_run(saved_desc, me.description) else logging.WARNING
        log.log(
            level,
            "job %r: restoring step %d saved by launch %s (%s); this process is launch %s (%s)%s",
            self.job_id, record.step, saved_desc or "?", saved_id, me.description, me.launch_id,
            "" if level == logging.INFO else
            ". If that is another job's checkpoint, give each job its own job_id (torchrun --rdzv-id) or root.",
        )

    def _adopt_lost_parts(self, views: Sequence[NodeView], rank: int) -> None:
        """Hand a lost node's part of the pending persistent step to this node's drain (``gemini_dcp.persistent.adopt``)."""
        from ..persistent.adopt import adopt_lost_parts  # noqa: PLC0415

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
        self._checked_planner = None
        planner = _planner_set_up_with(metadata, sys._getframe(1))
        if planner is not None:
            # Before DCP's planner plans (and raises its own RuntimeError / ValueError for a
            # missing key or a size mismatch): an error here reaches every rank through DCP's
            # collective step, before any byte moves.
            mismatch = self._mismatch(planner)
            if mismatch is not None:
                raise mismatch
            self._checked_planner = planner

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: pick a peer source for every chunk a rank's node does not hold."""
        if self._decision is None or self._record is None or not self._decision.node_ranks:
            return plans
        from ..peer.replication import assign_sources  # noqa: PLC0415

        needs = [sorted({self._key(it) for it in p.items}) for p in plans]
        routes = assign_sources(needs, self._decision, self._record, set())
        return [dataclasses.replace(p, storage_data=routes[r]) for r, p in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Collective (every rank calls it, as ``dcp.load`` does): restore this rank's chunks.

        Stage every chunk (verified, outside the state dict) from local memory, peers,
        then persistent; agree with every rank that all staged; only then copy them into
        the live tensors. On any failure on any rank, every rank raises and no state
        dict was touched.
        """
        comm = self._comm()
        counts = dict.fromkeys(TIERS, 0)
        error: BaseException | None = None
        from ..peer.replication import Tally  # noqa: PLC0415

        self._staged, self._dests, self._stage_error = [], {}, None
        # The key/shape check runs here too when set_up_storage_reader could not see the
        # planner. No error may leave this rank before the agreement below: the other ranks
        # are in the transfers and collectives with it. The first agreement round tells them.
        try:
            error = self._resolve_destinations(plan, planner)
        except Exception as exc:  # noqa: BLE001 - a planner that cannot resolve its own items
            error = exc
        self._rank_ok = error is None
        tallies: list[Tally] | None = None
        try:
            tallies = self._read_all(plan, planner, comm, counts)  # already exchanged when nothing failed
        except GeminiError as exc:
            error = error or exc
        error = error or self._stage_error
        if tallies is None:
            tallies = comm.all_gather_object(Tally([], [], counts, error is None))
        if error is not None or not all(t.ok for t in tallies):
            # Release the slot mappings and staged buffers now: the error (kept by DCP and the
            # caller) must not keep zero-copy views of tier memory alive through its traceback's
            # frames — a process that kept them until interpreter exit could abort while tearing down.
            self._staged, self._dests = [], {}
            self._maps.clear()
            self._drop_arenas()
            if error is not None:
                traceback.clear_frames(error.__traceback__)
                raise error
            raise ShardUnavailableError(
                "another rank failed to restore its shards (see its error); nothing was copied into the state dict."
            )
        # Every rank holds a verified copy of every chunk it needs: only now may bytes land in the state dict.
        staged, self._staged = self._staged, []
        try:
            for n, entry in enumerate(staged):
                self._apply(entry, planner)
                if n == 0:
                    fault_point("load.mid_copy")  # at least one chunk landed in the live tensors
        finally:
            staged.clear()
            self._dests = {}
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
        serves): a worker thread drops them while training resumes. The thread is
        *not* a daemon: the interpreter joins it before it finalizes, so a process
        that exits right after ``dcp.load`` never tears the runtime down under a
        thread still inside the unmap (a daemon thread there aborted the process
        with SIGABRT in about half of such exits). Once the interpreter is
        finalizing (no new threads), the unmap runs inline.
        """
        maps, self._maps = self._maps, {}
        arenas, self._arenas = self._arenas, []
        if not maps and not arenas:
            return

        def unmap() -> None:
            maps.clear()
            for arena in arenas:
                arena.release()  # the staged views are gone: the receive buffers' mapping goes with it
            arenas.clear()

        if sys.is_finalizing():
            unmap()
            return
        try:
            threading.Thread(target=unmap, name="gemini-dcp-unmap", daemon=False).start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            unmap()

    def _drop_arenas(self) -> None:
        """Release the peer receive buffers now (a failed restore), after their pre-fault workers end."""
        arenas, self._arenas = self._arenas, []
        for arena in arenas:
            arena.release()

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
        """Stage (verify, never apply) this rank's chunks, counting bytes per tier into ``counts``;
        every rank's :class:`~gemini_dcp.peer.replication.Tally` when the counts were already exchanged
        (nothing to repair anywhere), else None."""
        if self._record is None:  # persistent only
            assert self.persistent is not None and self._decision is not None
            counts["persistent"] += self._stage_from_persistent(plan, planner)
            return None
        by_key: dict[ItemKey, list[ReadItem]] = {}
        for item in plan.items:
            by_key.setdefault(self._key(item), []).append(item)
        routes = plan.storage_data if isinstance(plan.storage_data, dict) else {}
        remote: set[ItemKey] = set(routes.get("recv", {}))
        failed: dict[ItemKey, str] = {}
        from ..peer.replication import fetch_remote, refs_by_key, start_transfer  # noqa: PLC0415

        # Post the peer sends and receives first: gloo moves them while this rank
        # verifies its own chunks below (a serving rank feeds its requesters at once).
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
            if self._stage(items, ref, buf):
                counts["local"] += ref.length
            else:
                failed[key] = "checksum"
                log.warning("local copy of %s is corrupt; fetching another copy", describe_item(items[0], ref, self._record.step))
        return fetch_remote(self, comm, planner, by_key, routes, failed, counts, refs, first)

    def _stage(self, items: list[ReadItem], ref: ShardRef, buf: torch.Tensor) -> bool:
        """Verify ``buf`` (the stored bytes of one chunk) against ``ref``; if it matches, stage it
        for :meth:`_apply`, with nothing copied yet. False on a checksum mismatch.

        Used for local slot views and peer receive buffers (``gemini_dcp.peer.replication``).
        """
        if checksum(buf, ref.algo) != ref.checksum:
            return False
        if items[0].type == LoadItemType.BYTE_IO:
            self._staged.append(Staged(items, buf))
            return True
        try:
            stored = self._stored_view(buf, ref, items[0])
        except GeminiError as exc:  # raised after the agreement round (this rank is still in the protocol)
            self._stage_error = self._stage_error or exc
            self._rank_ok = False
            return True  # no other copy can fix what the record says
        self._staged.append(Staged(items, stored))
        return True

    def _stage_from_persistent(self, plan: LoadPlan, planner: LoadPlanner) -> int:
        """Read and verify ``plan``'s items from the persistent tier into the stage; bytes read.

        Raises (PersistentTierError, ChecksumMismatchError) with nothing staged from the failing item.
        """
        assert self.persistent is not None and self._decision is not None
        got: list[tuple[list[ReadItem], Any]] = []
        nbytes = self.persistent.read_items(self._decision.step, plan, planner, stage=got)
        self._staged.extend(Staged(items, stored) for items, stored in got)
        return nbytes

    def _stored_view(self, buf: torch.Tensor, ref: ShardRef, item: ReadItem) -> torch.Tensor:
        """The chunk's bytes viewed as what was saved: its dtype and shape (``ref``), no copy."""
        dtype, shape = ref.dtype, ref.shape
        md = None
        if dtype is None or shape is None:  # records predating the fields: the DCP metadata has them
            md = self._metadata_of(item.storage_index)
        tdtype = getattr(torch, dtype, None) if dtype is not None else getattr(getattr(md, "properties", None), "dtype", None)
        if shape is None:
            shape = _chunk_size(md, item.storage_index)
        if not isinstance(tdtype, torch.dtype) or shape is None:
            raise IncompatibleCheckpointError(
                f"{describe_item(item, ref, self._decision.step if self._decision else -1)}: the record does not say "
                f"what dtype/shape the chunk was saved with (dtype {dtype!r}, shape {shape!r}); it cannot be "
                "restored by this gemini_dcp. Load it with the release that saved it, or load another step."
            )
        elem = tdtype.itemsize
        numel = 1
        for d in shape:
            numel *= d
        if numel * elem != buf.numel():
            raise IncompatibleCheckpointError(
                f"{describe_item(item, ref, self._decision.step if self._decision else -1)}: {buf.numel()} stored bytes "
                f"do not hold a {tdtype} chunk of shape {tuple(shape)}; the record is inconsistent. Load another step."
            )
        if numel == 0:
            return torch.empty(tuple(shape), dtype=tdtype)
        try:
            return buf.view(tdtype).view(tuple(shape))
        except RuntimeError:  # bytes not aligned for the dtype (never in a slot or a receive buffer): copy once
            return buf.clone().view(tdtype).view(tuple(shape))

    def _metadata_of(self, index: MetadataIndex) -> Any:
        md = self._record.metadata if self._record is not None else getattr(self, "_metadata", None)
        return None if md is None else md.state_dict_metadata.get(index.fqn)

    def _apply(self, entry: Staged, planner: LoadPlanner) -> None:
        """Copy one verified chunk into its destinations, converting the dtype as stock DCP does."""
        items, stored = entry
        for item in items:
            if item.type == LoadItemType.BYTE_IO:
                raw = stored if isinstance(stored, (bytes, bytearray)) else stored.numpy().tobytes()
                planner.load_bytes(item, io.BytesIO(raw))
                continue
            assert isinstance(stored, torch.Tensor)
            src = stored
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, off, length)
            dest = self._dests.pop(id(item), None)
            if dest is None:
                dest = planner.resolve_tensor(item).detach()
            dest.copy_(src)  # same dtype: a memcpy; another dtype: converted values, as stock DCP
            planner.commit_tensor(item, dest)

    # ---- the key/shape check -------------------------------------------------------------
    def _resolve_destinations(self, plan: LoadPlan, planner: LoadPlanner) -> CheckpointMismatchError | None:
        """Resolve every tensor item's destination once (kept for :meth:`_apply`) and check that the
        state dict matches the checkpoint; the error (not raised: see ``read_data``) or None."""
        if self._checked_planner is not planner:
            mismatch = self._mismatch(planner)
            if mismatch is not None:
                return mismatch
        bad: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.size()) != tuple(item.lengths):
                bad.append((item.dest_index.fqn, tuple(item.lengths), tuple(dest.size())))
                continue
            self._dests[id(item)] = dest
        if bad:
            self._dests = {}
            return self._mismatch_error([], bad, "chunk(s)")
        return None

    def _mismatch(self, planner: LoadPlanner) -> CheckpointMismatchError | None:
        """Keys of the planner's state dict missing from the checkpoint (unless the planner allows a
        partial load) and tensors whose saved size differs from the requested one."""
        sd = getattr(planner, "state_dict", None)
        md = getattr(self, "_metadata", None)
        if not isinstance(sd, Mapping) or md is None:
            return None
        saved = md.state_dict_metadata
        strict = not getattr(planner, "allow_partial_load", False)
        missing: list[str] = []
        shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for fqn, obj in sd.items():
            smd = saved.get(fqn)
            if smd is None:
                if strict:
                    missing.append(str(fqn))
                continue
            size = getattr(obj, "size", None)
            if isinstance(smd, TensorStorageMetadata) and isinstance(obj, torch.Tensor) and callable(size):
                want = global_shape(obj)  # a CheckpointableTensor (torch >= 2.15) is a slice of a larger tensor
                if tuple(smd.size) != want:
                    shapes.append((str(fqn), tuple(smd.size), want))
        if not missing and not shapes:
            return None
        return self._mismatch_error(missing, shapes, "tensor(s)")

    def _mismatch_error(
        self, missing: list[str], shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]], what: str
    ) -> CheckpointMismatchError:
        step = self._decision.step if self._decision is not None else self._requested
        launch = self._saved_by()
        parts = []
        if missing:
            shown = ", ".join(repr(k) for k in missing[:MISMATCH_KEYS_SHOWN])
            more = f" and {len(missing) - MISMATCH_KEYS_SHOWN} more" if len(missing) > MISMATCH_KEYS_SHOWN else ""
            parts.append(f"{len(missing)} key(s) of the state dict are not in the checkpoint: {shown}{more}")
        if shapes:
            shown = ", ".join(f"{k!r} saved {s} requested {r}" for k, s, r in shapes[:MISMATCH_KEYS_SHOWN])
            more = f" and {len(shapes) - MISMATCH_KEYS_SHOWN} more" if len(shapes) > MISMATCH_KEYS_SHOWN else ""
            parts.append(f"{len(shapes)} {what} with another shape: {shown}{more}")
        err = CheckpointMismatchError(
            f"step {step} of job {self.job_id!r} (saved by {launch}) does not match the state dict being "
            f"loaded: {'; '.join(parts)}. Nothing was copied into the state dict. The tier holds another "
            "model's checkpoint under this job id, or the model changed since that save: load it with the "
            "model that saved it, give this model its own job_id (or root), or, for keys that are new, "
            "load the rest with dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=True))."
        )
        err.step = step  # type: ignore[attr-defined]
        err.missing_keys = tuple(missing)  # type: ignore[attr-defined]
        err.shape_mismatches = tuple(shapes)  # type: ignore[attr-defined]
        return err

    def _saved_by(self) -> str:
        rec = self._record
        desc = getattr(rec, "launch_description", "") if rec is not None else ""
        lid = getattr(rec, "launch_id", "") if rec is not None else ""
        if desc or lid:
            return f"launch {desc or '?'} ({lid or '?'})"
        if rec is None:
            return "a launch the persistent tier does not record"
        return "a launch its record does not name"


def _planner_set_up_with(metadata: Metadata, frame: Any) -> LoadPlanner | None:
    """The LoadPlanner that DCP set up with ``metadata`` just before calling ``set_up_storage_reader``.

    DCP hands a storage reader no state dict before its planner plans, and the planner
    raises its own bare RuntimeError / ValueError there for a missing key or a size
    mismatch. ``dcp.load`` calls ``planner.set_up_planner(state_dict, metadata)`` and then
    ``storage_reader.set_up_storage_reader(metadata)`` from one function: the planner is a
    local of the calling frame. Only a planner whose ``metadata`` *is* this object (set up
    for this very load) is used; anything else (another caller, a torch that calls it
    otherwise) gives None, and the check runs in ``read_data`` instead.
    """
    try:
        values = list(frame.f_locals.values()) if frame is not None else []
    except Exception:  # noqa: BLE001 - an optimisation of where the error comes from, never required
        return None
    for v in values:
        if isinstance(v, LoadPlanner) and getattr(v, "metadata", None) is metadata:
            return v
    return None


def _same_run(a: str, b: str) -> bool:
    """Two launch descriptions of one torchrun run (same explicit run id): a restart, not another job."""
    def run_id(desc: str) -> str:
        parts = desc.split()
        return parts[1] if len(parts) > 1 and parts[0] == "run" else ""

    rid = run_id(a)
    return bool(rid) and rid not in ("-", "none") and rid == run_id(b)


def _chunk_size(md: Any, index: MetadataIndex) -> tuple[int, ...] | None:
    """The size of the saved chunk at ``index.offset`` (from the DCP metadata), if known."""
    for chunk in getattr(md, "chunks", ()) or ():
        if tuple(chunk.offsets) == tuple(index.offset or ()):
            return tuple(chunk.sizes)
    return None
