"""Operator views of the tiers: what is held here, is it intact, what can be evicted, is the host ready.

The ``gemini-dcp`` command line tool is a thin layer over these functions; they
return plain dataclasses (``.to_dict()`` gives JSON-ready dicts) and raise
:class:`~gemini_dcp.errors.GeminiError` subclasses with messages that say what
to do. Everything here reads one tier root, the one of *this* node: to see a
whole job, run them on every node (or point ``root`` at each simulated node's
root).

- :func:`inspect_root` (this module) — jobs, steps, sizes, ranks and nodes, replica placement,
  age, and whether each step is restorable from what is visible here.
- :func:`verify` (:mod:`gemini_dcp.ops.verify`) — recompute the checksum of every shard held here (and, given a
  persistent URL, of every item stored there).
- :func:`collect_garbage` (:mod:`gemini_dcp.ops.housekeeping`) — evict old steps (never the newest committed one) and
  free slot files no record uses and no process has open.
- :func:`remove_job` (:mod:`gemini_dcp.ops.housekeeping`) — delete a finished job's memory.
- :func:`doctor` (:mod:`gemini_dcp.ops.doctor`) — environment checks with a pass / warn / fail per line.
- :func:`plan` (:mod:`gemini_dcp.ops.sizing`) — placement table, recovery probabilities and GEMINI's
  wasted-time model (over :mod:`gemini_dcp.peer.placement` and :mod:`gemini_dcp.ops.costmodel`).

All of them are importable from here, the operator API's one entry point.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..core.config import resolve_node_id
from ..errors import GeminiError, TierRootError
from ..local.job_dir import JobLayout, list_jobs
from ..local.job_files import (
    check_job_dirs,
    job_usage_bytes,
    open_job,
    open_root,
    rank_extent,
    read_record_or_reason,
    slot_size,
)
from ..local.record_types import StepRecord
from ..persistent.drain.status import drain_summary, step_states
from .doctor import (
    Check,
    DoctorReport,
    doctor,
    in_container,
    mount_entry,
    mount_of,
    mount_options,
    shm_fix,
    tmpfs_huge_pages,
)
from .housekeeping import GcReport, RemoveReport, collect_garbage, processes_using, remove_job
from .parity_view import parity_info
from .sizing import plan
from .verify import ItemCheck, VerifyReport, verify

__all__ = [
    "StepInfo", "JobInfo", "RootInfo", "inspect_root", "inspect_job", "job_usage_bytes", "open_root", "open_job",
    "verify", "VerifyReport", "ItemCheck",
    "collect_garbage", "GcReport", "remove_job", "RemoveReport", "processes_using",
    "doctor", "DoctorReport", "Check", "mount_entry", "mount_of", "mount_options", "tmpfs_huge_pages",
    "in_container", "shm_fix",
    "plan",
]


@dataclass
class StepInfo:
    step: int
    committed: bool                      # a complete record (metadata of the whole save) is here
    in_memory: bool                      # a record of this step is in this root
    in_persistent: bool | None           # None: no persistent tier given
    world_size: int | None = None
    total_bytes: int | None = None       # bytes of the whole save (all ranks)
    bytes_here: int = 0                  # bytes of it held in this root
    local_ranks: list[int] = field(default_factory=list)   # saved by this node, held here
    peer_ranks: list[int] = field(default_factory=list)    # replicas of other nodes' ranks held here
    nodes: list[str] = field(default_factory=list)         # saving nodes, in rank order of first rank
    rank_nodes: list[str] = field(default_factory=list)
    holders: dict[str, list[str]] = field(default_factory=dict)  # origin node -> nodes with a copy
    domains: dict[str, str] = field(default_factory=dict)  # node -> its failure domain (those that named one)
    replicas: int | None = None
    placement: str | None = None
    node_id: str | None = None            # the node that wrote this record
    created_unix: float | None = None
    age_s: float | None = None
    restorable: str = "no"                # "memory" | "memory+persistent" | "persistent" | "no"
    missing_ranks: list[int] = field(default_factory=list)
    problem: str | None = None
    drain: str | None = None              # this node's drain of the step: queued | writing | durable | failed
    drain_reason: str | None = None       # why it failed (or is retrying)
    parity: dict[str, Any] | None = None  # XOR parity: groups, lanes, this node's parity slots (ops/parity_view)
    # Item bytes each rank copied into the tier for this step, and those its slot already held
    # (incremental saves, docs/incremental.md; a save that copied everything carries 0).
    bytes_written: int | None = None
    bytes_carried: int | None = None
    rank_bytes_written: list[int] = field(default_factory=list)
    rank_bytes_carried: list[int] = field(default_factory=list)
    # The save's health check (gemini_dcp.health): "healthy" | "unhealthy" | "unchecked"; and
    # [rank, fqn, count] of every item holding NaN/Inf values.
    health: str = "unchecked"
    nonfinite: list[list[Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class JobInfo:
    job_id: str
    path: str
    usage_bytes: int
    steps: list[StepInfo]
    persistent_error: str | None = None
    drain: dict[str, Any] | None = None  # this node's drain to the persistent tier (drain.drain_summary)
    problem: str | None = None  # why the job's files were not read (not ours, a link: see docs/security.md)

    @property
    def newest_restorable(self) -> int | None:
        ok = [s.step for s in self.steps if s.restorable != "no"]
        return max(ok) if ok else None

    @property
    def newest_healthy(self) -> int | None:
        """The step a restore picks by default: the newest restorable one not marked unhealthy."""
        ok = [s.step for s in self.steps if s.restorable != "no" and s.health != "unhealthy"]
        return max(ok) if ok else None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "steps"}
        d["newest_restorable"] = self.newest_restorable
        d["newest_healthy"] = self.newest_healthy
        d["steps"] = [s.to_dict() for s in self.steps]
        return d


@dataclass
class RootInfo:
    root: str
    node_id: str
    persistent: str | None
    jobs: list[JobInfo]

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "node_id": self.node_id, "persistent": self.persistent,
                "jobs": [j.to_dict() for j in self.jobs]}


def _step_info(layout: JobLayout, step: int, persisted: set[int] | None, now: float) -> StepInfo:
    rec, problem = read_record_or_reason(layout, step)
    info = StepInfo(step=step, committed=False, in_memory=True,
                    in_persistent=None if persisted is None else step in persisted)
    if rec is None:
        info.problem = problem
        info.restorable = "persistent" if info.in_persistent else "no"
        return info
    info.committed = rec.complete
    info.world_size = rec.world_size
    info.total_bytes = rec.total_bytes
    info.nodes = list(rec.nodes)
    info.rank_nodes = list(rec.rank_nodes)
    info.holders = {k: list(v) for k, v in rec.holders.items()}
    info.domains = dict(rec.node_domains)
    info.replicas = rec.replicas
    info.placement = rec.placement
    info.node_id = rec.node_id
    info.created_unix = rec.created_unix
    info.age_s = max(0.0, now - rec.created_unix)
    info.parity = parity_info(layout, rec)
    _save_bytes(info, rec)
    healthy = getattr(rec, "healthy", None)
    info.health = "unchecked" if healthy is None else ("healthy" if healthy else "unhealthy")
    info.nonfinite = [list(c) for c in getattr(rec, "nonfinite", ())]
    extent = rank_extent(rec)
    present: set[int] = set()
    short: list[str] = []
    for s in rec.slots:
        size = slot_size(layout, s.rank, s.slot)
        if size is None:
            short.append(f"slot file of rank {s.rank} (slot {s.slot}) is missing")
            continue
        if size < extent.get(s.rank, 0):
            short.append(f"slot file of rank {s.rank} (slot {s.slot}) is shorter than its items")
            continue
        present.add(s.rank)
        info.bytes_here += s.nbytes
        if 0 <= s.rank < len(rec.rank_nodes) and rec.rank_nodes[s.rank] == rec.node_id:
            info.local_ranks.append(s.rank)
        else:
            info.peer_ranks.append(s.rank)
    info.local_ranks.sort()
    info.peer_ranks.sort()
    info.missing_ranks = [r for r in range(rec.world_size) if r not in present]
    if not rec.complete:
        info.problem = (
            "record without the DCP metadata: the commit did not finish, or the save planner does not expose "
            "planner.metadata and only the coordinator's node holds it (restorable together with that node)"
        )
        info.restorable = "persistent" if info.in_persistent else "no"
        return info
    if not info.missing_ranks:
        info.restorable = "memory"
    elif info.in_persistent:
        info.restorable = "memory+persistent"
    else:
        info.restorable = "no"
        lost = sorted({rec.rank_nodes[r] for r in info.missing_ranks if r < len(rec.rank_nodes)})
        info.problem = (
            f"ranks {info.missing_ranks} are not held here (saved on {lost}); restorable only together "
            "with the nodes holding them"
        )
    if short:
        info.problem = "; ".join(short) + (f"; {info.problem}" if info.problem else "")
    return info


def _save_bytes(info: StepInfo, rec: StepRecord) -> None:
    """Written / carried bytes per rank, from the record (a record without them: every item copied)."""
    pairs = list(getattr(rec, "rank_save_bytes", ()) or ())
    if len(pairs) != rec.world_size:
        pairs = [(n, 0) for n in rec.rank_nbytes]
    info.rank_bytes_written = [int(w) for w, _ in pairs]
    info.rank_bytes_carried = [int(c) for _, c in pairs]
    info.bytes_written = sum(info.rank_bytes_written)
    info.bytes_carried = sum(info.rank_bytes_carried)


def _persistent_steps(url: str | None, job_id: str) -> tuple[set[int] | None, str | None]:
    if url is None:
        return None, None
    from ..persistent.store import PersistentTier  # noqa: PLC0415 - optional tier

    try:
        return set(PersistentTier(url, job_id).committed_steps()), None
    except GeminiError as exc:
        return set(), str(exc)


def _attach_drain_states(infos: list[StepInfo], layout: JobLayout) -> None:
    """Each step's drain on this node (queued, writing, durable, failed + why), where one ran."""
    states = step_states(layout.persist_dir)
    for info in infos:
        st = states.get(info.step)
        if st is None:
            continue
        info.drain = st.state
        if st.state == "failed" and st.retrying:
            info.drain_reason = f"retrying after: {st.reason}"
        else:
            info.drain_reason = st.reason if st.state in ("failed", "writing") else None


