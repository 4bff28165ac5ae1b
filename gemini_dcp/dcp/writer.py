"""GeminiStorageWriter: the DCP StorageWriter adapter over the commit protocol.

Call order (driven by ``dcp.save``; **all ranks must call dcp.save together**):

1. ``reset(checkpoint_id)`` — the training step (int) being saved.
2. ``set_up_storage_writer(is_coordinator, ...)``.
3. ``prepare_local_plan`` / ``prepare_global_plan`` — sizes are checked against
   the free space of the tier root here, before any byte is written; each rank's pre-write
   agreement values ride its plan to the coordinator, which combines them into every final
   plan (:mod:`gemini_dcp.commit.agreement`).
4. ``write_data`` — runs the commit protocol (:mod:`gemini_dcp.commit.protocol`, collective
   on the checkpoint control group): agree on G, the newest step committed on every node
   (this save neither overwrites nor evicts it; taken from the final plan, or one all-reduce
   when DCP's plan cache handed back a cached plan); copy this rank's items into a slot of the
   node's tier (:meth:`GeminiStorageWriter._write_local`, the DCP-specific part) and
   checksum them; gather every rank's report; replicate to peer nodes; then each node's
   leader atomically writes the step record — the commit — and evicts old steps.
5. ``finish`` (coordinator) — confirms the commit and hands the step to the
   persistent drain.

A SIGKILL anywhere before (4)'s record rename leaves the previous step as the
newest restorable one; records are renamed into place, never edited.

The slot files live in a :class:`~gemini_dcp.commit.slot_pool.SlotPool`; the async path's
pacers in one :class:`~gemini_dcp.commit.hooks.SaveHooks` value (``writer.hooks``).

Every option that shapes a save is validated before any directory is created; the
mechanisms live in :mod:`gemini_dcp.commit`, :mod:`gemini_dcp.save` and the tiers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..commit.agreement import AgreedValues, PlannedValues, combine_planned, take_agreed
from ..commit.hooks import NO_HOOKS, SaveHooks
from ..commit.protocol import LocalWrite, SaveSpec
from ..core.checksum import resolve_algo
from ..core.config import parse_step
from ..errors import ConfigError, InvalidStepError
from ..ext import loader as ext_loader
from ..local.launch_lock import hold_launch_lock
from ..local.record_types import ShardRef, StepRecord
from ..local.slots import SlotFile
from ..node import open_save_node
from ..options import GeminiOptions, resolve_options
from ..peer.parity import encode_parity
from ..peer.push import replicate
from ..save.carry import SaveStats
from ..save.local_write import LocalWriter
from ..transport.comm import Comm, get_comm
from ..transport.launch import current_launch, launch_known
from ..transport.nixl import prestart as nixl_prestart
from ..transport.p2p import transport_for

log = logging.getLogger(__name__)

class GeminiStorageWriter(StorageWriter):
    """Write DCP checkpoints into the CPU memory of this node (and of peers).

    Args:
        root: tier root on a memory-backed filesystem (default ``$GEMINI_DCP_ROOT``
            or ``/dev/shm/gemini_dcp``). Ranks sharing a root are one node.
        job_id: isolates jobs sharing a root (default ``$GEMINI_DCP_JOB_ID``, ``$TORCHELASTIC_RUN_ID`` or ``"default"``).
        keep: committed steps retained in memory (default 2).
        replicas: copies of each node's shards in CPU memory, the node's own included
            (1 = local only; 2 = one peer copy).
        parity_group: instead of replicas, XOR parity over groups of this many nodes (>= 3):
            each node keeps ~1/(g-1) of a checkpoint in parity and any one node per group can be
            rebuilt (docs/parity.md). Requires ``replicas=1``.
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
        incremental: copy only the tensors changed since the step's slot was last written; the
            others are carried (their bytes are already there). Off by default: the change rule
            (same storage and in-place version counter) cannot see writes through ``.data``, fused
            optimizers (``fused=True``) or external kernels (docs/incremental.md).
        full_every: with ``incremental``, copy everything every K-th save (bounds what a missed
            change can cost); None: only when the structure changes or after a restart.
        nonfinite: what a save does with NaN/Inf values, counted in the copy's own pass:
            ``"mark"`` (default) commits and marks a step holding more of them than the newest
            healthy step unhealthy (restores pass over it); ``"refuse"`` fails such a save with
            UnhealthyStateError, nothing committed; ``"ignore"`` skips the check. Default:
            ``$GEMINI_DCP_NONFINITE``, else ``"mark"`` (docs/health.md).
        failure_domain: this node's failure domain (a rack, switch or power feed name, the same on
            every rank of the node): replicas and parity groups are placed so that each node's copies
            lie in as many distinct domains as exist. Default ``$GEMINI_DCP_FAILURE_DOMAIN``, else
            unknown: placement by node position only (docs/placement.md).

    ``writer.last_save`` (a :class:`gemini_dcp.save.carry.SaveStats`, this rank, the last
    committed save): ``bytes_written`` copied into the tier, ``bytes_carried`` already held,
    ``nonfinite`` this rank's ``{fqn: count}`` of the items holding NaN/Inf values.

    Steps: each ``checkpoint_id`` is an int step in ``[0, 2**63)``. A step is evicted from
    a node only once every node has committed a newer one: the newest step known committed
    everywhere stays until then, so a save that commits on some nodes only (a full tmpfs at
    the record write, a crash) never leaves nodes holding different steps.

    Saving a step twice: a second save of a step *this launch* already committed is
    refused with InvalidStepError (saving model and optimizer with two ``dcp.save`` calls
    would otherwise replace one with the other: put both in one state dict, or use two
    writers with separate job ids). A step saved by another launch (before a restart)
    is replaced, and the replacement is logged.

    One live launch per job: constructing a writer holds a lock for this launch in the job
    directory while the writer lives (the ranks agree on the launch over the default group's
    store, however the group was initialized: :mod:`gemini_dcp.transport.launch`; a writer built
    before ``init_process_group`` moves to the agreed launch at its first save); a second *live* launch with the same root and
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
        parity_group: int | None = None,
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
        incremental: bool = False,
        full_every: int | None = None,
        nonfinite: str = "mark",
        peer_transport: str | None = None,
        failure_domain: str | None = None,
    ) -> None:
        super().__init__()
        # Every option is validated before anything is created (tier or persistent directories):
        # ``options`` merged with the keywords (a keyword and an options field set to different
        # values is a ConfigError), the drain settings from the environment when no options are given.
        self.options: GeminiOptions = resolve_options(
            options, root=root, job_id=job_id, keep=keep, replicas=replicas, placement=placement, checksum=checksum,
            capacity_bytes=capacity_bytes, timeout_s=timeout_s, on_peer_failure=on_peer_failure,
            persistent=persistent, persist_every=persist_every, persist_keep=persist_keep,
            persist_keep_every=persist_keep_every, parity_group=parity_group, incremental=incremental,
            full_every=full_every, nonfinite=nonfinite, peer_transport=peer_transport, failure_domain=failure_domain,
        )
        cfg = self.options
        if cfg.peer_transport != "gloo":  # NIXL's agent started now, not inside the first transfer
            nixl_prestart()
        ext_loader.preload()  # the extension mapped now, not inside a timed save or restore
        self._algo = resolve_algo(self.options.local.checksum)
        # tier, launch lock, commit protocol, copy engine, drain
        node = open_save_node(cfg, owner=self, launch=current_launch())
        self.tier = node.tiers.tier
        self.root: Path = self.tier.root
        self.job_id: str = self.tier.job_id
        self.node_id = node.tiers.node_id
        self.persistent = node.tiers.persistent
        self.launch, self._launch_release, self._launch_bound = node.launch, node.launch_release, node.launch_bound
        self.commit, self.slot_pool, self.local_writer = node.commit, node.slot_pool, node.local_writer
        self.parity_slots, self._replica_memory, self._drainer = node.parity_slots, node.replica_memory, node.drainer
        self.persist_every = cfg.persistent.every
        self._node_order: list[str] | None = None  # the placement's node positions, kept across saves
        # Delta replication of incremental saves (peer/delta.py): this writer's name and save count as a sender.
        self._delta_token = os.urandom(8).hex()
        self._save_seq = 0
        self.last_save: SaveStats | None = None  # this rank's last committed save (bytes written / carried)
        self._pending_save: SaveStats | None = None
        self._planned_total: tuple[SavePlan, int] | None = None  # (plan, its tensor bytes), for _check_space
        # The async path's pacers and copy-done callback for the next save (see SaveHooks).
        self.hooks: SaveHooks = NO_HOOKS
        self.process_group = process_group
        # The control group's scope (transport.comm.get_comm): "" is shared with every writer and
        # reader of the process; AsyncCheckpointer gives its writer a scope of its own, so that its
        # background commit never shares a group with the training thread's collectives.
        self.comm_scope = ""
        self._step: int | None = None
        self._is_coordinator = True
        self._rank = 0

    # ---- what the last save did (read-only; the commit protocol keeps it) ----------------
    @property
    def last_replication(self) -> dict[str, Any]:
        """The last save's peer protection, this rank: scheme, bytes sent, seconds, ``degraded``..."""
        return self.commit.last_replication

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this writer saw committed on every rank."""
        return self.commit.last_committed_step

    # ---- StorageWriter API -------------------------------------------------------------
    @property
    def checkpoint_id(self) -> int | None:
        return self._step

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        self._step = None if checkpoint_id is None else parse_step(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._bind_launch()
        self._is_coordinator = is_coordinator
        self._rank = int(kwargs.get("rank", _default_rank()))

    def _bind_launch(self) -> None:
        """Move a writer built before the process group existed to the launch the ranks agreed on
        (once a group exists; local work apart from the first agreement's compare-and-set)."""
        if self._launch_bound:
            return
        if not launch_known():
            return  # still no group: a launch of one process, as held
        self._launch_bound = True
        agreed = current_launch()
        if agreed.launch_id == self.launch.launch_id:
            return
        self._launch_release()
        self.launch = agreed
        self._launch_release = hold_launch_lock(self.tier, self.launch, self)
        self.commit.node = dataclasses.replace(
            self.commit.node, host=self.launch.host, launch_id=self.launch.launch_id,
            launch_description=self.launch.description,
        )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Check the space, and hand this rank's pre-write agreement values to DCP's coordinator
        in the plan (``storage_data``, when the planner left it empty): see :meth:`prepare_global_plan`."""
        step = self._require_step()
        self._check_space(plan)
        if plan.storage_data is not None or not plan.usable:
            return plan  # the planner's own data, or DCP's plan cache (the coordinator gets no plan): the all-reduce runs
        return dataclasses.replace(plan, storage_data=PlannedValues(step, self.commit.prewrite_values(step)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator only (local): combine the ranks' pre-write agreement values (MIN) into every
        final plan, so that ``write_data`` runs no agreement collective of its own. When some plan
        does not carry fresh values of this step, or DCP's plan cache will hand some rank a cached
        plan instead, every final plan says so and every rank runs the all-reduce
        (:mod:`gemini_dcp.commit.agreement`)."""
        payloads = [p.storage_data for p in plans]
        if any(p is not None and type(p) is not PlannedValues for p in payloads):
            return plans  # the planner's own storage_data: left alone (every rank then runs the all-reduce)
        step = self._require_step()
        values = combine_planned(step, payloads, delivered=all(p.usable for p in plans))
        return [dataclasses.replace(p, storage_data=AgreedValues(step, values)) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Copy this rank's items into the tier and commit the step collectively.

        Collective over the checkpoint control group: all ranks call it (DCP does).
        """
        self._bind_launch()
        comm = get_comm(self.options.timeout_s, self.process_group, scope=self.comm_scope)
        planned = getattr(planner, "metadata", None) if comm.rank == 0 else None  # the coordinator's global metadata
        step = self._require_step()
        spec = SaveSpec(step=step, planned=planned if isinstance(planned, Metadata) else None, use_basis=True,
                        agreed=take_agreed(plan.storage_data, step))
        results = self._save(comm, plan, planner, spec)
        fut: Future[list[WriteResult]] = Future()
        # DCP hands the results only to finish(), which needs them only to complete a record
        # committed without the planner's metadata: a complete one (the same on every rank) needs
        # none, and DCP's own gather of them to the coordinator then carries empty lists.
        rec = self.commit.pending_record
        fut.set_result([] if rec is not None and rec.complete else list(results))
        return fut

    def write_replayed(
        self,
        plan: SavePlan,
        planner: SavePlanner,
        metadata: Metadata,
        layout: Mapping[MetadataIndex, ShardRef] | None = None,
        agreed: list[int] | None = None,
    ) -> Sequence[WriteResult]:
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

        Returns this rank's write results as a sequence built on first use (a replay that
        never reads them does not pay for building them).
        """
        comm = get_comm(self.options.timeout_s, self.process_group, scope=self.comm_scope)
        spec = SaveSpec(step=self._require_step(), known=metadata, layout=layout, agreed=agreed)
        return self._save(comm, plan, planner, spec, check_space=True)

    def _save(
        self, comm: Comm, plan: SavePlan, planner: SavePlanner, spec: SaveSpec, check_space: bool = False,
    ) -> Sequence[WriteResult]:
        """One save through the commit protocol (collective: all ranks call it together)."""
        self._pending_save = None
        steps = _PlanSteps(self, comm, plan, planner, spec.step, check_space)
        results = self.commit.save(comm, spec, steps, hooks=self.hooks)
        self.last_save = self._pending_save
        return results

    def prewrite_values(self, step: int) -> list[int]:
        """This rank's part of the pre-write agreement of saving ``step``: three int64 values,
        each combined over all ranks by MIN (local work; see :mod:`gemini_dcp.commit.agreement`).
        A replayed save carries them in its own all-reduce, then ``write_replayed(agreed=)``."""
        return self.commit.prewrite_values(step)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: confirm the commit (writing the final metadata if the
        planner did not expose it during ``write_data``) and schedule the drain."""
        step = self._require_step()
        rec = self.commit.pending_record
        if rec is not None and not rec.complete:
            storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
            final = dataclasses.replace(rec, metadata=dataclasses.replace(metadata, storage_data=storage_data), complete=True)
            self.tier.write_record(final)
            if self._drainer is not None:
                try:
                    self._drainer.restage(final)
                except OSError as exc:  # the in-memory commit stands; the drain still finds it in the tier
                    log.warning("step %s: could not restage the completed record for the drain: %s", step, exc)
        self.commit.last_committed_step = step

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

    def _replicate(
        self, comm: Comm, step: int, reports: Any, expand: Callable[[Any], Any] | None
    ) -> tuple[list[Any], dict[str, Any]]:
        """Step 4 of the protocol: the peer tier's replication, given only the narrow values it needs."""
        done = replicate(
            comm, transport_for(comm, self.options.peer_transport), step, reports, options=self.options, tier=self.tier,
            slot=self.slot_pool.slot, budget_check=self.slot_pool.budget_check,
            previous_order=self._node_order, pace=self.hooks.replication_pace, expand=expand,
            memory=self._replica_memory,
        )
        self._node_order = done.node_order
        return done.replica_slots, done.stats

    def _protect(self, comm: Comm, step: int, reports: Any) -> tuple[Any, dict[str, Any]]:
        """Step 4 with ``parity_group``: the XOR parity of every lane (gemini_dcp.peer.parity); collective."""
        group = self.options.peer.parity_group
        assert group is not None
        done = encode_parity(
            comm, transport_for(comm, self.options.peer_transport), step, reports, group=group, tier=self.tier,
            data_slot=self.slot_pool.slot, parity_slots=self.parity_slots, budget_check=self.slot_pool.budget_check,
            algo=self._algo, on_peer_failure=self.options.peer.on_peer_failure, previous_order=self._node_order,
            pace=self.hooks.replication_pace,
        )
        self._node_order = done.node_order
        return done.layout, done.stats

    def slot(self, rank: int, idx: int) -> SlotFile:
        """This node's slot ``idx`` of ``rank`` (opened on first use)."""
        return self.slot_pool.slot(rank, idx)

    def budget_check(self, delta: int) -> None:
        """Raise TierFullError when growing this job's tier by ``delta`` bytes would break ``capacity_bytes``."""
        self.slot_pool.budget_check(delta)

    def _check_space(self, plan: SavePlan) -> None:
        """Fail before writing when the ring of slots cannot fit in the tier root."""
        held = self._planned_total
        fresh = held is None or held[0] is not plan  # a replayed plan is the same object save after save
        if fresh:
            held = self._planned_total = (plan, sum(_planned_bytes(item) for item in plan.items))
        assert held is not None
        self.slot_pool.check_space(self._rank, held[1], len(plan.items))
        if fresh:  # the ring's other slots get their pages off the critical path (SlotPool.prefault)
            self.slot_pool.prefault(self._rank, held[1], len(plan.items))

    def _write_local(self, plan: SavePlan, planner: SavePlanner, step: int, rank: int) -> LocalWrite:
        """Step 2 of the commit protocol: resolve this rank's DCP items and copy them, checksummed,
        into a slot of the node's tier (paced by ``hooks.pace`` when set; see
        :mod:`gemini_dcp.save.local_write`). Local work."""
        done = self.local_writer.write(plan, planner, rank, self._algo, self.hooks.pace)
        self.slot_pool.check_linked(rank, done.slot)  # before the gather: a removed slot fails the save everywhere
        self._pending_save = _save_stats(step, done, self.local_writer)
        if done.nonfinite:
            self._pending_save = dataclasses.replace(self._pending_save, nonfinite=dict(done.nonfinite))
        memory = self._replica_memory
        if memory is not None:
            offer = self.local_writer.delta_offer(rank, self._delta_token, self._next_seq())
            keep = self.options.local.keep
            bases = memory.bases(lambda src: self.tier.choose_slot(src, keep))
            done = dataclasses.replace(done, delta_offer=offer, replica_bases=bases)
        return done

    def _next_seq(self) -> int:
        self._save_seq += 1
        return self._save_seq


class _PlanSteps:
    """The writer's own steps of one save of ``plan`` (:class:`~gemini_dcp.commit.protocol.SaveSteps`)."""

    def __init__(self, writer: GeminiStorageWriter, comm: Comm, plan: SavePlan, planner: SavePlanner, step: int,
                 check_space: bool) -> None:
        self.writer, self.comm, self.plan, self.planner, self.step = writer, comm, plan, planner, step
        self.check_space_first = check_space  # a replayed save: DCP's prepare_local_plan did not check it
        self.replicates = True
        self.protects = writer.options.peer.parity_group is not None

    def check_space(self) -> None:
        if self.check_space_first:
            self.writer._check_space(self.plan)

    def write_local(self) -> LocalWrite:
        return self.writer._write_local(self.plan, self.planner, self.step, self.comm.rank)

    def replicate(self, step: int, reports: list[Any], expand: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.writer._replicate(self.comm, step, reports, expand)

    def protect(self, step: int, reports: list[Any]) -> tuple[Any, dict[str, Any]]:
        return self.writer._protect(self.comm, step, reports)

    def after_commit(self, record: StepRecord, rank: int) -> None:
        self.writer._after_commit(record, rank)


def _save_stats(step: int, done: LocalWrite, local_writer: LocalWriter) -> SaveStats:
    """This rank's :class:`SaveStats` of a local write (every item copied unless it says otherwise)."""
    held = local_writer.last_carry
    if done.save_bytes is None or held is None:
        n = done.item_bytes if done.item_bytes is not None else sum(r.size_in_bytes for r in done.results)
        return SaveStats(step=step, bytes_written=n, bytes_carried=0, items_written=len(done.results), items_carried=0,
                         full=True, reason="incremental=False", slot=done.slot)
    plan_c, _, deltas = held
    carried = sum(plan_c.carry) + sum(1 for rd in deltas.values() if not rd.changed.numel())
    return SaveStats(step=step, bytes_written=done.save_bytes[0], bytes_carried=done.save_bytes[1],
                     items_written=len(plan_c.carry) - carried, items_carried=carried, full=not plan_c.any,
                     reason=plan_c.reason, slot=done.slot, rows_written=sum(int(rd.changed.numel()) for rd in deltas.values()),
                     rows_total=sum(rd[1] for rd in deltas.values()))


def _planned_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
