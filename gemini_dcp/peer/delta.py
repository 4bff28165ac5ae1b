"""Delta replication of incremental saves: send a peer only the byte runs its replica slot lacks.

With ``incremental=True`` (docs/incremental.md) the receiving node's replica slot of a rank
still holds what an earlier save of that rank sent there. Two values ride in the commit
gather (step 3, plain tuples in :class:`~gemini_dcp.commit.reports.RankReport`):

- the sender's **offer** ``(token, seq, since)``: ``token`` names the writer (a process),
  ``seq`` this save, and ``since`` = ``((base seq, runs, packed), ...)``: for each recent save
  of this writer with the same layout, the ``(offset, length)`` runs of this save's slot that
  may differ from that save's (items whose tensor changed since, per the change rule; gaps
  below :data:`MERGE_GAP` merged: those bytes are equal on both sides or padding), and the
  row deltas of sharded embedding tables, ``packed`` = ``((offset, length, row_bytes, rows),
  ...)`` with ``rows`` the int32 indices of the rows written (sent packed: one message stream
  per table, however scattered the rows; the receiver scatters them into its replica);
- the receiver's **bases** ``((src rank, slot index, token, seq), ...)``: which save of which
  writer each replica slot it will receive into holds, verified (:class:`ReplicaMemory`).

:func:`pair_runs` decides, from those two values alone, whether the pair sends runs or the
whole slot: the sender and the receiver read the same gathered reports, so they always
post matching messages. The receiver verifies the checksum of every item a received run
touches before the replica counts; the other items are the base's bytes, verified when they
arrived and not written since (the same trust the local carry gives its slot).
Pure except :class:`ReplicaMemory` (this process's receiver state).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["MERGE_GAP", "PACK_MAX_SHARE", "Packed", "ReplicaMemory", "Staging", "merge_runs", "packed_rows", "pair_runs", "row_view", "touches"]

#: Changed items closer than this are sent as one run (fewer messages; the gap bytes are equal).
MERGE_GAP = 64 << 10
#: A table whose written rows are this share of it or more is sent whole (one run: no gather on the
#: sender, no staging buffer and scatter on the receiver, which cost more than the bytes saved).
PACK_MAX_SHARE = 0.5

Runs = tuple[tuple[int, int], ...]
Packed = tuple[tuple[int, int, int, bytes], ...]  # ((item offset, item length, row bytes, int32 row indices), ...)
Offer = tuple[str, int, tuple[tuple[int, Runs, Packed], ...]]  # (token, seq, ((base seq, runs, packed), ...))
Base = tuple[int, int, str, int]  # (src rank, slot index, token, seq)


def merge_runs(spans: Sequence[tuple[int, int]], gap: int = MERGE_GAP) -> Runs:
    """``(offset, length)`` spans (ascending offsets) merged into runs across gaps below ``gap``."""
    out: list[list[int]] = []
    for off, n in spans:
        if n <= 0:
            continue
        if out and off - (out[-1][0] + out[-1][1]) < gap:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return tuple((o, n) for o, n in out)


def touches(runs: Runs, offset: int, length: int) -> bool:
    """Whether ``[offset, offset + length)`` overlaps one of ``runs`` (ascending, disjoint)."""
    i = bisect.bisect_right(runs, (offset + length - 1, 1 << 62)) - 1  # the last run starting inside or before
    return i >= 0 and runs[i][0] + runs[i][1] > offset and length > 0


def pair_runs(offer: Offer | None, bases: Sequence[Base], src: int) -> tuple[int, Runs, Packed] | None:
    """``(slot index, runs, packed)`` when the receiver (``bases``) holds a save of ``src`` that
    ``offer`` has runs against; None: the whole slot is sent. Pure: both ends compute it alike."""
    if offer is None:
        return None
    token, _seq, since = offer
    runs_by_base = {b: (runs, packed) for b, runs, packed in since}
    for b_src, idx, b_token, b_seq in bases:
        if b_src == src and b_token == token and b_seq in runs_by_base:
            runs, packed = runs_by_base[b_seq]
            return idx, runs, packed
    return None


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def row_view(flat: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """A flat uint8 tensor as ``[rows, k]`` of the widest integer word dividing a row (gathers and
    scatters of whole rows run ~2-3x faster on 8-byte words than on bytes)."""
    for dt, w in ((torch.int64, 8), (torch.int32, 4)):
        if row_bytes % w == 0 and flat.data_ptr() % w == 0:
            return flat.view(dt).view(-1, row_bytes // w)
    return flat.view(-1, row_bytes)


def packed_rows(spec: tuple[int, int, int, bytes], nbytes: int) -> tuple[int, int, int, Any]:
    """``(offset, length, row_bytes, row indices as an int64 tensor)`` of one packed table delta,
    checked against the slot's ``nbytes`` (the offer came over the wire: a bad one raises ValueError)."""
    off, length, row_bytes, raw = spec
    if row_bytes <= 0 or length <= 0 or length % row_bytes or off < 0 or off + length > nbytes or len(raw) % 4:
        raise ValueError(f"bad packed row delta (offset {off}, length {length}, row bytes {row_bytes}) "
                         f"for a slot of {nbytes} bytes")
    idx = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64) if raw else torch.empty(0, dtype=torch.int64)
    rows = length // row_bytes
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        raise ValueError(f"packed row delta names rows outside 0..{rows - 1}")
    return off, length, row_bytes, idx


class Staging:
    """Grow-only staging buffers of packed table rows, one per direction, kept across saves: a fresh
    allocation each save would page-fault its whole size (~1-2 GB/s here), more than the copy itself.
    Held memory: the largest delta sent / received so far (each under half a table: PACK_MAX_SHARE)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, role: str, at: int, n: int, total: int) -> torch.Tensor:
        """``n`` bytes at ``at`` of ``role``'s buffer, grown (8-byte aligned) to ``total`` first if needed."""
        buf = self._bufs.get(role)
        need = max(total, at + n)
        if buf is None or buf.numel() < need:
            buf = self._bufs[role] = torch.empty(_round8(need) // 8, dtype=torch.int64).view(torch.uint8)
        return buf[at : at + n]


class ReplicaMemory:
    """Receiver side: which writer's save each replica slot ``(src rank, slot index)`` holds (and the
    writer's packed-row staging buffers, both directions: :class:`Staging`).

    Set only after every item of a received replica verified; dropped before the slot is
    written again, so a failed or partial receive is never a base. Local state, no collective.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], tuple[str, int]] = {}
        self.staging = Staging()  # this writer's packed-row buffers (send and receive), kept across saves

    def bases(self, choose_slot: Callable[[int], int]) -> tuple[Base, ...]:
        """What this node would receive each known rank's next replica on top of (``choose_slot(src)``:
        the slot the next replica of ``src`` lands in)."""
        out: list[Base] = []
        for src in sorted({s for s, _ in self._held}):
            idx = choose_slot(src)
            held = self._held.get((src, idx))
            if held is not None:
                out.append((src, idx, held[0], held[1]))
        return tuple(out)

    def drop(self, src: int, idx: int) -> None:
        self._held.pop((src, idx), None)

    def note(self, src: int, idx: int, offer: Any) -> None:
        """The replica of ``src`` in slot ``idx`` verified: it holds the save ``offer`` names (None: unknown)."""
        if offer is None:
            self._held.pop((src, idx), None)
        else:
            self._held[(src, idx)] = (offer[0], offer[1])
