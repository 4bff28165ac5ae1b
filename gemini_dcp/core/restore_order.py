"""Which step to restore, and from where: a pure decision over every node's view.

Every rank reports what its node holds (:class:`NodeView`); after an
all-gather every rank runs :func:`decide` on the same input and reaches the
same answer, so ranks never split between steps or tiers (Orbax-style
collective fallback, with no extra round).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import CheckpointNotFoundError, ShardUnavailableError, StepNotFoundError

if TYPE_CHECKING:
    from .timelines import Lineage

GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class StepView:
    """One step record as a node sees it.

    Its size does not grow with the world size (``held_ranks`` counts only the ranks
    whose bytes this node holds): every rank sends one view per held step in the
    decision's all-gather, so anything per saving rank here (the record's rank → node
    map, its byte counts) would make every rank receive O(world²) bytes — ~47 MB
    per rank at 1,024 ranks. Those are fetched only to explain a failure
    (:func:`unrestorable_error`).
    """

    step: int
    fingerprint: str
    world_size: int
    held_ranks: tuple[int, ...]
    created_unix: float
    complete: bool
    # The XOR parity lanes (saving ranks) that cover the ranks this node holds (gemini_dcp.peer.parity):
    # a lane that lost one member can be rebuilt from the others. Only this node's lanes: O(g) per rank.
    parity_lanes: tuple[tuple[int, ...], ...] = ()
    # Marked unhealthy by its save's health check (gemini_dcp.health): passed over unless requested.
    unhealthy: bool = False
    # A step of a timeline a rollback abandoned, by this node's lineage (gemini_dcp.core.timelines).
    superseded: bool = False
    # The timeline it was saved on ("" before any rollback): judged against the newest lineage of all views.
    timeline: str = ""


@dataclass(frozen=True, slots=True)
class NodeView:
    """What one rank's node holds for a job (every rank of a node reports the same)."""

    rank: int
    node_id: str
    steps: tuple[StepView, ...] = ()
    other_jobs: tuple[str, ...] = ()
    root: str = ""
    # The job's lineage as this node knows it (gemini_dcp.core.timelines), as JSON ("" : the root lineage).
    lineage: str = ""


@dataclass(frozen=True, slots=True)
class Unrestorable:
    """A step (with one record fingerprint) that some saving ranks' bytes are missing from."""

    step: int
    fingerprint: str
    src: int  # a group rank whose node holds the record (it can name the lost nodes)
    missing: tuple[int, ...]  # saving ranks held by no surviving node
    parity_lost: tuple[tuple[int, ...], ...] = ()  # parity lanes that lost two members or more


# (step, fingerprint) -> (rank_nodes, rank_nbytes[, node_domains]) of that record, or None if unknown
Details = Mapping[tuple[int, str], "tuple[Any, ...] | None"]


def unrestorable_error(
    job_id: str, problems: Sequence[Unrestorable], persisted: bool, details: Details | None = None
) -> ShardUnavailableError:
    """The error for "no step can be restored", naming the lost nodes and bytes when ``details`` has them.

    ``.problems`` holds ``problems`` so that the caller can fetch the details
    (collectively: every rank reaches the same problems) and build it again.
    """
    parts: list[str] = []
    for p in problems:
        info = (details or {}).get((p.step, p.fingerprint))
        where = ""
        if info is not None:
            rank_nodes, rank_nbytes = info[0], info[1]
            domains = dict(info[2]) if len(info) > 2 else {}
            lost = sorted({rank_nodes[r] for r in p.missing if r < len(rank_nodes)})
            gib = sum(rank_nbytes[r] for r in p.missing if r < len(rank_nbytes)) / GIB
            lost_domains = sorted({domains[n] for n in lost if n in domains})
            where = f" ({gib:.3f} GiB, saved on nodes {lost}"
            where += f" in failure domain{'s' if len(lost_domains) > 1 else ''} {', '.join(map(repr, lost_domains))})" if lost_domains else ")"
        lanes = "".join(
            f"; parity group of saving ranks {list(lane)} lost ranks {[r for r in lane if r in p.missing]}: "
            "parity rebuilds one lost node per group, not two"
            for lane in p.parity_lost
        )
        parts.append(f"step {p.step}: shards of saving ranks {list(p.missing)}{where} are held by no surviving node{lanes}")
    err = ShardUnavailableError(
        f"job {job_id!r}: no step can be restored from memory"
        f"{' or the persistent tier' if persisted else ''}: " + "; ".join(parts)
        + ". Every copy of these shards was lost; configure persistent=<url> to survive this, or raise replicas."
    )
    err.problems = tuple(problems)  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True, slots=True)
