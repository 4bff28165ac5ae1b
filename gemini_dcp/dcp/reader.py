"""GeminiStorageReader: DCP StorageReader that restores from the fastest surviving copy.

Call order (driven by ``dcp.load``; **all ranks must call dcp.load together**):

1. ``reset(checkpoint_id)`` — optional: a step to load (default: the newest restorable).
2. ``read_metadata`` — collective: every rank reports what its node holds, all
   ranks run the same decision (:func:`gemini_dcp.core.restore_order.decide`) and agree on one
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

This module is the adapter: the DCP calls, the collective decision and the order of a
restore. The mechanics live beside it: :mod:`gemini_dcp.restore.restore_stage` holds a load's
verified chunks and the tier memory they are viewed through, :mod:`gemini_dcp.core.chunk_sink`
verifies and lands each chunk, :mod:`gemini_dcp.restore.state_dict_check` is the key/shape check,
and :mod:`gemini_dcp.peer` moves chunks between nodes.

The order of a restore (decide, stage local / peer / parity / persistent, agree, land) is one
sequence of collectives that every rank must run in the same order (all ranks call every
method); each stage's mechanics live in :mod:`gemini_dcp.restore` and the tiers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..core.chunk_sink import describe_item
from ..core.compat import failed_metadata, raise_if_failed
from ..core.config import DEFAULT_JOB_IDS, parse_step
from ..core.faults import fault_point
from ..core.restore_order import (
    NodeView,
    RestoreDecision,
    StepView,
    Unrestorable,
    decide,
    unrestorable_error,
)
from ..core.timelines import after_restore, job_lineage
from ..errors import CheckpointMismatchError, GeminiError, ShardUnavailableError, mark_from_another_rank
from ..ext import loader as ext_loader
from ..health.baseline import Baseline
from ..health.restore import hand_off, persisted_health, warn_health
from ..health.rule import is_healthy
from ..local.record_types import ShardRef, StepRecord
from ..node import open_tiers
from ..options import GeminiOptions, resolve_options
from ..peer.arena import ReceiveArena
from ..peer.fetch import Tally, assign_sources, fetch_remote, refs_by_key, start_transfer
from ..restore.parity_restore import drop_rebuilt, held_lanes, rebuild_from_parity, rebuilt_tier, tier_bytes
from ..restore.restore_stage import RestoreStage
from ..restore.state_dict_check import Mismatch, find_mismatch, planner_set_up_with, resolve_destinations, saved_by
from ..transport.comm import Comm, get_comm
from ..transport.launch import current_launch
from ..transport.nixl import prestart as nixl_prestart
from ..transport.p2p import transport_for

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "persistent", "parity")  # parity: bytes of slots rebuilt from XOR parity
ItemKey = tuple[int, int]  # (saving rank, offset in its slot): one stored item


class _OurErrorNotDcpFallback(logging.Filter):
    """Drops ``dcp.load``'s "Global metadata is not found. Falling back to rank local metadata."
    warning (logged with a full traceback on every rank, on the root logger) when the error it
    carries is one of ours: the restore decision is collective, there is no rank-local fallback,
    and the same error reaches the caller through DCP's own exception a moment later."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, GeminiError) and str(record.msg).startswith("Global metadata is not found"))


_DCP_FALLBACK_FILTER = _OurErrorNotDcpFallback()


