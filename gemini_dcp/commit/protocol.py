"""THE commit protocol: how one save of a step becomes committed on every node.

A save is collective over the checkpoint control group: **every rank calls**
:meth:`CommitProtocol.save` for the same step, with its own local write (the DCP adapter,
:class:`gemini_dcp.dcp.writer.GeminiStorageWriter`, does so from ``write_data`` and
``write_replayed``). The steps, in order (the collective ones marked *all ranks*):

1. **agree** (*all ranks*; one MIN all-reduce of three ints, :mod:`.agreement`; a save that
   already holds the combined values runs none, ``agreed``: a replayed save's own all-reduce
   carried them, a plain ``dcp.save``'s planning collective did): G, the newest step committed
   on every node; a repeated step is refused on every rank.
2. **write local** (local): the adapter copies this rank's items into a slot of this
   node's tier and checksums them; ``SaveHooks.on_local_copy_done`` fires after it, even
   on failure.
3. **report / gather** (*all ranks*; one gather of :class:`RankReport` in one fixed-size
   all-gather, :func:`.exchange.gather_objects` (a second round only for a report larger than
   its frame), a second gather only when a plain save's compact reports meet ranks holding
   different bases, and one ``broadcast_object`` of rank 0's planned metadata only when it is
   too large to ride inline and some rank does not hold it yet). A rank whose write failed
   raises its own error; every other rank raises PeerError: nothing is committed.
   Each report carries its rank's NaN/Inf counts and its proposed baseline (the newest healthy
   step it knows); every rank then judges the step's health alike against the newest proposal
   (local, pure: :meth:`CommitProtocol.judge_health`, :mod:`gemini_dcp.health.baseline`):
   with ``nonfinite="refuse"`` an unhealthy step raises UnhealthyStateError on every rank here,
   nothing committed; with ``"mark"`` the record says so.
4. **replicate** (*all ranks*, when ``replicas > 1`` over several processes: the peer
   transfers, then one ``all_gather_object`` of the replica slots; with ``parity_group``, XOR parity instead).
5. **build record** (local, pure: :func:`build_record`): the same global part on every
   rank (after the replicas: the record names every node holding a copy).
6. **commit on each node** (local; the node leader, its lowest rank, only): the record is
   renamed into place (the commit point), then
7. **evict** (leader): old steps beyond ``keep``, never G nor the step just written.
8. **hand off to the drain** (local): ``after_commit`` (the persistent drain request).

Only steps 1, 3 and 4 are collective. Their order and their number of calls are fixed:
other ranks, and plan replay's recorded saves, rely on them. A SIGKILL anywhere before step 6's rename leaves the previous
step as the newest restorable one; records are renamed into place, never edited.
``fault_point`` names (``save.*``, ``replicate.after``, ``commit.*``) mark the places the
fault-injection harness kills at.

Glossary:

- *G* / *global step*: the newest step committed on every node (agreed at step 1).
- *basis*: the committed save whose chunk layout (and metadata) a later save reuses;
  identified by (step that first committed the layout, chunk count). A plain save may
  send only checksums against it when every rank holds the same basis.
- *layout*: where every chunk of every rank lives (``{MetadataIndex: ShardRef}``); a
  replayed save's layout is that of the save it replays.
- *compact report*: a report carrying only checksums, in the layout's order
  (:func:`gemini_dcp.commit.reports.compact`), plus the new places of pickled values that changed
  length; *overlay*: a record's storage_data as the shared layout plus this save's checksums and
  those places (:class:`~gemini_dcp.local.record_types.ChecksumOverlay`).
- *known metadata*: the digest (and shell) of rank 0's planned DCP metadata this rank
  already holds from its last save; unchanged metadata then travels in no message.
- *wire chunk*: the message size a rank's paced replication sends its slot in (0: one
  message); receivers post matching receives.
- *leader*: the lowest rank of a node; it writes the node's record and evicts.

The protocol is one sequence of collectives whose order every rank must
follow (write, gather, protect by replicas or parity, record, commit, evict); each step's
mechanics are in agreement.py, reports.py, slot_pool.py and the tiers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ..core.faults import fault_point
from ..core.safe_pickle import restricted_loads
from ..errors import GeminiError, InvalidStepError, PeerError, TierRootError, UnhealthyStateError
from ..health.baseline import Baseline, agree, baseline_of, restored_baseline
from ..health.rule import StepHealth, judge, totals
from ..local.record_types import ChecksumOverlay, RankSlot, ShardRef, StepRecord, metadata_shell_blob
from ..local.tier import LocalTier
from ..options.tree import GeminiOptions
from . import reports as rp
from .agreement import Agreement, min_all_reduce, prewrite_values
from .exchange import GatherGroup, gather_objects
from .hooks import NO_HOOKS, SaveHooks, block_bytes
from .reports import RankReport, SplitLayout

log = logging.getLogger(__name__)

T = TypeVar("T")
Layout = Mapping[MetadataIndex, ShardRef]
Expand = Callable[[RankReport], "RankReport | None"]


class SaveSteps(Protocol):
    """The steps of one save that the protocol's caller does itself (the writer, for one plan).

    :meth:`CommitProtocol.save` calls them in order; it never reaches into its caller otherwise.
    """

    replicates: bool
    """Whether step 4 runs as peer replicas (:meth:`replicate`; ignored for a single process)."""
    protects: bool
    """Whether step 4 runs as XOR parity instead (:meth:`protect`)."""

    def check_space(self) -> None:
        """Before step 2: refuse a save the tier has no room for (raises; every rank learns it at the gather)."""

    def write_local(self) -> LocalWrite:
        """Step 2: copy and checksum this rank's items into a slot."""

    def replicate(self, step: int, reports: list[RankReport],
                  expand: Expand | None) -> tuple[tuple[RankSlot, ...], dict[str, Any]]:
        """Step 4 (collective): the replica slots this rank stored for others, and the stats."""

    def protect(self, step: int, reports: list[RankReport]) -> tuple[Any, dict[str, Any]]:
        """Step 4 as XOR parity (collective): the parity layout and the stats."""

    def after_commit(self, record: StepRecord, rank: int) -> None:
        """Step 8 (local): hand the committed record on (the persistent drain's request)."""


