"""Incremental saves: which items a slot already holds, so a save copies only what changed.

Opt-in (``GeminiStorageWriter(incremental=True)``); docs/incremental.md has the design and
what the change rule cannot see. The mechanism is **in-slot carry**: each rank writes a step
into one slot of its ring of ``keep + 1`` slot files (:mod:`gemini_dcp.commit.slot_pool`), at
offsets fixed by the plan's program (:mod:`gemini_dcp.save.local_write`). That slot still holds
the bytes of the save that last wrote it. An item whose tensor is unchanged since *that* save,
at the same offset, needs no copy: its bytes are already where this step's record will say
they are, and its checksum is the one computed when they were written. The record stays
self-contained (one slot per rank per step), so restore, ``verify``, eviction, the peer
replica and the persistent drain read a carried item exactly like a copied one, and evicting
an old step can never drop bytes a newer step refers to.

**The change rule** (:func:`tensor_key`): an item is unchanged when its tensor has the same
storage (data pointer, kept alive: a weak reference to the storage must still resolve, so the
address cannot have been reused by another allocation), storage offset, shape, stride, dtype
and device, and the same in-place version counter (``tensor._version``) as when its bytes were
copied into this slot; and the slot, its program (layout, checksum algorithm) and the slot
file are the same objects. Anything else copies. A save in a new process (a torchrun restart)
holds no history: it copies everything.

**Row deltas** (:mod:`gemini_dcp.save.row_delta`): a sharded embedding table (``row_items``) is
never carried on the version rule (torchrec's fused optimizers update rows without bumping
it); while the slot's memory is valid its rows are compared with the slot's and only those
that differ are written (``CarryPlan.rows``), so what a save copies and sends is the rows
changed since the slot's last write.

Local work only: each rank decides for its own items; no collective.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..options.incremental import IncrementalOptions
from ..peer.delta import PACK_MAX_SHARE, Packed, Runs, merge_runs
from .row_delta import RowDelta

__all__ = ["CarryPlan", "CarryTracker", "SaveStats", "note_plain_write", "tensor_key"]

#: What identifies a tensor's bytes without reading them (see :func:`tensor_key`).
Key = tuple[Any, ...]

# Slot file path -> the stamp of the last write of it by any tracker of this process: a tracker's
# memory of a slot is valid only while its own stamp is the last (two writers of one job in one
# process share slot files; another process is kept out by the launch lock).
_LAST_WRITE: dict[str, int] = {}
_STAMPS = itertools.count(1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SaveStats:
    """One save on this rank (``writer.last_save``).

    ``bytes_written``: item bytes this rank copied into the tier for the step;
    ``bytes_carried``: item bytes the step's slot already held (referenced, not copied);
    ``full``: nothing was carried; ``reason``: why a save copied everything (or "incremental");
    ``rows_written`` / ``rows_total``: rows of sharded embedding tables written / held (row deltas);
    ``nonfinite``: ``{fqn: count}`` of this rank's items holding NaN/Inf values (empty: none, or not counted).
    """

    step: int
    bytes_written: int
    bytes_carried: int
    items_written: int
    items_carried: int
    full: bool
    reason: str
    slot: int
    rows_written: int = 0  # rows of sharded embedding tables written (row deltas)
    rows_total: int = 0  # rows of those tables in the step
    nonfinite: dict[str, int] = dataclasses.field(default_factory=dict)  # {fqn: NaN/Inf values} of items with any

    def __post_init__(self) -> None:
        if min(self.bytes_written, self.bytes_carried, self.items_written, self.items_carried, self.rows_written,
               self.rows_total) < 0:
            raise ValueError(f"SaveStats counts must be >= 0: {self!r}")

    @property
    def bytes_total(self) -> int:
        """Item bytes of the step on this rank (written + carried)."""
        return self.bytes_written + self.bytes_carried


def note_plain_write(slot: object) -> None:
    """A writer without incremental saves is about to write ``slot``: no tracker may carry from it."""
    _LAST_WRITE.pop(str(getattr(slot, "path", id(slot))), None)


def tensor_key(t: torch.Tensor) -> Key:
    """What says "these bytes are unchanged" for ``t``, without reading them.

    Storage data pointer, storage offset, shape, stride, dtype, device and the in-place version
    counter. Views share their base's counter (``detach()`` does too; ``.data`` does not).
    """
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


@dataclasses.dataclass(slots=True, eq=False)
class _SlotMemory:
    """What one slot file holds after a complete write: per item, its key, storage and checksum."""

    program: object  # the LocalWriter program that laid the slot out (compared by identity)
    slot: object  # the SlotFile written (compared by identity)
    keys: list[Key | None]  # None: not a tensor item, or not carriable
    storages: list[Any]  # weak references to the items' storages (None where keys is None)
    sums: list[int]
    stamp: int  # this write's entry in _LAST_WRITE
    wno: int  # the tracker's number of this write (CarryPlan.wno)


@dataclasses.dataclass(frozen=True, slots=True)
class CarryPlan:
    """What a save into a slot copies: ``carry[i]`` True means item i is already there with ``sums[i]``;
    ``rows[i]``: 0 for a plain item; a sharded embedding table is never carried on its key: 2 when
    it is written as its rows that differ from the slot's, 1 when it is copied whole.

    ``wno`` numbers this write among the tracker's writes of the rank; ``base`` is the number of the
    write whose bytes the slot holds (what ``rows`` are compared against; None: no valid memory).
    """

    carry: list[bool]
    sums: list[int]
    keys: list[Key | None]
    storages: list[Any]
    reason: str
    rows: list[int] = dataclasses.field(default_factory=list)
    wno: int = 0
    base: int | None = None

    @property
    def any(self) -> bool:
        return any(self.carry) or 2 in self.rows


class CarryTracker:
    """Per ``(rank, slot index)``: the items the slot holds from its last complete write.

    ``options``: :class:`IncrementalOptions`. Not thread-safe across ranks of one slot: the
    caller holds the slot's lock between :meth:`plan` and :meth:`remember`.
    """

    def __init__(self, options: IncrementalOptions, history: int = 4) -> None:
        self.options = options
        self._slots: dict[tuple[int, int], _SlotMemory] = {}
        self._since_full: dict[int, int | None] = {}  # rank -> saves since its last full save (None: none yet)
        # rank -> its last ``history`` saves: (seq, program, keys, storages), for delta replication.
        self.history = history
        self._history: dict[int, list[tuple[int, object, list[Key | None], list[Any], int]]] = {}
        self._wno = itertools.count(1)

    def plan(self, rank: int, slot_idx: int, slot: object, program: object, entries: Sequence[Any],
             tensor_pos: Sequence[int], row_items: Sequence[int] | None = None) -> CarryPlan:
        """Which of ``entries`` (the resolved items, in plan order) the slot already holds.

        ``row_items[i]`` nonzero: item i is a sharded embedding table, never carried on its key; 2: it
        is written as its changed rows (``rows[i]``) while the slot's memory is valid, 1 (or no valid
        memory): copied whole.

        Keys are read here, before any byte is copied: a change made during the copy shows
        as a new version at the next save (copied again), never the reverse. The slot's
        memory is dropped now, so a copy that fails midway leaves nothing to carry from it.
        """
        n = len(entries)
        keys: list[Key | None] = [None] * n
        storages: list[Any] = [None] * n
        for i in tensor_pos:
            t = entries[i]
            if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
                try:
                    storage = t.untyped_storage()
                    keys[i] = tensor_key(t)
                    storages[i] = weakref.ref(storage)
                except (RuntimeError, TypeError):  # no storage to speak of (a tensor subclass, meta): copied
                    keys[i] = None
        mem = self._slots.pop((rank, slot_idx), None)
        path = str(getattr(slot, "path", id(slot)))
        last = _LAST_WRITE.pop(path, None)  # from here until remember(), nobody may carry from it
        reason = self._full_reason(rank, mem, slot, program, n)
        if reason is None and mem is not None and last != mem.stamp:
            reason = "slot written by another writer"
        carry = [False] * n
        rows = [0] * n
        sums = [0] * n
        if reason is None:
            assert mem is not None
            for i in tensor_pos:
                if row_items is not None and row_items[i]:
                    rows[i] = row_items[i]
                    continue
                k = keys[i]
                if k is not None and k == mem.keys[i]:
                    ref = mem.storages[i]
                    if ref is not None and ref() is not None:
                        carry[i] = True
                        sums[i] = mem.sums[i]
            reason = "incremental"
        return CarryPlan(carry=carry, sums=sums, keys=keys, storages=storages, reason=reason, rows=rows,
                         wno=next(self._wno), base=mem.wno if reason == "incremental" and mem is not None else None)

    def remember(self, rank: int, slot_idx: int, slot: object, program: object, plan: CarryPlan,
                 sums: Sequence[int]) -> None:
        """After a complete write of the slot: what it holds now (``sums``: every item's checksum)."""
        if not self.options.enabled:
            return
        stamp = next(_STAMPS)
        _LAST_WRITE[str(getattr(slot, "path", id(slot)))] = stamp
        self._slots[(rank, slot_idx)] = _SlotMemory(
            program=program, slot=slot, keys=list(plan.keys), storages=list(plan.storages), sums=list(sums), stamp=stamp,
            wno=plan.wno,
        )
        since = self._since_full.get(rank)
        self._since_full[rank] = 0 if not plan.any else (since or 0) + 1

    def changed_since(self, rank: int, seq: int, program: object, plan: CarryPlan, offsets: Sequence[int],
                      sizes: Sequence[int], deltas: dict[int, RowDelta] | None = None,
                      ) -> tuple[tuple[int, Runs, Packed], ...]:
        """For each recent save of ``rank`` with the same ``program`` (its ``seq``), the runs of
        this save's slot (save ``seq``) that may differ from that save's, and the packed row deltas
        of its tables; then remembers this one.

        An item is unchanged since a save when its key then and now are equal and the storage
        seen then is still alive (:func:`tensor_key`); everything else is in a run. A table
        (``plan.rows``) is never unchanged on its key: against the save the slot held (``plan.base``)
        it is its changed rows (``deltas[i]``, ``(offset, length, row_bytes, int32 row indices)``),
        unless they are ``PACK_MAX_SHARE`` of it or more; against any other save the whole item.
        """
        hist = self._history.setdefault(rank, [])
        hist[:] = [h for h in hist if h[1] is program]  # another layout: no runs against it
        out: list[tuple[int, Runs, Packed]] = []
        deltas = deltas or {}
        row_pos = [i for i, r in enumerate(plan.rows) if r == 2]
        for b_seq, _prog, b_keys, b_storages, b_wno in hist:
            spans = []
            packed: list[tuple[int, int, int, bytes]] = []
            for i, k in enumerate(plan.keys):
                if plan.rows and plan.rows[i] == 2:
                    continue
                ref = b_storages[i]
                if k is None or k != b_keys[i] or ref is None or ref() is None or (plan.rows and plan.rows[i]):
                    spans.append((offsets[i], sizes[i]))
            for i in row_pos:
                rd = deltas.get(i)
                if b_wno == plan.base and rd is not None and rd[1] < 2**31 and rd.bytes_written < PACK_MAX_SHARE * sizes[i]:
                    if rd.changed.numel():
                        packed.append((offsets[i], sizes[i], rd.row_bytes, rd.changed.to(torch.int32).numpy().tobytes()))
                else:
                    spans.append((offsets[i], sizes[i]))
            out.append((b_seq, merge_runs(sorted(spans)), tuple(packed)))
        hist.append((seq, program, list(plan.keys), list(plan.storages), plan.wno))
        del hist[: -self.history]
        return tuple(out)

    def forget(self) -> None:
        """Drop every slot's memory: the next save of each slot copies everything."""
        self._slots.clear()
        self._since_full.clear()
        self._history.clear()

    def _full_reason(self, rank: int, mem: _SlotMemory | None, slot: object, program: object, n: int) -> str | None:
        opts = self.options
        if not opts.enabled:
            return "incremental=False"
        since = self._since_full.get(rank)
        if since is None:
            return "first save of this writer"
        if opts.full_every is not None and since + 1 >= opts.full_every:
            return f"full_every={opts.full_every}"
        if mem is None:
            return "first write of this slot"
        if mem.program is not program or len(mem.keys) != n:
            return "structure changed"
        if mem.slot is not slot:
            return "slot file reopened"
        return None