class GeminiStorageReader(StorageReader):
    """Load DCP checkpoints from node memory, peer memory, then persistent storage.

    After ``dcp.load``: ``restored_step`` is the step loaded, ``restored_from``
    maps tier name → bytes read from it summed over all ranks (``"parity"``: of slots rebuilt
    from XOR parity, docs/parity.md; ``rank_restored_from``: this rank only), ``restore_seconds`` the wall time of the restore, and
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
        peer_transport: str | None = None,
        failure_domain: str | None = None,
    ) -> None:
        """``root`` / ``job_id`` as the writer's; ``persistent``: the fsspec URL of the persistent
        tier to fall back to; ``timeout_s``: of the restore collectives and every store call;
        ``peer_transport``: what moves chunks fetched from peers and parity rebuilds (as the writer's);
        ``failure_domain``: this node's failure domain (as the writer's; named in restore errors);
        ``options``: a :class:`gemini_dcp.options.GeminiOptions` instead of, or with, the keywords
        (a keyword left at its default takes the options' value; both set differently is a ConfigError)."""
        super().__init__()
        ext_loader.preload()  # the extension mapped now, not inside a timed save or restore
        root_logger = logging.getLogger()  # torch's state_dict_loader logs there
        if _DCP_FALLBACK_FILTER not in root_logger.filters:
            root_logger.addFilter(_DCP_FALLBACK_FILTER)
        # Validated before any directory is touched: ``options`` merged with the keywords
        # (a keyword and an options field set to different values is a ConfigError).
        self.options: GeminiOptions = resolve_options(
            options, root=root, job_id=job_id, persistent=persistent, timeout_s=timeout_s,
            peer_transport=peer_transport, failure_domain=failure_domain,
        )
        cfg = self.options
        if cfg.peer_transport != "gloo":  # NIXL's agent started now, not inside the first transfer
            nixl_prestart()
        tiers = open_tiers(cfg, writable=False)
        self.tier = tiers.tier
        self.root: Path = self.tier.root
        self.job_id: str = self.tier.job_id
        self.node_id = tiers.node_id
        self.timeout_s = cfg.timeout_s
        self.process_group = process_group
        self.persistent = tiers.persistent
        self._requested: int | None = None
        self._metadata_error: Exception | None = None
        self._decision: RestoreDecision | None = None
        self._record: StepRecord | None = None
        self._local: dict[int, Path] = {}
        self._staging = RestoreStage()  # this load's slot mappings, receive buffers and verified chunks
        self._checked_planner: LoadPlanner | None = None
        self._t0 = 0.0
        self.restored_step: int | None = None
        self.restored_launch: str = ""
        self.restored_from: dict[str, int] = tier_bytes(dict.fromkeys(TIERS, 0))
        self.rank_restored_from: dict[str, int] = tier_bytes(dict.fromkeys(TIERS, 0))
        self.restore_seconds: float | None = None
        # Newer steps this restore passed over because they are unhealthy (gemini_dcp.health), newest first.
        self.skipped_unhealthy: list[int] = []

    # ---- StorageReader API -------------------------------------------------------------
    @property
    def checkpoint_id(self) -> int | None:
        return self._requested

    @property
    def decided_step(self) -> int | None:
        """The step the collective restore decision chose (known after ``read_metadata``, or after
        ``reset(step)``), else None: how ``gemini_dcp.integrations`` learns the newest restorable step
        before deciding where to load from."""
        return None if self._decision is None else self._decision.step

    @property
    def decision(self) -> RestoreDecision | None:
        """The collective restore decision (after ``read_metadata``): the step, the copy and how it
        is restored (fingerprint, parity rebuild); read-only, the same on every rank. None before."""
        return self._decision

    @property
    def record(self) -> StepRecord | None:
        """This node's step record of the decided step (after ``read_metadata``); None before, or
        when the step is restored from the persistent tier only. Read-only: do not modify it."""
        return self._record

    @property
    def local_slots(self) -> Mapping[int, Path]:
        """Saving rank -> path of its slot file on this node for the decided step (after
        ``read_metadata``): the chunks this node holds. A read-only view."""
        return MappingProxyType(self._local)

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
        unhealthy: list[int] = []
        healthy: dict[int, Baseline] = {}
        stored: tuple[dict[int, str], str] = ({}, "")  # the store's steps' timelines, and its newest lineage (JSON)
        if self.persistent is not None and comm.rank == 0:
            persisted = self.persistent.committed_steps()
            unhealthy, healthy = persisted_health(self.persistent, persisted)
            stored = _store_timelines(self.persistent, persisted)
        # One gather: every node's view, and rank 0's list of persisted steps (their health, their timelines)
        # riding along with its own.
        gathered = comm.all_gather_object((view, persisted, unhealthy, healthy, stored))
        views = [g[0] for g in gathered]
        persisted = list(gathered[0][1])
        unhealthy = list(gathered[0][2])
        healthy = dict(gathered[0][3])
        ptimelines, plineage = gathered[0][4]
        if local_error is not None:
            raise local_error
        if any(v is None for v in views):
            raise mark_from_another_rank(ShardUnavailableError("another rank could not read its tier root; see its error."))
        lineage = job_lineage(views, [plineage])  # the job's history: the newest any node or the store knows
        try:
            decision = decide(  # same result on every rank
                views, self._requested, self.job_id, persisted if self.persistent is not None else None,
                persistent_unhealthy=unhealthy, persistent_timelines=ptimelines, lineage=lineage,
            )
        except ShardUnavailableError as exc:
            problems = getattr(exc, "problems", ())
            if not problems:
                raise
            raise unrestorable_error(self.job_id, problems, bool(persisted), self._describe(comm, problems)) from None
        self._local = {}
        self.skipped_unhealthy = list(decision.skipped_unhealthy)
        warn_health(decision, views, unhealthy, self._requested, self.job_id, comm.rank)
        # The history after this restore (a rollback when live steps newer than it exist): the same on every
        # rank; it takes effect when this launch commits its next save, never through a restore alone.
        self.tier.record_restore(
            decision.step, after_restore(lineage, decision, views, persisted, ptimelines, current_launch().launch_id)
        )
        if decision.fingerprint is None:
            self._decision, self._record = decision, None
            hand_off(self.root, self.job_id, decision.step, None, healthy)  # the next save is judged against this step's counts
            return
        record = self.tier.record(decision.step) if comm.rank == decision.record_src else None
        record = comm.broadcast_object(record, src=decision.record_src)  # type: ignore[arg-type]
        assert record is not None
        hand_off(self.root, self.job_id, decision.step, record, healthy)
        mine = self.tier.record(decision.step)
        if mine is not None and mine.fingerprint() == decision.fingerprint:
            for s in mine.slots:
                self._local[s.rank] = self.tier.slot_path(s.rank, s.slot)
        self._decision, self._record = decision, record
        self._note_launch(record, comm)
        if decision.rebuilt:  # collective: every rank reached the same decision
            self._decision = rebuild_from_parity(
                comm, self.tier, decision, record, mine if mine is not None and mine.fingerprint() == decision.fingerprint else None,
                self._local, persisted if self.persistent is not None else None,
                peer_transport=self.options.peer_transport,
            )
        self._adopt_lost_parts(views, comm.rank)

    def _note_launch(self, record: StepRecord, comm: Comm) -> None:
        """Set ``restored_launch``; log (rank 0) when the step was saved by another launch.

        A restore of the same job (:func:`_other_job` finds nothing: a torchrun restart, with or
        without ``--rdzv-id``) is logged at INFO. One that could be another job's checkpoint is
        logged at WARNING, saying why; the restore goes on either way (the key/shape check in
        ``set_up_storage_reader`` / ``read_data`` refuses another model's state).
        """
        saved_id = getattr(record, "launch_id", "") or ""
        saved_desc = getattr(record, "launch_description", "") or ""
        self.restored_launch = saved_desc
        if not saved_id or comm.rank != 0:
            return
        me = current_launch()
        if saved_id == me.launch_id:
            return
        why = _other_job(record, self.job_id, comm.world_size, me.description)
        log.log(
            logging.WARNING if why else logging.INFO,
            "job %r: restoring step %d saved by launch %s (%s); this process is launch %s (%s)%s",
            self.job_id, record.step, saved_desc or "?", saved_id, me.description, me.launch_id,
            f". It may be another job's checkpoint ({why}): give each job its own job_id (torchrun --rdzv-id) "
            "or root." if why else "",
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
                    mine = (rec.rank_nodes, rec.rank_nbytes, rec.node_domains)
            details[(p.step, p.fingerprint)] = comm.broadcast_object(mine, src=p.src)
        return details

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        raise_if_failed(metadata)  # read_metadata's error, on torch releases whose dcp.load dropped it
        fault_point("load.after_decide")
        self._metadata = metadata
        self._checked_planner = None
        planner = planner_set_up_with(metadata, sys._getframe(1))
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

        self._staging.begin()
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
        error = error or self._staging.error
        if tallies is None:
            tallies = comm.all_gather_object(Tally([], [], counts, error is None))
        if self._decision is not None and self._decision.rebuilt:  # every rank staged: the rebuilt files can go
            drop_rebuilt(self.tier, self._decision, comm.rank, self._decision.step)
        if error is not None or not all(t.ok for t in tallies):
            self._staging.abandon()  # no zero-copy view of tier memory may live on in the error's frames
            if error is not None:
                traceback.clear_frames(error.__traceback__)
                raise error
            raise mark_from_another_rank(ShardUnavailableError(
                "another rank failed to restore its shards (see its error); nothing was copied into the state dict."
            ))
        # Every rank holds a verified copy of every chunk it needs: only now may bytes land in the state dict.
        self._staging.land(planner)
        self.rank_restored_from = tier_bytes(counts)
        self.restored_from = tier_bytes({tier: sum(t.counts[tier] for t in tallies) for tier in TIERS})
        assert self._decision is not None
        self.restored_step = self._decision.step
        self.restore_seconds = time.perf_counter() - self._t0
        self._staging.release()  # unmaps off the critical path
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str] | int) -> bool:
        from .writer import GeminiStorageWriter  # noqa: PLC0415

        return GeminiStorageWriter.validate_checkpoint_id(checkpoint_id)

    # ---- internals -----------------------------------------------------------------------
    def _comm(self) -> Comm:
        return get_comm(self.timeout_s, self.process_group)

    def _node_view(self, rank: int) -> NodeView:
        steps: list[StepView] = []
        superseded = self.tier.superseded_steps()  # an abandoned timeline, by this node's lineage
        for step, rec in self.tier.records().items():
            steps.append(
                StepView(
                    step=step,
                    fingerprint=rec.fingerprint(),
                    world_size=rec.world_size,
                    held_ranks=rec.held_ranks(),
                    created_unix=rec.created_unix,
                    complete=rec.complete,
                    parity_lanes=held_lanes(rec),
                    unhealthy=not is_healthy(rec),
                    superseded=step in superseded,
                    timeline=rec.timeline,
                )
            )
        lineage = self.tier.lineage()
        return NodeView(rank, self.node_id, tuple(steps), tuple(self.tier.other_jobs()), str(self.root),
                        lineage=json.dumps(lineage.to_json()) if lineage.gen else "")

    def _ref(self, index: MetadataIndex) -> ShardRef:
        assert self._record is not None
        return self._record.metadata.storage_data[index]

    def _key(self, item: ReadItem) -> ItemKey:
        ref = self._ref(item.storage_index)
        return (ref.rank, ref.offset)

    def _local_bytes(self, ref: ShardRef) -> torch.Tensor | None:
        """The stored bytes of ``ref`` in this node's slot of its rank (zero copy), or None if not held here."""
        return self._staging.local_bytes(self._local.get(ref.rank), ref)

    def _read_all(
        self, plan: LoadPlan, planner: LoadPlanner, comm: Comm, counts: dict[str, int]
    ) -> list[Tally] | None:
        """Stage (verify, never apply) this rank's chunks, counting bytes per tier into ``counts``;
        every rank's :class:`~gemini_dcp.peer.fetch.Tally` when the counts were already exchanged
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
        # Post the peer sends and receives first: gloo moves them while this rank
        # verifies its own chunks below (a serving rank feeds its requesters at once).
        assert self._decision is not None
        staging = _RestoreSide(self, planner)
        transport = transport_for(comm, self.options.peer_transport)
        for key in remote:  # a chunk of a slot rebuilt from parity counts as "parity", not "peer"
            if rebuilt_tier(self._decision, key[0], "peer") == "parity":
                counts["peer"] -= self._ref(by_key[key][0].storage_index).length
                counts["parity"] += self._ref(by_key[key][0].storage_index).length
        first = start_transfer(staging, transport, routes)
        local = [(key, items, self._ref(items[0].storage_index)) for key, items in by_key.items() if key not in remote]
        bufs = [self._local_bytes(ref) for _, _, ref in local]
        # Chunks bound for CUDA tensors: their slot mappings page-locked before they are verified (on the GPU).
        self._staging.prepare_device([(items, buf) for (_, items, _), buf in zip(local, bufs) if buf is not None])
        for (key, items, ref), buf in zip(local, bufs):
            if buf is None:
                failed[key] = "missing"
                continue
            if self._stage(items, ref, buf):
                counts[rebuilt_tier(self._decision, ref.rank, "local")] += ref.length
            else:
                failed[key] = "checksum"
                log.warning("local copy of %s is corrupt; fetching another copy", describe_item(items[0], ref, self._record.step))
        return fetch_remote(staging, comm, transport, by_key, routes, failed, counts, first)

    def _stage(self, items: list[ReadItem], ref: ShardRef, buf: torch.Tensor) -> bool:
        """Verify ``buf`` (the stored bytes of one chunk) against ``ref``; if it matches, stage it
        for the landing, with nothing copied yet. False on a checksum mismatch.

        Used for local slot views and peer receive buffers (``gemini_dcp.peer.fetch``).
        """
        step = self._decision.step if self._decision else -1
        return self._staging.stage(items, ref, buf, step, self._record.metadata if self._record is not None else None)

    def _stage_from_persistent(self, plan: LoadPlan, planner: LoadPlanner) -> int:
        """Read and verify ``plan``'s items from the persistent tier into the stage; bytes read.

        Raises (PersistentTierError, ChecksumMismatchError) with nothing of ``plan`` staged.
        """
        assert self.persistent is not None and self._decision is not None
        return self._staging.stage_persistent(self.persistent, self._decision.step, plan, planner)

    @property
    def _arenas(self) -> list[ReceiveArena]:
        """This restore's peer receive buffers (``gemini_dcp.peer.fetch`` adds to them)."""
        return self._staging.arenas

    @property
    def _rank_ok(self) -> bool:
        """False once this rank knows it will raise; it tells the others in the first agreement round."""
        return self._staging.rank_ok

    @_rank_ok.setter
    def _rank_ok(self, ok: bool) -> None:
        self._staging.rank_ok = ok

    # ---- the key/shape check (gemini_dcp.restore.state_dict_check) ----------------------------------
    def _resolve_destinations(self, plan: LoadPlan, planner: LoadPlanner) -> CheckpointMismatchError | None:
        """Resolve every tensor item's destination once (kept for the landing) and check that the
        state dict matches the checkpoint; the error (not raised: see ``read_data``) or None."""
        if self._checked_planner is not planner:
            mismatch = self._mismatch(planner)
            if mismatch is not None:
                return mismatch
        return self._mismatch_error(resolve_destinations(plan, planner, self._staging.dests))

    def _mismatch(self, planner: LoadPlanner) -> CheckpointMismatchError | None:
        """Keys of the planner's state dict missing from the checkpoint (unless the planner allows a
        partial load) and tensors whose saved size differs from the requested one."""
        return self._mismatch_error(find_mismatch(planner, getattr(self, "_metadata", None)))

    def _mismatch_error(self, mismatch: Mismatch | None) -> CheckpointMismatchError | None:
        if mismatch is None:
            return None
        step = self._decision.step if self._decision is not None else self._requested
        return mismatch.error(step=step, job_id=self.job_id, saved_by=saved_by(self._record))