def inspect_job(layout: JobLayout, persistent: str | None = None, *, now: float | None = None) -> JobInfo:
    """What ``layout``'s job holds here; a job whose directories are not ours is reported, not read."""
    now = time.time() if now is None else now
    try:
        check_job_dirs(layout)
    except TierRootError as exc:
        return JobInfo(job_id=layout.job_id, path=str(layout.job_dir), usage_bytes=0, steps=[], problem=str(exc))
    persisted, perr = _persistent_steps(persistent, layout.job_id)
    steps = layout.record_steps()
    infos = [_step_info(layout, s, persisted, now) for s in steps]
    for s in sorted((persisted or set()) - set(steps)):
        infos.append(StepInfo(step=s, committed=True, in_memory=False, in_persistent=True, restorable="persistent"))
    infos.sort(key=lambda i: i.step)
    _attach_drain_states(infos, layout)
    return JobInfo(job_id=layout.job_id, path=str(layout.job_dir), usage_bytes=job_usage_bytes(layout),
                   steps=infos, persistent_error=perr, drain=drain_summary(layout.persist_dir))


def inspect_root(
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    persistent: str | None = None,
) -> RootInfo:
    """Every job in ``root`` (or only ``job_id``), with what is held here and what is restorable.

    ``persistent``: fsspec URL of the persistent tier, to count its committed steps too.
    Raises TierRootError (no root) or CheckpointNotFoundError (``job_id`` has nothing here).
    """
    path = open_root(root)
    if job_id is not None:
        layouts = [open_job(path, job_id)]
    else:
        layouts = [JobLayout(path, j) for j in list_jobs(path)]
    now = time.time()
    jobs = [inspect_job(lay, persistent, now=now) for lay in layouts]
    return RootInfo(root=str(path), node_id=resolve_node_id(path), persistent=persistent, jobs=jobs)
