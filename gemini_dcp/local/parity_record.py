"""The parity part of a step record, and where parity slots live on a node.

A step saved with ``parity_group=g`` (:mod:`gemini_dcp.peer.parity`) records, in the global
part of its :class:`~gemini_dcp.local.record_types.StepRecord`, one :class:`ParityLayout`:
the groups of nodes, the lanes of ranks, each lane's stripe size and each rank's parity
length and checksum. Rank ``r``'s parity of a step lives on ``r``'s node in
``ranks/rank-<r>/parity-<slot>.bin``, ``<slot>`` being the index of the data slot that holds
``r``'s bytes of that step (so the parity ring turns with the data ring, and a record that
names a data slot names its parity slot too). Read back from a tier root, it is untrusted:
the parity's checksum is verified before a byte of it is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ParityLayout", "parity_path", "rebuilt_path"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParityLayout:
    """Where a step's XOR parity is and what it must hash to (the same on every node).

    ``group``: the ``parity_group`` asked for; ``groups``: node ids per group; ``lanes``: saving
    ranks per lane (one per node of a group; see :mod:`gemini_dcp.peer.parity_groups`);
    ``stripes``: bytes per stripe of each lane; ``parity_nbytes``/``checksums``: per saving rank
    (0 bytes: no parity); ``algo``: the checksum algorithm.
    """

    group: int
    groups: tuple[tuple[str, ...], ...]
    lanes: tuple[tuple[int, ...], ...]
    stripes: tuple[int, ...]
    parity_nbytes: tuple[int, ...]
    checksums: tuple[int, ...]
    algo: str

    def __post_init__(self) -> None:
        if self.group < 2:
            raise ValueError(f"ParityLayout.group must be >= 2, got {self.group}")
        if len(self.stripes) != len(self.lanes):
            raise ValueError("ParityLayout: one stripe size per lane")
        if len(self.parity_nbytes) != len(self.checksums):
            raise ValueError("ParityLayout: one parity length and one checksum per saving rank")

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Plain values only (ints, strs, tuples): decoded through the restricted unpickler.
        return (_rebuild_parity, (self.group, self.groups, self.lanes, self.stripes, self.parity_nbytes,
                                  self.checksums, self.algo))

    def lane_index(self, rank: int) -> int | None:
        """The lane holding saving rank ``rank`` (None: no parity covers it)."""
        for i, lane in enumerate(self.lanes):
            if rank in lane:
                return i
        return None

    @property
    def total_parity_bytes(self) -> int:
        return sum(self.parity_nbytes)


def _rebuild_parity(
    group: int, groups: tuple[tuple[str, ...], ...], lanes: tuple[tuple[int, ...], ...], stripes: tuple[int, ...],
    parity_nbytes: tuple[int, ...], checksums: tuple[int, ...], algo: str,
) -> ParityLayout:
    """Unpickle a :class:`ParityLayout` (validated like a new one)."""
    return ParityLayout(group=group, groups=groups, lanes=lanes, stripes=stripes, parity_nbytes=parity_nbytes,
                        checksums=checksums, algo=algo)


def parity_path(rank_dir: Path, slot: int) -> Path:
    """The parity file of a rank's data slot ``slot`` (in that rank's directory)."""
    return rank_dir / f"parity-{slot}.bin"


def rebuilt_path(rank_dir: Path, step: int) -> Path:
    """Where a restore lands a rank's slot rebuilt from parity (removed after the load)."""
    return rank_dir / f"rebuilt-from-parity-{step}.bin"