class Collectives(GatherGroup, Protocol):
    """The collectives the protocol runs on the control group (:class:`gemini_dcp.transport.comm.Comm`):
    the commit gather's (:class:`~gemini_dcp.commit.exchange.GatherGroup`) plus the rank and a broadcast."""

    @property
    def rank(self) -> int: ...

    def broadcast_object(self, obj: T, src: int) -> T: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NodeIdentity:
    """Who this rank's node is (reported at the gather; two nodes claiming one id are refused)."""

    node_id: str
    host: str
    root_id: tuple[int, int]  # (st_dev, st_ino) of the tier root
    launch_id: str
    launch_description: str
    failure_domain: str = ""  # the node's failure domain ("" unknown), reported at the gather


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LocalWrite:
    """Step 2's outcome: this rank's bytes are in slot ``slot`` (``nbytes`` used)."""

    slot: int
    # Built on first use by the adapter when it can (a compact report never reads them).
    results: Sequence[WriteResult]
    nbytes: int
    # The results' checksums in order, and a token whose identity says "the same results as the
    # last write with this token, checksums aside" (the adapter's cached program; None: unknown).
    # The protocol then decides a compact report without comparing every result again.
    checksums: tuple[int, ...] | None = None
    template: object | None = None
    # (position, offset, length) of every pickled value in this write: a value's length may change from
    # save to save within its room in the slot, or it moves to a larger room (the results then differ
    # from the layout's in that offset and length).
    byte_spans: tuple[tuple[int, int, int], ...] = ()
    # Incremental saves (save/carry.py): (item bytes copied, bytes the slot already held), None: all copied;
    # delta replication (peer/delta.py): this save's offer, and the replica bases this node holds.
    save_bytes: tuple[int, int] | None = None
    delta_offer: Any = None
    replica_bases: tuple[Any, ...] = ()
    item_bytes: int | None = None  # the results' size_in_bytes summed (None: sum them)
    nonfinite: tuple[tuple[str, int], ...] = ()  # (fqn, count) of this rank's items holding NaN/Inf (gemini_dcp.health)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SaveSpec:
    """One save. ``planned``: rank 0's planned metadata (sent to every rank at the gather);
    ``known``: metadata every rank already holds (a replayed save: nothing to send).
    ``layout``: a layout every rank holds (the replayed plan's): results matching it go
    compact. ``use_basis``: compact against the last committed layout instead, which a rank
    may lack (a fresh writer): unless every rank reports the same basis, all gather again
    in full. ``agreed``: step 1's values already combined by MIN (all ranks pass it, or none).
    """

    step: int
    planned: Metadata | None = None
    known: Metadata | None = None
    layout: Layout | None = None
    use_basis: bool = False
    agreed: Sequence[int] | None = None