class RestoreDecision:
    step: int
    fingerprint: str | None          # None: restore purely from the persistent tier
    world_size: int
    record_src: int | None           # group rank whose node has the record to broadcast
    holders: dict[int, tuple[str, ...]] = field(default_factory=dict)  # saving rank -> node ids in memory
    node_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # node id -> group ranks now
    missing_ranks: tuple[int, ...] = ()  # saving ranks held by no memory copy (served by persistent)
    use_persistent: bool = False
    # saving rank lost with its node -> the group rank that rebuilds it from XOR parity (its node is
    # then the rank's holder in ``holders``); see gemini_dcp.peer.parity.rebuild_lost
    rebuilt: dict[int, int] = field(default_factory=dict)
    # Newer steps passed over because they are unhealthy (gemini_dcp.health), newest first.
    skipped_unhealthy: tuple[int, ...] = ()


def parity_rebuild(
    missing: Sequence[int], lanes: Sequence[Sequence[int]], current_ranks: Sequence[int]
) -> tuple[dict[int, int], tuple[tuple[int, ...], ...]]:
    """Which missing saving ranks XOR parity can rebuild, and on which current rank; and the lanes
    that lost two members or more (not rebuildable). Each lost rank is rebuilt by the current rank
    of the same number when there is one (the replacement of its node), else by the lowest rank."""
    gone = set(missing)
    rebuild: dict[int, int] = {}
    broken: list[tuple[int, ...]] = []
    current = set(current_ranks)
    for lane in sorted({tuple(lane) for lane in lanes}):
        lost = [r for r in lane if r in gone]
        if len(lost) == 1 and current:
            rebuild[lost[0]] = lost[0] if lost[0] in current else min(current)
        elif len(lost) > 1:
            broken.append(lane)
    return rebuild, tuple(broken)


def _memory_candidates(views: Sequence[NodeView]) -> dict[tuple[int, str], list[tuple[NodeView, StepView]]]:
    """Every node's views of each (step, fingerprint) that some node holds a complete record of.

    An incomplete record (a planner that does not expose its metadata while the writer writes
    leaves the DCP metadata to the coordinator's ``finish``) still locates and checksums its
    node's bytes exactly as the complete one does (same fingerprint), so its node counts as a
    holder; the complete record, from another node, supplies the metadata.
    """
    out: dict[tuple[int, str], list[tuple[NodeView, StepView]]] = {}
    for v in views:
        for sv in v.steps:
            out.setdefault((sv.step, sv.fingerprint), []).append((v, sv))
    return {key: entries for key, entries in out.items() if any(sv.complete for _, sv in entries)}


def decide(
    views: Sequence[NodeView],
    requested: int | None,
    job_id: str,
    persistent_steps: Sequence[int] | None = None,
    persistent_unhealthy: Sequence[int] = (),
    persistent_timelines: Mapping[int, str] | None = None,
    lineage: Lineage | None = None,
) -> RestoreDecision:
    """Choose the newest restorable healthy step (or check ``requested``) from all nodes' views.

    A step is restorable from memory when every saving rank's bytes are held by
    at least one surviving node with the same record fingerprint; otherwise it
    is restorable if the persistent tier has the same step (memory serves what
    it has, persistent the rest). Without ``requested``, steps marked unhealthy (by any node's
    record, or ``persistent_unhealthy``) are passed over while a healthy one is restorable
    (``skipped_unhealthy`` lists them), and steps of an abandoned timeline are never chosen:
    a copy a node marks superseded, or one that ``lineage`` (the job's history,
    :func:`gemini_dcp.core.timelines.job_lineage`) does not keep, the store's steps judged by
    ``persistent_timelines`` (step -> the timeline it was saved on; absent: ``""``).
    """
    if requested is not None:
        return _decide(views, requested, job_id, persistent_steps)

    def live(step: int, timeline: str) -> bool:
        return lineage is None or lineage.live(step, timeline)

    views = [replace(v, steps=tuple(sv for sv in v.steps if not sv.superseded and live(sv.step, sv.timeline)))
             for v in views]
    if persistent_steps is not None:
        timelines = persistent_timelines or {}
        persistent_steps = [s for s in persistent_steps if live(s, timelines.get(s, ""))]
    bad = {sv.step for v in views for sv in v.steps if sv.unhealthy} | set(persistent_unhealthy)
    if bad:
        healthy_views = [_without(v, bad) for v in views]
        healthy_persisted = None if persistent_steps is None else [s for s in persistent_steps if s not in bad]
        if any(v.steps for v in healthy_views) or healthy_persisted:
            try:
                found = _decide(healthy_views, None, job_id, healthy_persisted)
            except (ShardUnavailableError, CheckpointNotFoundError):
                pass  # no healthy step can be restored: the newest restorable one, unhealthy or not
            else:
                skipped = tuple(sorted((s for s in bad if s > found.step), reverse=True))
                return replace(found, skipped_unhealthy=skipped)
    return _decide(views, None, job_id, persistent_steps)


