"""Uploading a lost node's part of a drained step from the replicas its peers hold.

Each node drains its own ranks' bytes to the persistent tier (``gemini_dcp.persistent.drain``);
a step is complete in the store once every node's part is there. A node that dies
before its part is written would leave that step incomplete for good, although its
peers hold replicas of exactly those bytes in memory. The restore after the failure
is where the job learns which nodes lost their memory: every rank has every node's
view (``restore_plan.NodeView``). From those views alone (no extra collective, no
store access on the restore path), each surviving node leader works out which lost
ranks it should upload (:func:`orphaned_part`: the lowest node id among the holders
of each rank, so exactly one node adopts each rank) and hands them to a drain server
of its own (``persist/adopt/``); the server checks the store first and uploads only
what no part marker covers yet, under file names of its own, then writes a part
marker and commits the step if it completes the set.

Only the newest step due for the persistent tier is adopted: an older one would be
dropped by the store's retention once the newer one completes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ..core.restore_order import NodeView
from .drain.client import ensure_server, write_request
from .drain.paths import Paths
from .drain.request import SlotRef
from .drain.status import read_config

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Adoption:
    """Saving ranks of one step that this node uploads in place of nodes that lost them."""

    step: int
    fingerprint: str
    lost_nodes: tuple[str, ...]  # the origin nodes whose memory no longer holds the step
    ranks: tuple[int, ...]       # the lost nodes' ranks this node adopts (it holds their replicas)


def orphaned_part(views: Sequence[NodeView], node_id: str, step: int, fingerprint: str, rank_nodes: Sequence[str]) -> Adoption | None:
    """Pure: which ranks of the save (``step``, ``fingerprint``) ``node_id`` should upload for lost nodes.

    A saving rank's origin node (``rank_nodes[rank]``) is lost when no view holds the
    save (a replaced machine with the same node id holds nothing; a node gone from
    the job has no view). Each lost rank is adopted by the lowest node id among the
    nodes whose view holds its bytes; every rank computes the same from the same views.
    Returns None when this node adopts nothing.
    """
    holders: dict[int, list[str]] = {}
    alive: set[str] = set()
    for v in views:
        for sv in v.steps:
            if sv.step == step and sv.fingerprint == fingerprint:
                alive.add(v.node_id)
                for r in sv.held_ranks:
                    holders.setdefault(r, []).append(v.node_id)
    lost = sorted({n for n in rank_nodes if n not in alive})
    if not lost:
        return None
    ranks = tuple(
        r for r, origin in enumerate(rank_nodes) if origin in lost and holders.get(r) and min(holders[r]) == node_id
    )
    if not ranks:
        return None
    adopted_from = tuple(sorted({rank_nodes[r] for r in ranks}))
    return Adoption(step, fingerprint, adopted_from, ranks)


def adopt_lost_parts(tier: Any, views: Sequence[NodeView], rank: int) -> Adoption | None:
    """After a restore decision: request the upload of the lost nodes' part this node adopts.

    Not collective (every rank already has ``views``); only the node leader (the lowest
    group rank on its node) acts, and only if a writer with a persistent tier left its
    drain settings on this node (they include its drain options, which the adopting
    server runs with). Returns what was requested, or None.
    """
    mine = next((v for v in views if v.rank == rank), None)
    if mine is None or rank != min(v.rank for v in views if v.node_id == mine.node_id):
        return None
    cfg = read_config(tier.layout.persist_dir)
    if cfg is None or cfg.store.job_id != tier.job_id:
        return None
    if cfg.protocol == "memory":
        return None  # a memory:// store lives and dies with its process: nothing of the old one is left to complete
    every = cfg.every
    due = sorted({sv.step for sv in mine.steps if sv.step % every == 0}, reverse=True)
    if not due:
        return None
    record = tier.record(due[0])
    if record is None:
        return None
    adoption = orphaned_part(views, mine.node_id, record.step, record.fingerprint(), record.rank_nodes)
    if adoption is None:
        return None
    p = Paths(tier.layout.persist_dir).adopt
    if record.step not in p.pending():  # else requested by an earlier restore of this generation: resume it
        slots = []
        for r in adoption.ranks:
            s = record.slot_of(r)
            if s is None:
                log.warning("step %d: rank %d is in this node's view but its slot is missing; not adopted", record.step, r)
                continue
            slots.append(SlotRef(rank=r, path=str(tier.slot_path(s.rank, s.slot)), nbytes=int(s.nbytes)))
        if not slots:
            return None
        write_request(p, tier, record, tuple(slots), cfg.store, rank0_node=False, adopted_from=adoption.lost_nodes)
        log.warning(
            "step %d: nodes %s lost their memory before their part reached %s; this node uploads their ranks %s "
            "from its replicas", record.step, list(adoption.lost_nodes), cfg.store.url, list(adoption.ranks),
        )
    ensure_server(p.dir, cfg.mode, options=cfg.drain)  # the writer's validated drain options
    return adoption


__all__ = ["Adoption", "orphaned_part", "adopt_lost_parts"]
