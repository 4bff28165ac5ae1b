"""Step 2 of the commit protocol for DCP items: copy this rank's items, checksummed, into a slot.

:class:`LocalWriter` is the DCP-specific part of a save (``GeminiStorageWriter._write_local``):
it resolves the plan's items to tensors (and pickled bytes), lays them out in a slot of the
node's tier (each item at a 64-byte aligned offset), copies them and checksums each one.

Per item, the plain way costs many Python and torch calls (resolving, ``as_bytes`` views,
argument checks, a pacer call and a fused copy call per item, a ``ShardRef`` and a
``WriteResult``), far more than the copy itself at hundreds of items. So the work that depends only on the plan is done once per (plan, slot) and kept in a
:class:`~gemini_dcp.save.copy_program._Program`: the offsets, the write results' templates, the
typed destination views in the slot, and the items grouped into blocks of at most ``block``
bytes. A save then:

1. resolves the items: with the program's FQNs in a few C-level maps when it has seen
   these items (``copy_program._resolve_known``), else item by item (DTensor shards by
   attribute, without DCP's ``to_local()`` call),
2. checks the resolved tensors against the program with C-level maps (shape, dtype,
   device, layout: any difference builds a new program); the offsets are the program's
   unless a pickled item changed size,
3. copies each group (one pacer call per group) through
   :func:`gemini_dcp.save.batch_copy.copy_group`: the extension's fused copy+CRC per item
   when it can, else one ``torch._foreach_copy_`` call and one checksum call per item over a
   ``memoryview`` of the slot (the same values as :func:`gemini_dcp.core.checksum.checksum`),
4. hands back the results as :class:`~gemini_dcp.save.copy_program.WriteResults`, built from
   the templates only if read.

Items of ``block`` bytes or more keep the fused copy+checksum (block by block, paced). Pickled
(BYTE_IO) items are ``bytes`` (their size can change from save to save; with a replay's
``ByteMemo`` an unchanged value's bytes are the last save's), copied by slice assignment into a
``memoryview`` of the slot and checksummed over the slot's bytes, one pacer call per ``block``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..commit.hooks import block_bytes
from ..commit.protocol import LocalWrite
from ..commit.slot_pool import SlotPool
from ..core.checksum import as_bytes, buffer_checksum, checksum, copy_and_checksum
from ..core.faults import fault_point
from ..health.count import copy_checksum_count, copy_group_counted, count_bytes, kind_of, kinds_of
from ..local.record_types import ShardRef
from .batch_copy import copy_group, fused_available
from .carry import CarryPlan, CarryTracker, note_plain_write
from .copy_program import (
    CPU_DEVICE,
    Group,
    Program,
    WriteResults,
    bytes_of,
    direct_lookup,
    direct_types,
    fits_room,
    get_device,
    get_dtype,
    get_fqn,
    get_index,
    get_offset,
    get_shape,
    get_type,
    getter_of,
    item_sizes,
    layout_of,
    relocated,
    resolve_known,
    resolve_tensor,
    same_items,
    same_items_sized,
    same_tensors,
)
from .device_copy import DeviceCopier
from .row_delta import RowDelta, copy_changed_rows, is_row_item, row_geometry

__all__ = ["LocalWriter", "WriteResults", "direct_lookup"]

Pacer = Callable[[int], None]

class LocalWriter:
    """One writer's local copies (step 2), with the program of its last plans kept."""

    def __init__(self, slot_pool: SlotPool, carry: CarryTracker | None = None) -> None:
        self.slot_pool = slot_pool
        self._programs: dict[int, Program] = {}  # rank -> the program of its last plan
        self.programs_built = 0
        self.carry = carry  # incremental saves: what each slot already holds (save/carry.py)
        # (the last write's carry plan, item sizes, the row deltas of its tables by item position)
        self.last_carry: tuple[CarryPlan, list[int], dict[int, RowDelta]] | None = None
        self.device_copier = DeviceCopier()  # CUDA tensors: chunked D2H into the page-locked slot
        self.count_nonfinite = True  # count each float item's NaN/Inf in the copy (nonfinite != "ignore")

    def write(self, plan: SavePlan, planner: SavePlanner, rank: int, algo: str, pace: Pacer | None) -> LocalWrite:
        """Copy ``plan``'s items into a slot of ``rank`` and checksum them (local work)."""
        flat = direct_lookup(planner)
        items = plan.items
        block = block_bytes(pace)
        prog = self._programs.get(rank)
        # The items of the last program, resolved and checked against it in a few C-level maps.
        known = resolve_known(prog, plan, flat, planner, algo, block) if prog is not None else None
        if known is None:
            entries: list[Any] = [
                bytes_of(planner, it) if it.type == WriteItemType.BYTE_IO else resolve_tensor(flat, planner, it)
                for it in items
            ]
            sizes = item_sizes(entries)
        else:
            assert prog is not None
            entries = known
            sizes = prog.sizes
            if prog.byte_pos:  # pickled values: their size may change from save to save
                sizes = list(sizes)
                for i in prog.byte_pos:
                    sizes[i] = len(entries[i])
        if known is not None and prog is not None and (sizes is prog.sizes or sizes == prog.sizes or fits_room(prog, sizes)):
            offsets, rooms, total = prog.offsets, prog.rooms, prog.total
        else:
            known = None
            byte_pos = [i for i, it in enumerate(items) if it.type == WriteItemType.BYTE_IO]
            if prog is not None and same_items_sized(prog, byte_pos, sizes):
                # The layout already recorded (compact reports match it); a pickled value that outgrew its room moves.
                offsets, rooms, total = relocated(prog, sizes)
            else:
                offsets, rooms, total = layout_of(sizes, byte_pos)
        slot_idx = self.slot_pool.choose(rank)
        slot = self.slot_pool.slot(rank, slot_idx)
        with slot.lock:
            self.slot_pool.grow(slot, total)
            if known is None and (prog is None or not self._fits(prog, plan, algo, block, entries, offsets)):
                prog = self._build(plan, items, entries, sizes, offsets, total, rank, algo, block, flat)
                prog.rooms = rooms
                self._programs[rank] = prog
            assert prog is not None
            plan_c = None
            if self.carry is not None:
                plan_c = self.carry.plan(rank, slot_idx, slot, prog, entries, prog.tensor_pos, _row_items(prog, flat, entries))
            if plan_c is None:
                note_plain_write(slot)
            skip = plan_c.carry if plan_c is not None and plan_c.any else None
            deltas: dict[int, RowDelta] = {}
            # Fused with the copy where it can; an incremental save counts every item in the slot after it.
            counts = [0] * len(entries) if self.count_nonfinite and skip is None else None
            try:
                sums = self._copy(prog, prog.dsts(slot_idx, slot.tensor), entries, sizes, slot, algo, pace,
                                  self.device_copier, skip,
                                  plan_c.rows if skip is not None and plan_c is not None else None, deltas, slot_idx,
                                  counts=counts)
                if self.count_nonfinite and counts is None:
                    counts = _count_in_slot(prog, entries, sizes, slot)
            finally:
                self.device_copier.wait()  # CUDA items: every queued device-to-host piece is in the slot
            sums = self.device_copier.resolve(sums)  # CUDA items' checksums and counts: read back once, above
            if counts is not None:
                counts = self.device_copier.resolve(counts)
            if plan_c is not None:
                assert self.carry is not None
                if skip is not None:
                    sums = [c if k else s for s, c, k in zip(sums, plan_c.sums, skip)]
                self.carry.remember(rank, slot_idx, slot, prog, plan_c, sums)
                self.last_carry = (plan_c, sizes, deltas)
        # The results are the program's templates plus checksums, and, for pickled values, this save's lengths.
        byte_spans = tuple((i, prog.offsets[i], sizes[i]) for i in prog.byte_pos)
        save_bytes = None
        if plan_c is not None:
            carried = sum(n for n, c in zip(sizes, plan_c.carry) if c)
            carried += sum(sizes[i] - rd.bytes_written for i, rd in deltas.items())
            save_bytes = (sum(sizes) - carried, carried)
        return LocalWrite(slot=slot_idx, results=WriteResults(prog, sizes, sums), nbytes=total, checksums=tuple(sums),
                          template=prog, byte_spans=byte_spans, save_bytes=save_bytes, item_bytes=sum(sizes),
                          nonfinite=_by_fqn(prog, counts))

    def delta_offer(self, rank: int, token: str, seq: int) -> tuple[Any, ...] | None:
        """The last write's offer for delta replication (``peer.delta``), as save ``seq`` of writer ``token``."""
        prog = self._programs.get(rank)
        if self.carry is None or self.last_carry is None or prog is None:
            return None
        plan_c, sizes, deltas = self.last_carry
        since = self.carry.changed_since(rank, seq, prog, plan_c, prog.offsets, sizes, deltas)
        # A forced full save (full_every) re-sends the whole slot too: what it guards against (a change
        # the rule cannot see) would otherwise stay in the replica.
        return (token, seq, () if plan_c.reason.startswith("full_every") else since)

    # ---- the program ------------------------------------------------------------------------
    @staticmethod
    def _fits(prog: Program, plan: SavePlan, algo: str, block: int, entries: list[torch.Tensor], offsets: list[int]) -> bool:
        if prog.algo != algo or prog.block != block or prog.offsets != offsets:
            return False
        return same_items(prog, plan) and same_tensors(prog, entries)

    def _build(self, plan: SavePlan, items: list[WriteItem], entries: list[torch.Tensor], sizes: list[int],
               offsets: list[int], total: int, rank: int, algo: str, block: int,
               flat: dict[str, Any] | None = None) -> Program:
        self.programs_built += 1
        templates: list[ShardRef] = []
        tensor_pos: list[int] = []
        byte_pos: list[int] = []
        single: list[int] = []
        groups: list[Group] = []
        cur: list[int] = []
        cur_bytes = 0

        def close() -> None:
            nonlocal cur, cur_bytes
            if cur:
                getter = getter_of(cur)
                assert getter is not None
                groups.append(Group(cur, getter, [(offsets[i], sizes[i]) for i in cur], [entries[i].dtype for i in cur],
                                     [entries[i].shape for i in cur], cur_bytes))
            cur, cur_bytes = [], 0

        for i, (it, t, n) in enumerate(zip(items, entries, sizes)):
            if it.type == WriteItemType.BYTE_IO:
                templates.append(ShardRef(rank, offsets[i], n, 0, algo, None, None))
                byte_pos.append(i)
                continue
            item_algo = self.device_copier.item_algo(algo) if t.is_cuda else algo  # CUDA: checksummed on the GPU
            templates.append(ShardRef(rank, offsets[i], n, 0, item_algo, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            tensor_pos.append(i)
            plain = t.device == CPU_DEVICE and t.layout is torch.strided and not t.is_quantized and n > 0
            if not plain or n >= block:
                single.append(i)
                continue
            if cur_bytes + n > block:
                close()
            cur.append(i)
            cur_bytes += n
        close()
        ts = [entries[i] for i in tensor_pos]
        getter = getter_of(tensor_pos)
        fqns = list(map(get_fqn, items))
        tensor_fqns = [fqns[i] for i in tensor_pos]
        obj_types = direct_types(flat, items, tensor_pos)
        dt_pos = [k for k, t in enumerate(obj_types or ()) if t is DTensor]
        grouped = [i for g in groups for i in g.pos]
        ranges, start = [], 0
        for g in groups:
            ranges.append((start, start + len(g.pos)))
            start += len(g.pos)
        return Program(
            tensor_fqns=tensor_fqns, obj_types=obj_types, dt_getter=getter_of(dt_pos), dt_pos=dt_pos,
            grouped=getter_of(grouped) if fused_available(algo) else None, ranges=ranges,
            plan=plan, algo=algo, block=block, offsets=offsets, sizes=sizes, total=total,
            templates=templates, indexes=list(map(get_index, items)), types=list(map(get_type, items)),
            fqns=fqns, index_offsets=list(map(get_offset, items)), tensor_pos=tensor_pos, getter=getter,
            shapes=list(map(get_shape, ts)), dtypes=list(map(get_dtype, ts)), devices=list(map(get_device, ts)), groups=groups, single=single, byte_pos=byte_pos,
        )

    # ---- the copy ---------------------------------------------------------------------------
    @staticmethod
    def _copy(prog: Program, dsts: list[list[torch.Tensor]], entries: list[torch.Tensor], sizes: list[int], slot: Any,
              algo: str, pace: Pacer | None, device_copier: DeviceCopier, skip: list[bool] | None = None,
              rows: list[int] | None = None, deltas: dict[int, RowDelta] | None = None,
              slot_idx: int | None = None, counts: list[int] | None = None) -> list[int]:
        """Copy and checksum every item, but those ``skip`` marks (already in the slot: incremental saves);
        of the tables ``rows`` marks, only the rows that differ from the slot's (their deltas into ``deltas``).
        The groups go through :func:`gemini_dcp.save.batch_copy.copy_group` (fused per item when it can).
        ``counts`` (a full copy only): each item's non-finite values, counted in the same pass."""
        if skip is not None:
            return _copy_changed(prog, dsts, entries, sizes, slot, algo, pace, skip, device_copier, rows, deltas)
        sums = [0] * len(entries)
        hasher = buffer_checksum(algo)
        view = memoryview(slot.tensor.numpy()) if prog.groups else memoryview(b"")
        src_bytes = dst_bytes = None
        if prog.grouped is not None and slot_idx is not None:
            src_bytes = prog.sources.views(list(prog.grouped(entries)))
            if src_bytes is not None:
                dst_bytes = prog.dst_bytes(slot_idx, slot.tensor)
        half = max(1, len(entries) // 2)
        done = 0
        with torch.no_grad():
            for g, g_dsts, (a, b) in zip(prog.groups, dsts, prog.ranges):
                if pace is not None:
                    pace(g.nbytes)
                if counts is not None:
                    got, got_counts = copy_group_counted(
                        g_dsts, g.getter(entries), kinds_of(g.dtypes),
                        dst_bytes=None if dst_bytes is None else dst_bytes[a:b],
                        src_bytes=None if src_bytes is None else src_bytes[a:b], slot_view=view, spans=g.spans,
                        hasher=hasher,
                    )
                    for i, c in zip(g.pos, got_counts):
                        counts[i] = c
                else:
                    got = copy_group(
                        g_dsts, g.getter(entries), dst_bytes=None if dst_bytes is None else dst_bytes[a:b],
                        src_bytes=None if src_bytes is None else src_bytes[a:b], slot_view=view, spans=g.spans,
                        hasher=hasher,
                    )
                for i, c in zip(g.pos, got):
                    sums[i] = c
                done += len(g.pos)
                if done >= half > done - len(g.pos):
                    fault_point("save.mid_copy")
            for i in prog.single:
                if counts is not None:
                    sums[i], counts[i] = _copy_one_counted(entries[i], slot, prog.offsets[i], sizes[i],
                                                           prog.templates[i].algo, prog.block, pace, device_copier)
                else:
                    sums[i] = _copy_one(entries[i], slot, prog.offsets[i], sizes[i], prog.templates[i].algo, prog.block,
                                        pace, device_copier)
                done += 1
                if done == half:
                    fault_point("save.mid_copy")
            if prog.byte_pos:
                if done < half <= done + len(prog.byte_pos):
                    fault_point("save.mid_copy")
                _copy_bytes(prog.byte_pos, entries, prog.offsets, slot, algo, prog.block, pace, sums)
        return sums


def _row_items(prog: Program, flat: dict[str, Any] | None, entries: list[torch.Tensor]) -> list[int] | None:
    """Per item: 0, or a sharded embedding table (``row_delta.is_row_item``: a ``ShardedTensor`` or a
    DTensor over torchrec's ``LocalShardsWrapper``), never carried on its version counter: 2 when it
    is written as a row delta (a plain CPU tensor copied alone: ``block`` bytes or more), 1 when it
    is copied whole (small tables, grouped). None when there is none, or no flat state dict to ask."""
    if flat is None:
        return None
    out = [0] * len(entries)
    single = set(prog.single)
    for i in prog.tensor_pos:
        if is_row_item(flat.get(prog.fqns[i])):
            out[i] = 2 if i in single and row_geometry(entries[i]) is not None else 1
    return out if any(out) else None


def _copy_changed(prog: Program, dsts: list[list[torch.Tensor]], entries: list[torch.Tensor], sizes: list[int],
                  slot: Any, algo: str, pace: Pacer | None, skip: list[bool], device_copier: DeviceCopier,
                  rows: list[int] | None = None, deltas: dict[int, RowDelta] | None = None) -> list[int]:
    """``LocalWriter._copy`` of the items ``skip`` does not mark (their checksums; 0 for the skipped);
    the tables ``rows`` marks 2 get their changed rows only (``row_delta.copy_changed_rows``)."""
    sums = [0] * len(entries)
    hasher = buffer_checksum(algo)
    view = memoryview(slot.tensor.numpy()) if prog.groups else None
    with torch.no_grad():
        for g, g_dsts in zip(prog.groups, dsts):
            todo = [j for j, i in enumerate(g.pos) if not skip[i]]
            if not todo:
                continue
            srcs = g.getter(entries)
            if pace is not None:
                pace(sum(g.spans[j][1] for j in todo))
            torch._foreach_copy_([g_dsts[j] for j in todo], [srcs[j] for j in todo])
            assert view is not None
            for j in todo:
                o, n = g.spans[j]
                sums[g.pos[j]] = hasher(view[o : o + n])
        fault_point("save.mid_copy")
        _copy_bytes([i for i in prog.byte_pos if not skip[i]], entries, prog.offsets, slot, algo, prog.block, pace, sums)
        for i in prog.single:
            if skip[i]:
                continue
            if rows is not None and rows[i] == 2:  # a table (CPU): its changed rows, checksummed like the slot
                sums[i], rd = copy_changed_rows(slot.view(prog.offsets[i], sizes[i]), entries[i], prog.templates[i].algo,
                                                pace=pace)
                if deltas is not None:
                    deltas[i] = rd
                continue
            sums[i] = _copy_one(entries[i], slot, prog.offsets[i], sizes[i], prog.templates[i].algo, prog.block, pace,
                                device_copier)
    return sums


def _copy_bytes(pos: list[int], entries: list[Any], offsets: list[int], slot: Any, algo: str, block: int,
                pace: Pacer | None, sums: list[int]) -> None:
    """Copy the pickled items at ``pos`` (``bytes``) to their offsets in ``slot`` and checksum each
    over the slot's bytes (``sums[i]``): one slice assignment and one checksum call per item, and
    one pacer call per ``block`` bytes (an optimizer's param groups: hundreds of ~1 KB values)."""
    if not pos:
        return
    view = memoryview(slot.tensor.numpy())
    hasher = buffer_checksum(algo)
    paced = 0
    if pace is not None:
        paced = sum(len(entries[i]) for i in pos)
        while paced > 0:
            pace(min(paced, block))
            paced -= block
    for i in pos:
        data = entries[i]
        o = offsets[i]
        e = o + len(data)
        view[o:e] = data
        sums[i] = hasher(view[o:e])


def _copy_one(t: torch.Tensor, slot: Any, offset: int, n: int, algo: str, block: int, pace: Pacer | None,
              device_copier: DeviceCopier) -> int:
    """Copy one item copied alone (large, not a plain CPU tensor, or pickled bytes) to ``offset``
    of ``slot``; its checksum."""
    dst = slot.view(offset, n)
    if t.is_cuda and n:  # issue 20: chunked D2H into the registered slot, paced, CRC while warm
        device_copier.ensure_registered(slot)
        # A CUDA item checksummed on the device: a Pending the write resolves after its one readback.
        return device_copier.copy(dst, t, algo, pace)  # type: ignore[return-value]
    src = as_bytes(t)
    if src is not None:
        return copy_and_checksum(dst, src, algo, block, pace=pace)
    if pace is not None and n:
        pace(n)
    dst.view(t.dtype).view(t.shape).copy_(t)
    return checksum(dst, algo)



def _copy_one_counted(t: torch.Tensor, slot: Any, offset: int, n: int, algo: str, block: int, pace: Pacer | None,
                      device_copier: DeviceCopier) -> tuple[int, int]:
    """:func:`_copy_one` plus the item's non-finite values: (checksum, count). A CPU item is counted in
    the copy's own pass (:func:`gemini_dcp.health.count.copy_checksum_count`); a CUDA item on the device."""
    kind = kind_of(t.dtype)
    if t.is_cuda and kind and n:  # counted on the device, in the checksum's kernel where it can
        device_copier.ensure_registered(slot)
        return device_copier.copy_counted(slot.view(offset, n), t, algo, kind, pace)  # type: ignore[return-value]
    if t.is_cuda or not kind:
        return _copy_one(t, slot, offset, n, algo, block, pace, device_copier), 0
    src = as_bytes(t)
    if src is None:
        value = _copy_one(t, slot, offset, n, algo, block, pace, device_copier)
        return value, count_bytes(slot.view(offset, n), kind)
    return copy_checksum_count(slot.view(offset, n), src, algo, kind, block, pace)


def _count_in_slot(prog: Program, entries: list[Any], sizes: list[int], slot: Any) -> list[int]:
    """Every float item's non-finite values, counted over its bytes in ``slot`` (a save that
    carried or row-patched items: what the slot holds for the step)."""
    counts = [0] * len(entries)
    for i in prog.tensor_pos:
        kind = kind_of(entries[i].dtype)
        if kind and sizes[i]:
            counts[i] = count_bytes(slot.view(prog.offsets[i], sizes[i]), kind)
    return counts


def _by_fqn(prog: Program, counts: list[int] | None) -> tuple[tuple[str, int], ...]:
    """``(fqn, count)`` of the items holding non-finite values (chunks of one FQN summed)."""
    if counts is None or not any(counts):
        return ()
    out: dict[str, int] = {}
    for i, c in enumerate(counts):
        if c:
            fqn = prog.fqns[i]
            out[fqn] = out.get(fqn, 0) + c
    return tuple(out.items())
