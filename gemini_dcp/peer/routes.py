"""Where replicas go: node positions and the (sender, receiver) routes of a replication.

Pure functions over the ranks' reports (no I/O, no collectives, no torch): the
collective that broadcasts the coordinator's node order is
:func:`gemini_dcp.peer.push.node_order`; the placement itself is
:mod:`gemini_dcp.peer.placement`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from .placement import assign_positions, place, spread_over_domains

log = logging.getLogger(__name__)

__all__ = ["ItemKey", "SlotReport", "choose_order", "replication_routes", "warn_shared_domains"]

ItemKey = tuple[int, int]  # (saving rank, offset in its slot): one stored chunk


class SlotReport(Protocol):
    """What the peer tier reads of a rank's save report (the writer's per-rank report)."""

    @property
    def rank(self) -> int: ...

    @property
    def node_id(self) -> str: ...

    @property
    def slot(self) -> int:
        """The index of the slot this rank wrote the step into."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of that slot in use."""
        ...

    @property
    def wire_chunk(self) -> int:
        """Bytes per replication message of this rank (0: one message)."""
        ...

    @property
    def results(self) -> tuple[Any, ...]:
        """Its DCP write results (``storage_data`` a ShardRef), to verify a received replica."""
        ...


def choose_order(previous: Sequence[str] | None, reports: Sequence[SlotReport], window: int = 2,
                 sets_for: Callable[[int], Sequence[Sequence[int]]] | None = None, lost_at: int | None = None) -> list[str]:
    """Positions of the reporting nodes in the placement, stable for nodes in ``previous``, spread over
    the nodes' failure domains (each report's ``failure_domain``, a node's lowest rank's) so that every
    ``window`` consecutive positions (the copies of a node, a parity group) differ in domain
    (:func:`~gemini_dcp.peer.placement.spread_over_domains`; ``sets_for(N)``: the position sets one domain
    must not take, holders or parity groups, lost with ``lost_at`` members in one domain)."""
    current = list(dict.fromkeys(rep.node_id for rep in reports))
    domains: dict[str, str] = {}
    for rep in reports:
        d = getattr(rep, "failure_domain", "")
        if d:
            domains.setdefault(rep.node_id, d)
    base = assign_positions(previous, current)
    if not domains:
        return base
    return spread_over_domains(base, domains, window, sets_for(len(base)) if sets_for else None, lost_at)


def replication_routes(order: list[str], reports: Sequence[SlotReport], replicas: int, strategy: str) -> list[tuple[int, int]]:
    """(sender rank, receiver rank) pairs: each rank's slot goes to one rank of every peer node."""
    ranks_of: dict[str, list[int]] = {}
    for rep in reports:
        ranks_of.setdefault(rep.node_id, []).append(rep.rank)
    m = min(replicas, len(order))
    placement = place(len(order), m, strategy)  # type: ignore[arg-type]
    pos = {n: i for i, n in enumerate(order)}
    routes: list[tuple[int, int]] = []
    for rep in reports:
        for peer in placement.peers_of(pos[rep.node_id]):
            targets = ranks_of[order[peer]]
            routes.append((rep.rank, targets[rep.rank % len(targets)]))
    return routes


_SHARED_WARNED: set[tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]] = set()


def warn_shared_domains(order: Sequence[str], reports: Sequence[SlotReport], sets: Sequence[Sequence[str]],
                        what: str) -> None:
    """Log once per layout which node sets (each node's copies, or a parity group's members) hold two or
    more nodes of one failure domain: spreading them was impossible (too few domains, or one too large).
    Nothing when no node named a domain."""
    domains: dict[str, str] = {}
    for rep in reports:
        d = getattr(rep, "failure_domain", "")
        if d:
            domains.setdefault(rep.node_id, d)
    if not domains:
        return
    key = (tuple(order), tuple(tuple(x) for x in sets))
    if key in _SHARED_WARNED:
        return
    _SHARED_WARNED.add(key)
    shared = []
    for members in sets:
        seen: dict[str, list[str]] = {}
        for n in members:
            seen.setdefault(domains.get(n, "?"), []).append(n)
        shared += [f"{list(ns)} in domain {d!r}" for d, ns in seen.items() if len(ns) > 1]
    if shared:
        log.warning(
            "failure domains: %s share a domain (%d domain(s) for %d node(s)): losing such a domain loses every "
            "copy of them from memory (the persistent tier still holds drained steps). Spread the job over more "
            "domains, or lower %s.", "; ".join(shared), len(set(domains.values())), len(order), what)