def build_record(
    *, job_id: str, step: int, world_size: int, reports: list[RankReport], meta: Metadata | None,
    overlay: ChecksumOverlay | None, replicas: int, placement: str, launch: tuple[str, str],
    health: StepHealth | None = None, timeline: str = "",
) -> StepRecord:
    """Step 5 (pure): the step record's global part, the same on every rank. ``launch`` is
    used when rank 0's report names none. Without ``meta`` the record is incomplete (the
    coordinator's ``finish`` completes it)."""
    storage_data: Any = overlay
    if storage_data is None:
        storage_data = {wr.index: wr.storage_data for rep in reports for wr in rep.results}
    complete = meta is not None
    if meta is None:
        meta = Metadata(state_dict_metadata={})
    rank_nodes = tuple(rep.node_id for rep in reports)
    launch_id, launch_desc = reports[0].launch or launch
    save_bytes = tuple(rep.save_bytes or (rep.nbytes, 0) for rep in reports) if any(r.save_bytes for r in reports) else ()
    domains: dict[str, str] = {}
    for rep in reports:  # a node's domain: its lowest rank's (the ranks of a node share one environment)
        if rep.failure_domain:
            domains.setdefault(rep.node_id, rep.failure_domain)
    holders: dict[str, set[str]] = {n: {n} for n in rank_nodes}
    for rep in reports:
        for rs in rep.replica_slots:
            holders[rank_nodes[rs.rank]].add(rep.node_id)
    return StepRecord(
        job_id=job_id, step=step, world_size=world_size,
        metadata=dataclasses.replace(meta, storage_data=storage_data),
        rank_nodes=rank_nodes, rank_nbytes=tuple(rep.nbytes for rep in reports),
        holders={k: tuple(sorted(v)) for k, v in holders.items()},
        replicas=replicas, placement=placement, complete=complete,
        launch_id=launch_id, launch_description=launch_desc, rank_save_bytes=save_bytes,
        nonfinite=health.counts if health is not None else (), healthy=health.healthy if health is not None else None,
        timeline=timeline, node_domains=tuple((n, domains[n]) for n in dict.fromkeys(rank_nodes) if n in domains),
    )


def node_slots(reports: list[RankReport], node_id: str) -> tuple[RankSlot, ...]:
    """The slots of ``node_id``'s record: its ranks' own slots, then the replicas it stored."""
    mine = [rep for rep in reports if rep.node_id == node_id]
    return tuple(RankSlot(rep.rank, rep.slot, rep.nbytes) for rep in mine) + tuple(
        rs for rep in mine for rs in rep.replica_slots
    )


def protected_step(step: int, reports: list[RankReport], node_id: str, global_step: int | None) -> int | None:
    """The step eviction must keep besides ``step`` itself: on one node its record is the whole
    commit, so ``step`` is committed everywhere; on several, G (the others' records are known
    only at the next save's agreement)."""
    return step if all(rep.node_id == node_id for rep in reports) else global_step


def raise_if_failed(error: BaseException | None, reports: Sequence[T | None], what: str) -> list[T]:
    """After a gather: re-raise this rank's own error, else PeerError naming the ranks that
    failed (those that sent None); else every rank's report."""
    if error is not None:
        raise error
    failed = [r for r, rep in enumerate(reports) if rep is None]
    if failed:
        raise PeerError(f"ranks {failed} failed while {what}; the step was not committed (see their errors).")
    return [rep for rep in reports if rep is not None]