class _RestoreSide:
    """The reader's side of one load's transfers (:class:`~gemini_dcp.peer.fetch.Staging`)."""

    def __init__(self, reader: GeminiStorageReader, planner: LoadPlanner) -> None:
        assert reader._decision is not None and reader._record is not None
        self.reader, self.planner = reader, planner
        self.decision, self.record = reader._decision, reader._record
        self.refs = refs_by_key(reader._record)
        self.node_id = reader.node_id
        self.has_persistent = reader.persistent is not None

    def local_bytes(self, ref: ShardRef) -> torch.Tensor | None:
        return self.reader._local_bytes(ref)

    def stage(self, items: list[ReadItem], ref: ShardRef, buf: torch.Tensor) -> bool:
        return self.reader._stage(items, ref, buf)

    def from_persistent(self, items: list[ReadItem]) -> int:
        return self.reader._stage_from_persistent(LoadPlan(items), self.planner)

    def keep_arena(self, arena: ReceiveArena) -> None:
        self.reader._arenas.append(arena)

    def rank_ok(self) -> bool:
        return self.reader._rank_ok


def _other_job(record: StepRecord, job_id: str, world_size: int, description: str) -> str:
    """Why the step in ``record`` could be another job's ("" when it is this job's).

    This job's step: the same job id, not a shared default (``DEFAULT_JOB_IDS``: every job without
    one has it), the same world size, and the same torchrun run id (``--rdzv-id``, or ``none``
    without it; what a restart keeps) in the launch descriptions (``transport.launch``). Nothing else
    of a launch is compared: a restart gets a new rendezvous and launch id.
    """
    saved, mine = _run_id(getattr(record, "launch_description", "") or ""), _run_id(description)
    if record.job_id != job_id:
        return f"saved as job {record.job_id!r}"
    if job_id in DEFAULT_JOB_IDS:
        return f"job id {job_id!r} is the one every job without a job id gets"
    if record.world_size != world_size:
        return f"saved by {record.world_size} ranks, restored by {world_size}"
    if saved is None or saved != mine:
        return f"run id {saved or '?'}, this process's {mine or '?'}"
    return ""


def _run_id(description: str) -> str | None:
    """The torchrun run id in a launch description (``run <id> at ...``), None for a launch outside torchrun."""
    parts = description.split()
    return parts[1] if len(parts) > 1 and parts[0] == "run" and parts[1] != "-" else None


def _store_timelines(store: Any, steps: Sequence[int]) -> tuple[dict[int, str], str]:
    """The timeline of each of the store's ``steps`` and the store's newest lineage as JSON (rank 0 of a
    restore; plain data for the gather). Unreadable: logged, and every step counts as the root timeline's."""
    try:
        timelines, lineage = store.timelines(steps)
    except Exception as exc:  # noqa: BLE001 - the restore goes on with what memory knows
        log.warning("could not read the timelines of the persistent tier's steps: %s", exc)
        return {}, ""
    return timelines, json.dumps(lineage.to_json()) if lineage.gen else ""
