"""Where replicas go: node positions and the (sender, receiver) routes of a replication.

Pure functions over the ranks' reports (no I/O, no collectives, no torch): the
collective that broadcasts the coordinator's node order is
:func:`gemini_dcp.peer.push.node_order`; the placement itself is
:mod:`gemini_dcp.peer.placement`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .placement import assign_positions, place

__all__ = ["ItemKey", "SlotReport", "choose_order", "replication_routes"]

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


def choose_order(previous: Sequence[str] | None, reports: Sequence[SlotReport]) -> list[str]:
    """Positions of the reporting nodes in the placement, stable for nodes in ``previous``."""
    current = list(dict.fromkeys(rep.node_id for rep in reports))
    return assign_positions(previous, current)


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