class CommitProtocol:
    """One writer's side of the commit protocol, and what it remembers from save to save.

    ``tier``: this node's local tier; ``node``: this rank's node; ``options``: keep,
    replicas, placement (the writer's :class:`~gemini_dcp.options.GeminiOptions`).
    """

    def __init__(self, tier: LocalTier, node: NodeIdentity, options: GeminiOptions) -> None:
        self.tier = tier
        self.node = node
        self.options = options
        self.leader: bool | None = None  # this rank is its node's lowest rank (known after a save)
        self.failed_commit: int | None = None  # a step whose record write failed on this node
        self.global_step: int | None = None  # G of the last save
        self.pending_record: StepRecord | None = None  # this node's record of the last save
        # The newest step this writer saw committed, on every rank (dcp.save and replayed saves alike).
        self.last_committed_step: int | None = None
        self.last_save_seconds: float | None = None
        self.last_replication: dict[str, Any] = {}
        # The global metadata of the last save (rank 0's plan, known to every rank after the commit gather).
        self.planned_metadata: Metadata | None = None
        # (digest, shell) of the planned metadata of the last save (see RankReport.metadata_digest).
        self.known_metadata: tuple[bytes | None, Metadata | None] = (None, None)
        self.last_metadata_transfer = "none"  # how the last save's metadata reached this rank
        # Where every rank's chunks of the last committed save live, known to every rank.
        self.committed_layout: Layout | None = None
        self.last_commit_compact = False  # the last commit gather sent this rank's checksums only
        self._split: SplitLayout | None = None  # the replay layout, split per rank (cached)
        # The health check (gemini_dcp.health): the mode, and the baseline (step, per-FQN totals) of the
        # newest healthy step agreed at the last save (None: none yet). Proposed at each save's gather
        # with this node's newest healthy record (read once) and a restore's handoff (gemini_dcp.health.baseline).
        self.nonfinite = "mark"
        self.health_baseline: Baseline | None = None
        self._tier_baseline: Baseline | None = None
        self._baseline_read = False
        self._handoff = 0  # the number of the last restore handoff taken (gemini_dcp.health.baseline.restored_baseline)
        # The basis: the chunk locations of the last committed save and (the step that first
        # committed them, their count): a plain dcp.save of the same structure sends only checksums.
        self._basis: tuple[tuple[int, int], Layout] | None = None
        self._warned_replicas = False
        self.parity = False  # the writer protects the peer tier with XOR parity (its traffic is paced too)
        self._compact_memo: dict[tuple[int, int], tuple[object, object]] = {}  # (write template, layout) known to match

    # ---- step 1: agree -------------------------------------------------------------------
    def prewrite_values(self, step: int) -> list[int]:
        """This rank's part of step 1 for ``step`` (local; see :func:`.agreement.prewrite_values`)."""
        return prewrite_values(
            self.tier, step, leader=self.leader, failed_commit=self.failed_commit, launch_id=self.node.launch_id
        )

    def agree(self, comm: Collectives, step: int) -> None:
        """Step 1. Collective: one MIN all-reduce of three ints on the control group; all ranks call it."""
        self.apply_agreement(step, min_all_reduce(comm, self.prewrite_values(step)))

    def apply_agreement(self, step: int, vals: Sequence[int]) -> None:
        """Act on the agreed (MIN over ranks) :meth:`prewrite_values`: the same on every rank."""
        self.failed_commit = None
        agreed = Agreement.of(vals)
        if agreed.failed_step is not None:
            log.warning(
                "step %s was not committed on every node (a record write failed there): it is not restorable; "
                "step %s stays the restore point until a later save commits everywhere.",
                agreed.failed_step, agreed.global_step,
            )
        if agreed.repeated:
            raise InvalidStepError(repeated_save_message(
                step, self.tier.job_id, self.node.launch_description, self.tier.last_restore(self.node.launch_id)
            ))
        self.global_step = agreed.global_step
        self.tier.begin_save(step, agreed.global_step)

    # ---- the whole save ------------------------------------------------------------------
    def save(
        self,
        comm: Collectives,
        spec: SaveSpec,
        steps: SaveSteps,
        *,
        hooks: SaveHooks = NO_HOOKS,
    ) -> Sequence[WriteResult]:
        """Run steps 1-8 for ``spec.step``; returns this rank's write results.

        Collective over the control group: all ranks call it together. ``steps`` does this
        rank's own parts (:class:`SaveSteps`): its ``check_space`` runs just before step 2,
        inside the part whose errors every rank learns at the gather.
        """
        t0 = time.perf_counter()
        step, rank = spec.step, comm.rank
        planned, layout = spec.planned, spec.layout
        basis: tuple[int, int] | None = None
        if spec.use_basis and self._basis is not None and comm.distributed:
            basis, layout = self._basis
        error: BaseException | None = None
        report: RankReport | None = None
        local: LocalWrite | None = None
        planned_blob: bytes | None = None
        digest: bytes | None = None
        try:
            # First, before any byte is written: every rank reaches it (an error it raises is the
            # same on every rank, and goes through the report gather like any other).
            if spec.agreed is not None:
                self.apply_agreement(step, spec.agreed)
            else:
                self.agree(comm, step)
            if planned is not None and comm.distributed:
                planned_blob = metadata_shell_blob(planned)
                digest = xxhash.xxh3_128_digest(planned_blob)
            steps.check_space()
            fault_point("save.before_copy")
            local = steps.write_local()
            fault_point("save.after_copy")
            # Unchanged since rank 0's last save: every rank probably holds it (checked after the gather).
            inline = rp.inline_metadata(planned_blob, comm.world_size) and digest != self.known_metadata[0]
            report = RankReport(
                rank=rank, node_id=self.node.node_id, slot=local.slot, nbytes=local.nbytes, results=local.results,
                metadata_digest=digest, metadata_blob=planned_blob if inline else None,
                storage_meta=planned.storage_meta if digest is not None and planned is not None else None,
                known_metadata=self.known_metadata[0], basis=basis, wire_chunk=self.wire_chunk(comm, hooks),
                host=self.node.host, root_id=self.node.root_id, failure_domain=self.node.failure_domain,
                launch=(self.node.launch_id, self.node.launch_description) if rank == 0 else None,
                save_bytes=local.save_bytes, delta_offer=local.delta_offer, replica_bases=local.replica_bases,
                nonfinite=local.nonfinite, health_baseline=self.propose_baseline(step),
            )
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below, then re-raised
            error = exc
        finally:
            if hooks.on_local_copy_done is not None:
                hooks.on_local_copy_done(step)
        # ---- step 3: report / gather
        split = self._split_layout(layout)
        layouts = split.by_rank if split is not None else None
        sent = report
        if layouts is not None and report is not None:
            sent = self._compact(report, layouts.get(rank, []), local)
        self.last_commit_compact = sent is not report
        reports = raise_if_failed(error, gather_objects(comm, sent), "writing shards into the local tier")
        fault_point("save.after_gather")
        assert report is not None
        rp.check_node_identities(reports)  # same result on every rank: all raise, before any commit
        if spec.use_basis and not rp.agreed_basis(reports):
            # Some rank lacks this layout (or holds another): it could not rebuild compact
            # reports. Every rank sees the same reports, so all take this branch together.
            split = layouts = None
            if any(rep.checksums is not None for rep in reports):
                reports = gather_objects(comm, report)
            self.last_commit_compact = False
        # Replayed save, every rank compact: keep the reports compact and record the layout plus
        # the checksums; otherwise rebuild every rank's write results.
        overlay = rp.overlay(split, reports) if split is not None else None
        if layouts is not None and overlay is None:
            reports = [rp.expand_report(rep, layouts) for rep in reports]
        meta = spec.known if spec.known is not None else self.gather_metadata(comm, planned, planned_blob, reports)
        self.planned_metadata = meta
        # ---- the step's health (gemini_dcp.health): the same verdict on every rank, before anything is committed
        health = self.judge_health(step, reports, rank)
        # ---- step 4: replicate
        if self.options.peer.replicas > 1:
            self._warn_replicas_capped(len({rep.node_id for rep in reports}))
        if self.options.peer.replicas > 1 and comm.distributed and steps.replicates:
            expand = (lambda rep: rp.expand(rep, layouts)) if overlay is not None else None  # type: ignore[arg-type]
            replica_slots, self.last_replication = steps.replicate(step, reports, expand)
            # Only the replica slots are new: every rank already has every report.
            gathered = comm.all_gather_object(replica_slots)
            reports = [dataclasses.replace(rep, replica_slots=rs) for rep, rs in zip(reports, gathered)]
            fault_point("replicate.after")
        if steps.protects and comm.distributed:  # step 4 as XOR parity instead of replicas (peer/parity)
            parity, self.last_replication = steps.protect(step, reports)
        # ---- step 5: build the record (after the replicas: holders name them)
        record = build_record(
            job_id=self.tier.job_id, step=step, world_size=comm.world_size, reports=reports, meta=meta,
            overlay=overlay, replicas=self.options.peer.replicas, placement=self.options.peer.placement,
            launch=(self.node.launch_id, self.node.launch_description), health=health,
            timeline=self.tier.timeline(self.node.launch_id),
        )
        if steps.protects and comm.distributed and parity is not None:
            record = dataclasses.replace(record, parity=parity)
        self.committed_layout = record.metadata.storage_data
        self._remember_basis(step, overlay, record.metadata.storage_data)
        # ---- steps 6-7: commit on each node, evict
        self.commit_on_node(record, reports, rank)
        if record.complete:  # else the coordinator's finish() completes it
            self.last_committed_step = step
        if health is not None and health.healthy:
            self.health_baseline = baseline_of(step, totals(health.counts))
        # ---- step 8: hand off to the drain
        steps.after_commit(self.pending_record or record, rank)
        self.last_save_seconds = time.perf_counter() - t0
        return report.results

    # ---- the parts -------------------------------------------------------------------------
    def propose_baseline(self, step: int) -> Baseline | None:
        """This rank's proposal of the baseline for ``step`` (local; :mod:`gemini_dcp.health.baseline`):
        a restore's handoff in this process replaces what the writer knew; then the newest of that and
        this node's newest healthy record below ``step`` (read once). None with ``nonfinite="ignore"``."""
        if self.nonfinite == "ignore":
            return None
        handoff = restored_baseline(self.tier.root, self.tier.job_id)
        if handoff is not None and handoff[0] != self._handoff:
            self._handoff, self.health_baseline = handoff
            self._baseline_read = True  # the restored step is where this process resumed: older records do not count
            self._tier_baseline = None
        if not self._baseline_read:
            self._baseline_read = True
            self._tier_baseline = self._baseline_from_tier(step)
        tier = self._tier_baseline if self._tier_baseline is not None and self._tier_baseline[0] < step else None
        return agree((self.health_baseline, tier))

    def judge_health(self, step: int, reports: list[RankReport], rank: int) -> StepHealth | None:
        """The step's health from every rank's non-finite counts against the agreed baseline, the newest
        healthy step any rank's report proposes (:mod:`gemini_dcp.health.baseline`, :mod:`gemini_dcp.health.rule`;
        None with ``nonfinite="ignore"``). Local and the same on every rank (all see the same reports): with
        ``"refuse"`` an unhealthy step raises UnhealthyStateError on every rank, before anything is replicated
        or committed."""
        if self.nonfinite == "ignore":
            return None
        agreed = agree(rep.health_baseline for rep in reports)
        self.health_baseline = agreed  # a rank that knew none (a replaced node) learns the job's
        verdict = judge([(rep.rank, rep.nonfinite) for rep in reports], None if agreed is None else dict(agreed[1]))
        fault_point("health.judge")
        if verdict.healthy:
            return verdict
        if self.nonfinite == "refuse":
            raise UnhealthyStateError(
                f"step {step} holds non-finite values the newest healthy step (step {agreed[0] if agreed else '?'}) "
                f"did not: {verdict.describe()}. Nothing was committed (nonfinite='refuse'), on any rank. Roll back to "
                "the newest healthy step (dcp.load with GeminiStorageReader) and skip the batch, or pass "
                "nonfinite='mark' to commit it marked."
            )
        if rank == 0:
            log.warning("step %s is unhealthy (restores pass over it): %s", step, verdict.describe())
        return verdict

    def _baseline_from_tier(self, step: int) -> Baseline | None:
        """The baseline of the newest healthy checked step below ``step`` on this node (None: none)."""
        try:
            for s in reversed(self.tier.steps()):
                rec = self.tier.record(s) if s < step else None
                if rec is not None and rec.healthy:
                    return baseline_of(s, totals(rec.nonfinite))
        except (OSError, GeminiError) as exc:  # the others' proposals still judge the step
            log.warning("step %s: could not read this node's records for the health baseline: %s", step, exc)
            return None
        return None

    def wire_chunk(self, comm: Collectives, hooks: SaveHooks) -> int:
        """Message size of this rank's paced replication (0: one message, unpaced)."""
        pace = hooks.replication_pace
        if pace is None or (self.options.peer.replicas <= 1 and not self.parity) or not comm.distributed:
            return 0
        return max(1, block_bytes(pace))

    def gather_metadata(
        self, comm: Collectives, planned: Metadata | None, planned_blob: bytes | None, reports: list[RankReport]
    ) -> Metadata | None:
        """Rank 0's planned metadata on every rank: the copy every rank already holds when it
        is unchanged, else from rank 0's report or — large for the world size — one broadcast
        that every rank joins (every rank sees the same reports, so all decide alike)."""
        first = reports[0]
        digest = first.metadata_digest
        if digest is None:  # one process (nothing to share), or a planner without metadata
            return planned if comm.rank == 0 else None
        held_digest, held = self.known_metadata
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
        self.known_metadata = (digest, held)
        return dataclasses.replace(held, storage_meta=first.storage_meta)

    def commit_on_node(self, record: StepRecord, reports: list[RankReport], rank: int) -> None:
        """Steps 6-7 (local): the node leader (lowest rank on this node) writes the record and evicts old steps."""
        node_id = self.node.node_id
        node_record = record.for_node(node_id, node_slots(reports, node_id))
        self.pending_record = node_record
        self.leader = rank == min(rep.rank for rep in reports if rep.node_id == node_id)
        if self.leader:
            fault_point("commit.before_record")
            try:
                self._check_slots_present(node_record)
                self.tier.write_record(node_record)
            except BaseException:
                # Not committed on this node; the previous steps are untouched (nothing was evicted).
                # DCP reports this to every rank; the next save tells every rank as well; the node's
                # other ranks, waiting for the record, are told at once (_wait_for_leader).
                self.failed_commit = record.step
                try:
                    _failed_marker(self.tier.layout.record_path(record.step), node_record.fingerprint()).touch()
                except OSError:
                    pass
                raise
            fault_point("commit.after_record")
            g = protected_step(record.step, reports, node_id, self.global_step)
            evicted = self.tier.retain(self.options.local.keep, record.step, g, self.node.launch_id,
                                       healthy_step=self.tier.newest_healthy(upto=record.step))
            fault_point("commit.after_evict")
            if evicted:
                log.debug("node %s evicted steps %s", node_id, evicted)
        else:
            self._wait_for_leader(node_record)

    def _wait_for_leader(self, node_record: StepRecord) -> None:
        """A non-leader returns once its node's leader renamed the record into place: a save that returned on
        any rank is committed on that rank's node. (A replayed save runs no collective after the gather, so a
        rank could otherwise return, train on and report a step whose record its leader had not yet written;
        a crash then lost one step more than ``AsyncCheckpointer``'s bound.) Bounded by ``timeout_s``: the
        leader's own failure to write raises on the leader, and here PeerError after the wait."""
        path = self.tier.layout.record_path(node_record.step)
        want = node_record.fingerprint()
        failed = _failed_marker(path, want)
        seen: tuple[int, int] | None = None
        deadline = time.monotonic() + self.options.timeout_s
        delay = 0.0005
        while True:
            try:
                st = os.stat(path)
                ident = (st.st_ino, st.st_mtime_ns)
            except FileNotFoundError:
                ident = None
            if ident is not None and ident != seen:
                seen = ident
                rec = self.tier.record(node_record.step)
                if rec is not None and rec.fingerprint() == want:
                    return
            if failed.exists():
                raise PeerError(
                    f"step {node_record.step}: this node's leader (the lowest rank on node {self.node.node_id}) failed "
                    "to commit the step's record (see its error); the previous step stays the newest restorable one here.")
            if time.monotonic() >= deadline:
                raise PeerError(
                    f"step {node_record.step}: this node's leader did not commit the step's record within "
                    f"{self.options.timeout_s:g} s after every rank wrote it (see the leader's error, the lowest rank "
                    f"on node {self.node.node_id}); the previous step stays the newest restorable one here.")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _check_slots_present(self, record: StepRecord) -> None:
        """TierRootError when a slot file the record names is gone from this node (removed while the
        step was saved): committing it would publish a step no restore can read."""
        for rs in record.slots:
            path = self.tier.slot_path(rs.rank, rs.slot)
            try:
                regular = stat.S_ISREG(os.lstat(path).st_mode)
            except OSError:
                regular = False
            if not regular:
                raise TierRootError(
                    f"step {record.step}: slot file {path} (rank {rs.rank}) is gone from node {self.node.node_id} "
                    "(removed by hand, or by `gemini-dcp gc --force` on a live job): the step is not committed here "
                    "and the previous one stays restorable."
                )

    def _warn_replicas_capped(self, nodes: int) -> None:
        if self.options.peer.replicas > nodes and not self._warned_replicas:
            self._warned_replicas = True
            log.warning(
                "replicas=%s but the job runs on %s node(s): each node's shards get at most %s cop%s (the node's "
                "own included). Lower replicas, or run on more nodes (ranks sharing a tier root are one node).",
                self.options.peer.replicas, nodes, nodes, "y" if nodes == 1 else "ies",
            )

    def _remember_basis(self, step: int, overlay: ChecksumOverlay | None, storage_data: Layout) -> None:
        """Keep the committed chunk locations for the next plain save to compact against.

        Decided from the gathered reports alone, so every rank keeps the same basis: an
        overlay on the kept layout keeps it (and its step); any other layout starts a new one.
        """
        base = rp.base_layout(storage_data)
        if overlay is not None and self._basis is not None and self._basis[1] is base:
            return
        self._basis = ((step, len(base)), base)

    def _compact(self, report: RankReport, mine: list[tuple[MetadataIndex, ShardRef]], local: LocalWrite | None) -> RankReport:
        """:func:`.reports.compact`, decided once per (results template, layout of this rank):
        a write whose ``template`` matched ``mine`` before matches it again (checksums and the places of
        pickled values aside: those that changed ride in the report)."""
        token = local.template if local is not None and local.checksums is not None else None
        key = (id(token), id(mine))
        hit = self._compact_memo.get(key)
        if token is not None and hit is not None and hit[0] is token and hit[1] is mine:
            assert local is not None
            return dataclasses.replace(report, results=(), checksums=local.checksums,
                                       moved=rp.moved_values(local.byte_spans, mine))
        sent = rp.compact(report, mine)
        if sent is not report and token is not None:
            if len(self._compact_memo) >= 16:  # one entry per slot of the ring and layout: a few
                self._compact_memo.clear()
            self._compact_memo[key] = (token, mine)
        return sent

    def _split_layout(self, layout: Layout | None) -> SplitLayout | None:
        if layout is None:
            return None
        layout = rp.base_layout(layout)
        split = self._split
        if split is None or split.source is not layout:
            split = self._split = SplitLayout.of(layout)
        return split