def _without(view: NodeView, steps: set[int]) -> NodeView:
    return replace(view, steps=tuple(sv for sv in view.steps if sv.step not in steps))


def _decide(
    views: Sequence[NodeView],
    requested: int | None,
    job_id: str,
    persistent_steps: Sequence[int] | None = None,
) -> RestoreDecision:
    """:func:`decide` over the steps of ``views`` as they are (health aside)."""
    node_ranks: dict[str, list[int]] = {}
    for v in views:
        node_ranks.setdefault(v.node_id, []).append(v.rank)
    cands = _memory_candidates(views)
    persisted = set(persistent_steps or ())  # None: no persistent tier configured
    all_steps = sorted({s for s, _ in cands} | persisted, reverse=True)

    if not all_steps:
        headless = sorted({sv.step for v in views for sv in v.steps})
        if headless:
            raise ShardUnavailableError(
                f"job {job_id!r}: steps {headless} are held in memory, but no surviving node has a complete "
                "record of them: their DCP metadata was kept only by the coordinator's node (the save planner "
                "does not expose planner.metadata, so it reached the storage writer only in finish()), and that "
                "node is gone or its commit never finished. Configure persistent=<url> to survive this, or save "
                "with a planner that sets planner.metadata in create_global_plan (DefaultSavePlanner does)."
            )
        others = sorted({j for v in views for j in v.other_jobs})
        roots = sorted({v.root for v in views if v.root})
        hint = f" Jobs present there: {others}." if others else ""
        raise CheckpointNotFoundError(
            f"no committed checkpoint of job {job_id!r} in any tier (tier roots {roots}"
            f"{', persistent tier included' if persistent_steps is not None else ''}).{hint} "
            "Check job_id (default $TORCHELASTIC_RUN_ID) and root ($GEMINI_DCP_ROOT), or start from scratch."
        )
    if requested is not None and requested not in all_steps:
        raise StepNotFoundError(
            f"step {requested} of job {job_id!r} is not committed in any reachable tier; "
            f"committed steps: {sorted(all_steps)}. Load one of those, or omit checkpoint_id for the newest."
        )

    problems: list[Unrestorable] = []
    for step in ([requested] if requested is not None else all_steps):
        fps = sorted(
            ((fp, entries) for (s, fp), entries in cands.items() if s == step),
            key=lambda kv: -max(sv.created_unix for _, sv in kv[1]),
        )
        for fp, entries in fps:
            sv0 = entries[0][1]
            holders: dict[int, set[str]] = {r: set() for r in range(sv0.world_size)}
            for v, sv in entries:
                for r in sv.held_ranks:
                    if r in holders:
                        holders[r].add(v.node_id)
            missing = tuple(r for r, h in holders.items() if not h)
            src = min(v.rank for v, sv in entries if sv.complete)  # the record broadcast must carry the metadata
            rebuild, broken = parity_rebuild(missing, [ln for _, sv in entries for ln in sv.parity_lanes], [v.rank for v in views])
            node_of = {v.rank: v.node_id for v in views}
            for r, b in rebuild.items():
                holders[r].add(node_of[b])
            missing = tuple(r for r in missing if r not in rebuild)
            frozen = {r: tuple(sorted(h)) for r, h in holders.items()}
            nr = {n: tuple(rs) for n, rs in node_ranks.items()}
            if not missing:
                return RestoreDecision(step, fp, sv0.world_size, src, frozen, nr, rebuilt=rebuild)
            if step in persisted:
                return RestoreDecision(step, fp, sv0.world_size, src, frozen, nr, missing, use_persistent=True, rebuilt=rebuild)
            problems.append(Unrestorable(step, fp, src, missing, broken))
        if not fps and step in persisted:
            return RestoreDecision(step, None, 0, None, {}, {n: tuple(rs) for n, rs in node_ranks.items()}, use_persistent=True)
    raise unrestorable_error(job_id, problems, bool(persisted))