def repeated_save_message(step: int, job_id: str, launch: str, last_restore: int | None) -> str:
    """Why a save of ``step`` is refused as a repeat within this launch's timeline, and the fix that fits:
    two saves of one step (model and optimizer apart), or a rollback that did not go through gemini_dcp."""
    head = f"step {step} was already saved by this launch ({launch}) in job {job_id!r}"
    split = ("Save model and optimizer in one state dict (dcp.save({'model': ..., 'optim': ...})), or give each its "
             "own writer with a separate job_id.")
    rollback = ("If training went back to an earlier step (a rollback), restore that step through gemini_dcp first "
                "(dcp.load(..., storage_reader=GeminiStorageReader(...)) or gemini_dcp.fast_load): the saves after "
                "it then start a new timeline and may reuse these step numbers.")
    if last_restore is not None and last_restore < step:
        return (f"{head} after its rollback to step {last_restore}, on the new timeline: a second dcp.save of the same "
                f"step would replace the first. {split}")
    since = ("this launch restored no step since" if last_restore is None else
             f"this launch's last restore was of step {last_restore}, which does not go back before step {step}")
    return (f"{head}, and {since}: a second dcp.save of the same step would replace the first. If model and optimizer "
            f"are saved in separate dcp.save calls: {split} {rollback}")


def _failed_marker(record_path: Any, fingerprint: str) -> Any:
    """The file a node leader leaves when it could not commit one save's record (its node's ranks stop waiting)."""
    return record_path.with_name(f".commit-failed-{record_path.name}-{fingerprint[:16]}")
