"""Step 2 of the commit protocol for DCP items: copy this rank's items, checksummed, into a slot.

:class:`LocalWriter` is the DCP-specific part of a save (``GeminiStorageWriter._write_local``):
it resolves the plan's items to tensors (and pickled bytes), lays them out in a slot of the
node's tier (each item at a 64-byte aligned offset), copies them and checksums each one.

Per item, the plain way costs many Python and torch calls (resolving, ``as_bytes`` views,
argument checks, a pacer call and a fused copy call per item, a ``ShardRef`` and a
``WriteResult``), far more than the copy itself at hundreds of items. So the work that depends
only on the plan is done once per (plan, slot) and kept in a :class:`Program`, one per rank: the
offsets, the write results' templates, the typed destination views in the slot, and the items
grouped into blocks of at most ``block`` bytes. A save then:

1. resolves the items: with the program's FQNs in a few C-level maps when it has seen
   these items (:func:`resolve_known`: the objects of the flattened state dict, the DTensors'
   local tensors and specs), else item by item (:func:`resolve_tensor`: DTensor shards by
   attribute, without DCP's ``to_local()`` call),
2. checks the resolved tensors against the program with C-level maps (shape, dtype,
   device, layout: any difference builds a new program); the offsets are the program's
   unless a pickled item changed size,
3. copies each group (one pacer call per group) with :func:`copy_group` (:func:`copy_group_counted`
   when the save counts non-finite values),
4. hands back the results as :class:`WriteResults`, built from the templates only if read
   (a compact commit report never reads them).

The grouped copy of small CPU items is cheap at hundreds or thousands of items:

* **fused** (``crc32c`` with the C++ extension loaded): each item is copied and CRC'd in one
  pass, the whole group in one call of the extension's ``copy_crc32c_count_many`` (one thread,
  the GIL released once; a large group with streaming stores), cheaper than
  ``torch._foreach_copy_`` followed by one ``crc32c``-package call per item over the slot
  (figures: docs/benchmarks.md). The op takes flat ``uint8`` views of source and destination;
  making a source view costs more than copying a small item, so :class:`SourceViews` makes them
  once and keeps them while the sources stay where they are (checked every save: their data
  pointers with one C-level map, and their contiguity). Views are kept only once the pointers
  were seen unchanged by two saves in a row: a state dict made of fresh tensors at every save
  (a copy per step) takes the other way and holds nothing of them.
* otherwise: one ``torch._foreach_copy_`` per group, then one checksum call per item over a
  ``memoryview`` of the slot (``crc32c`` package or ``xxhash``).

Both give, for each item, the checksum :func:`gemini_dcp.core.checksum.checksum` gives for its
bytes in the slot.

Items of ``block`` bytes or more keep the fused copy+checksum (block by block, paced); CUDA
items go through :mod:`gemini_dcp.save.device_copy`. Pickled (BYTE_IO) items are ``bytes``
(their size can change from save to save; with a replay's ``ByteMemo`` an unchanged value's
bytes are the last save's), copied by slice assignment into a ``memoryview`` of the slot and
checksummed over the slot's bytes, one pacer call per ``block``.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from ..commit.hooks import block_bytes
from ..commit.protocol import LocalWrite
from ..commit.slot_pool import SlotPool
from ..core.checksum import as_bytes, buffer_checksum, checksum, copy_and_checksum
from ..core.faults import fault_point
from ..ext import loader as ext_loader
from ..health.count import EXT_KINDS, copy_checksum_count, count_bytes, count_nonfinite, kind_of, kinds_of
from ..local.record_types import ShardRef
from ..local.slots import align
from .carry import CarryPlan, CarryTracker, note_plain_write
from .device_copy import DeviceCopier
from .row_delta import RowDelta, copy_changed_rows, row_items

__all__ = ["LocalWriter", "Program", "SourceViews", "WriteResults", "copy_group", "direct_lookup", "fused_available"]

Pacer = Callable[[int], None]


# ---- the grouped copy of small items -------------------------------------------------------

_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous


def fused_available(algo: str) -> bool:
    """Whether the grouped copy of ``algo`` runs fused (copy + CRC in one pass per item)."""
    return algo == "crc32c" and ext_loader.load()


class SourceViews:
    """The flat ``uint8`` views of one program's grouped source tensors, kept while they stay put.

    ``views(srcs)``: the views of ``srcs`` (one list over every group, in group order), or None
    when they cannot be used for this save (first sight of these pointers, or a source not
    contiguous): the caller then copies with ``_foreach_copy_``. The shapes and dtypes of
    ``srcs`` are the program's (checked by the caller), so a source at the same address with
    the same contiguous layout has exactly the bytes its kept view reads: the kept view holds
    its storage alive, so no other storage can have been put at that address since.
    """

    __slots__ = ("_ptrs", "_views")

    def __init__(self) -> None:
        self._ptrs: list[int] | None = None
        self._views: list[torch.Tensor] | None = None

    def views(self, srcs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        ptrs = list(map(_data_ptr, srcs))
        if ptrs != self._ptrs or not all(map(_is_contiguous, srcs)):
            self._ptrs, self._views = ptrs, None  # moved, or first sight: nothing kept
            return None
        if self._views is None:  # the second save in a row with the sources in place
            self._views = [t.reshape(-1).view(torch.uint8) for t in srcs]
        return self._views

    def drop(self) -> None:
        """Forget the views (and the storages they hold)."""
        self._ptrs = self._views = None


def copy_group(
    dsts: list[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    *,
    dst_bytes: list[torch.Tensor] | None,
    src_bytes: list[torch.Tensor] | None,
    slot_view: memoryview,
    spans: list[tuple[int, int]],
    hasher: Callable[[Any], int],
) -> list[int]:
    """Copy one group's ``srcs`` into their slot views ``dsts`` and return each item's checksum.

    Fused when both byte-view lists are given and the extension loads: the extension's
    ``copy_crc32c_count_many`` over the whole group in one call (one thread, the GIL released
    once; a large group written with streaming stores whatever its items' sizes), called as the op
    itself, which checks each pair (1-D contiguous ``uint8`` CPU tensors of equal size, not
    overlapping) and raises RuntimeError otherwise. One call per item cost ~4 us each in the
    dispatcher and the GIL, more than copying a small item, and wrote small items through the cache.
    Else one ``torch._foreach_copy_`` and ``hasher`` over each item's ``(offset, length)`` span of
    ``slot_view``.
    """
    return copy_group_counted(dsts, srcs, _zeros(len(dsts)), dst_bytes=dst_bytes, src_bytes=src_bytes,
                              slot_view=slot_view, spans=spans, hasher=hasher)[0]


_ZEROS = [0] * 4096


def _zeros(n: int) -> list[int]:
    return _ZEROS[:n] if n <= len(_ZEROS) else [0] * n


def copy_group_counted(
    dsts: list[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    kinds: list[int],
    *,
    dst_bytes: list[torch.Tensor] | None,
    src_bytes: list[torch.Tensor] | None,
    slot_view: memoryview,
    spans: list[tuple[int, int]],
    hasher: Callable[[Any], int],
) -> tuple[list[int], list[int]]:
    """:func:`copy_group` that also counts each item's non-finite values:
    (checksums, counts). Fused (``copy_crc32c_count_many``, one call for the group) when both
    byte-view lists are given and the extension loads; else one ``torch._foreach_copy_``,
    ``hasher`` and a count per item."""
    if dst_bytes is not None and src_bytes is not None and ext_loader.load():
        if not dst_bytes:
            return [], []
        if max(kinds) <= EXT_KINDS:
            return torch.ops.gemini_dcp.copy_crc32c_count_many(dst_bytes, src_bytes, kinds)
        # float8 items: copied and checksummed in the fused call, then counted by their bit test
        sums, counts = torch.ops.gemini_dcp.copy_crc32c_count_many(
            dst_bytes, src_bytes, [k if k <= EXT_KINDS else 0 for k in kinds])
        counts = list(counts)
        for j, k in enumerate(kinds):
            if k > EXT_KINDS:
                counts[j] = count_bytes(dst_bytes[j], k)
        return sums, counts
    torch._foreach_copy_(dsts, list(srcs))
    sums = [hasher(slot_view[o : o + n]) for o, n in spans]
    counts = [0] * len(dsts)
    for j, (k, d) in enumerate(zip(kinds, dsts)):
        if k:
            counts[j] = count_bytes(d.reshape(-1).view(torch.uint8), k)
    return sums, counts


# ---- the program of a plan: what a save of the same items does, computed once, and the cheap
# ---- per-save resolution of the items against it ------------------------------------------

get_shape = operator.attrgetter("shape")
get_dtype = operator.attrgetter("dtype")
get_device = operator.attrgetter("device")
_layout = operator.attrgetter("layout")
get_index = operator.attrgetter("index")
get_type = operator.attrgetter("type")
get_fqn = operator.attrgetter("index.fqn")
get_offset = operator.attrgetter("index.offset")
_local_tensor = operator.attrgetter("_local_tensor")
_spec = operator.attrgetter("_spec")
_PLAIN = {torch.Tensor}
CPU_DEVICE = torch.device("cpu")


def direct_lookup(planner: SavePlanner) -> dict[str, Any] | None:
    """The planner's flattened state dict when its items may be resolved without it: a
    ``DefaultSavePlanner`` whose ``resolve_data`` is DCP's, whose ``transform_object`` is DCP's or
    declared DCP's for tensors (``direct_transform = True``: byte items still go through it), and whose
    ``lookup_object`` is DCP's or declared equivalent (``direct_lookup = True``); else None."""
    cls = type(planner)
    if not isinstance(planner, DefaultSavePlanner):
        return None
    if cls.resolve_data is not DefaultSavePlanner.resolve_data:  # type: ignore[attr-defined]
        return None
    if cls.transform_object is not DefaultSavePlanner.transform_object and not getattr(cls, "direct_transform", False):  # type: ignore[attr-defined]
        return None
    if cls.lookup_object is not DefaultSavePlanner.lookup_object and not getattr(cls, "direct_lookup", False):  # type: ignore[attr-defined]
        return None
    sd = getattr(planner, "state_dict", None)
    return sd if isinstance(sd, dict) else None


def resolve_tensor(flat: dict[str, Any] | None, planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """What ``planner.resolve_data(item)`` returns for a tensor item (DCP's lookup), cheaply where exact."""
    if flat is not None:
        obj = flat.get(item.index.fqn)
        t = type(obj)
        if t is DTensor:  # DCP: __get_tensor_shard__ -> to_local(), the same local tensor
            local = obj._local_tensor  # type: ignore[union-attr]
            if type(local) is torch.Tensor and not any(p.is_partial() for p in obj.placements):  # type: ignore[union-attr]
                return local
        elif (t is torch.Tensor or t is torch.nn.Parameter) and (
            item.index.offset is None or not any(item.index.offset)
        ):
            return obj  # type: ignore[return-value]
    out = planner.resolve_data(item)
    assert isinstance(out, torch.Tensor)
    return out.detach()


def bytes_of(planner: SavePlanner, item: WriteItem) -> bytes:
    """A pickled (BYTE_IO) item's bytes, as ``planner.resolve_data`` gives them (immutable: copied
    into the slot by :func:`_copy_bytes`)."""
    data = planner.resolve_data(item)
    return data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)  # type: ignore[arg-type]


_MISSING = object()


def _bytes_known(prog: Program, plan: SavePlan, flat: dict[str, Any], planner: SavePlanner) -> list[bytes]:
    """The pickled items' bytes, in ``prog.byte_pos`` order: through the planner's ``byte_memo``
    in one call when it has one (``snapshot.replay.ByteMemo``: what ``resolve_data`` returns for
    a plain value, without DCP's per-item lookup and BytesIO), else / for the rest as ``bytes_of``."""
    items = plan.items
    memo = getattr(planner, "byte_memo", None)
    if memo is None or not getattr(type(planner), "direct_transform", False):
        return [bytes_of(planner, items[i]) for i in prog.byte_pos]
    fqns = [prog.fqns[i] for i in prog.byte_pos] if prog.byte_fqns is None else prog.byte_fqns
    prog.byte_fqns = fqns
    objs = [flat.get(f, _MISSING) for f in fqns]
    out = memo.serialize_many(fqns, objs, _MISSING)
    for k, data in enumerate(out):
        if data is None:  # not a plain value, or missing (DCP raises its own error)
            out[k] = bytes_of(planner, items[prog.byte_pos[k]])
    return out


@dataclasses.dataclass(slots=True, eq=False)
class Group:
    """Small tensor items copied by one ``_foreach_copy_`` call: their positions and typed slot views."""

    pos: list[int]
    getter: Callable[[Sequence[Any]], Any]
    spans: list[tuple[int, int]]  # (offset, length) of each in the slot
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    nbytes: int


@dataclasses.dataclass(slots=True, eq=False)
class Program:
    """What a save of ``plan`` does, computed once (the module docstring); compared by identity."""

    plan: SavePlan  # held: the key is its identity
    algo: str
    block: int
    offsets: list[int]
    sizes: list[int]
    total: int
    templates: list[ShardRef]  # the results' storage_data, checksum 0
    indexes: list[MetadataIndex]
    types: list[WriteItemType]
    fqns: list[str]
    index_offsets: list[Any]
    tensor_pos: list[int]
    getter: Callable[[Sequence[Any]], Any] | None  # the tensor items of the resolved entries
    shapes: list[Any]
    dtypes: list[Any]
    devices: list[Any]
    groups: list[Group]
    single: list[int]  # tensor positions copied one by one (large, or not a plain CPU tensor)
    byte_pos: list[int]
    byte_fqns: list[str] | None = None  # the FQNs at byte_pos (built at the first replayed resolve)
    rooms: list[int] = dataclasses.field(default_factory=list)  # each item's room in the slot (>= its size)
    # Resolving the items without DCP (``resolve_known``): each tensor item's FQN and the type of
    # its object in the flattened state dict (None: some item needs ``planner.resolve_data``), the
    # positions among them of the DTensors, and the DTensor specs last seen without a Partial.
    tensor_fqns: list[str] = dataclasses.field(default_factory=list)
    obj_types: list[type] | None = None
    dt_getter: Callable[[Sequence[Any]], Any] | None = None
    dt_pos: list[int] = dataclasses.field(default_factory=list)
    specs: list[Any] = dataclasses.field(default_factory=list)
    # The grouped items over every group, in group order (the fused copy's source views), and
    # each group's range in that list.
    grouped: Callable[[Sequence[Any]], Any] | None = None
    ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    sources: SourceViews = dataclasses.field(default_factory=SourceViews)
    # slot index -> (the slot's mapping, each group's typed destination views in it, and the flat
    # uint8 views of every grouped item in group order, made on first use by the fused copy)
    views: dict[int, tuple[torch.Tensor, list[list[torch.Tensor]], list[torch.Tensor] | None]] = dataclasses.field(
        default_factory=dict)

    def dsts(self, slot_idx: int, slot_tensor: torch.Tensor) -> list[list[torch.Tensor]]:
        """The groups' destination views in this slot (made once per slot mapping)."""
        held = self.views.get(slot_idx)
        if held is None or held[0] is not slot_tensor:
            views = [
                [slot_tensor[o : o + n].view(dt).view(shape) for (o, n), dt, shape in zip(g.spans, g.dtypes, g.shapes)]
                for g in self.groups
            ]
            held = self.views[slot_idx] = (slot_tensor, views, None)
        return held[1]

    def dst_bytes(self, slot_idx: int, slot_tensor: torch.Tensor) -> list[torch.Tensor]:
        """The grouped items' flat uint8 views in this slot, in group order (after :meth:`dsts`)."""
        held = self.views[slot_idx]
        if held[2] is None:
            flat = [slot_tensor[o : o + n] for g in self.groups for o, n in g.spans]
            held = self.views[slot_idx] = (held[0], held[1], flat)
        assert held[2] is not None
        return held[2]


def item_sizes(entries: list[Any]) -> list[int]:
    return [len(t) if type(t) is bytes else t.numel() * t.element_size() for t in entries]


def byte_capacity(n: int) -> int:
    """The slot space kept for a pickled value of ``n`` bytes. Such a value's size may change from save
    to save (a dataloader's buffered tokens, a growing counter): a new size within this headroom keeps
    every offset, so the program, the compact commit report and the layout stay those of the last save."""
    return n + max(256, n // 4)


def layout_of(sizes: list[int], byte_pos: Iterable[int] = ()) -> tuple[list[int], list[int], int]:
    """Each item's offset in the slot, its room there, and the slot's used size: tensors back to back
    (aligned), a pickled value (``byte_pos``) with :func:`byte_capacity` of room."""
    room = list(sizes)
    for i in byte_pos:
        room[i] = byte_capacity(sizes[i])
    offsets: list[int] = []
    total = 0
    for n in room:
        offsets.append(total)
        total = align(total + n)
    return offsets, room, total


def fits_room(prog: Program, sizes: list[int]) -> bool:
    """Every pickled value of this save fits the room the program's layout kept for it."""
    rooms = prog.rooms
    return all(sizes[i] <= rooms[i] for i in prog.byte_pos)


def same_items_sized(prog: Program, byte_pos: list[int], sizes: list[int]) -> bool:
    """``sizes`` are the program's items: pickled values at the same positions, every tensor of its size."""
    if len(sizes) != len(prog.sizes) or byte_pos != prog.byte_pos:
        return False
    old = prog.sizes
    return all(sizes[i] == old[i] for i in prog.tensor_pos)


def relocated(prog: Program, sizes: list[int]) -> tuple[list[int], list[int], int]:
    """``prog``'s layout with every pickled value that outgrew its room moved to the end of the slot
    with twice its size of room; every other item stays where the recorded layout has it, so the
    commit report stays compact (the moved values' new places ride in it)."""
    offsets, rooms, total = list(prog.offsets), list(prog.rooms), prog.total
    for i in prog.byte_pos:
        if sizes[i] > rooms[i]:
            offsets[i], rooms[i] = total, 2 * sizes[i]
            total = align(total + rooms[i])
    return offsets, rooms, total


def _result(index: MetadataIndex, n: int, ref: ShardRef, cs: int) -> WriteResult:
    return WriteResult(index=index, size_in_bytes=n, storage_data=ref.with_checksum(cs))


class WriteResults(Sequence[WriteResult]):
    """One local write's DCP write results, built on first use.

    A replayed save whose commit report goes compact (checksums only, the usual case) never
    reads them: building 738 ``WriteResult`` / ``ShardRef`` pairs costs ~2 ms. Pickled (a full
    commit report) as the plain tuple of results.
    """

    __slots__ = ("_prog", "_sizes", "_sums", "_built")

    def __init__(self, prog: Program, sizes: list[int], sums: list[int]) -> None:
        self._prog, self._sizes, self._sums = prog, sizes, sums
        self._built: tuple[WriteResult, ...] | None = None

    def _all(self) -> tuple[WriteResult, ...]:
        built = self._built
        if built is None:
            prog, sizes, sums = self._prog, self._sizes, self._sums
            out = list(map(_result, prog.indexes, sizes, prog.templates, sums))
            for i in prog.byte_pos:  # pickled values: the length of this save
                out[i] = WriteResult(index=prog.indexes[i], size_in_bytes=sizes[i],
                                     storage_data=prog.templates[i]._replace(length=sizes[i], checksum=sums[i]))
            built = self._built = tuple(out)
        return built

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[WriteResult]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (WriteResults, tuple, list)) else other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (self._all(),))


def getter_of(pos: list[int]) -> Callable[[Sequence[Any]], Any] | None:
    """A C-level getter of the entries at ``pos`` (always a tuple); None for no positions."""
    if not pos:
        return None
    if len(pos) == 1:
        i = pos[0]

        def one(v: Sequence[Any]) -> tuple[Any]:
            return (v[i],)

        return one
    return operator.itemgetter(*pos)


def same_items(prog: Program, plan: SavePlan) -> bool:
    """``plan`` has the program's items (plain dcp.save plans anew every save)."""
    if prog.plan is plan:
        return True
    items = plan.items
    # MetadataIndex equality is (fqn, offset): compared as two C-level lists, not per item in Python.
    if (
        len(items) != len(prog.indexes)
        or list(map(get_fqn, items)) != prog.fqns
        or list(map(get_offset, items)) != prog.index_offsets
        or list(map(get_type, items)) != prog.types
    ):
        return False
    prog.plan = plan
    return True


def same_tensors(prog: Program, entries: Sequence[Any]) -> bool:
    """The resolved tensors have the program's shapes, dtypes, devices and (strided) layouts."""
    if prog.getter is None:
        return True
    ts = prog.getter(entries)
    return (
        list(map(get_shape, ts)) == prog.shapes
        and list(map(get_dtype, ts)) == prog.dtypes
        and list(map(get_device, ts)) == prog.devices  # grouped items are CPU tensors; CUDA ones copy alone
        and not any(map(operator.is_not, map(_layout, ts), itertools.repeat(torch.strided)))  # C-level: all strided
    )


def direct_types(flat: dict[str, Any] | None, items: list[WriteItem], tensor_pos: list[int]) -> list[type] | None:
    """The type of each tensor item's object in the flattened state dict when every one resolves
    without DCP (a DTensor with a plain local tensor, or a whole plain tensor / Parameter); else None."""
    if flat is None:
        return None
    out: list[type] = []
    for i in tensor_pos:
        it = items[i]
        obj = flat.get(it.index.fqn)
        t = type(obj)
        if t is DTensor:
            if type(obj._local_tensor) is not torch.Tensor:  # type: ignore[union-attr]
                return None
        elif not ((t is torch.Tensor or t is torch.nn.Parameter) and (it.index.offset is None or not any(it.index.offset))):
            return None
        out.append(t)
    return out


def resolve_known(prog: Program | None, plan: SavePlan, flat: dict[str, Any] | None, planner: SavePlanner,
                   algo: str, block: int) -> list[Any] | None:
    """``plan``'s entries resolved the way ``resolve_tensor`` / ``bytes_of`` would, with a few
    C-level maps over the program's FQNs, when they are the program's items with its tensor
    properties; else None (the caller resolves item by item and checks the program as before)."""
    if prog is None or flat is None or prog.obj_types is None or prog.algo != algo or prog.block != block:
        return None
    if not same_items(prog, plan):
        return None
    objs = list(map(flat.get, prog.tensor_fqns))
    if list(map(type, objs)) != prog.obj_types:
        return None
    if prog.dt_getter is not None:
        dts = prog.dt_getter(objs)
        locs = list(map(_local_tensor, dts))
        if set(map(type, locs)) != _PLAIN:
            return None
        specs = list(map(_spec, dts))
        if len(specs) != len(prog.specs) or not all(map(operator.is_, specs, prog.specs)):
            if any(p.is_partial() for sp in specs for p in sp.placements):
                return None  # DCP's lookup reduces a Partial: resolved by the planner
            prog.specs = specs
        for k, t in zip(prog.dt_pos, locs):
            objs[k] = t
    entries: list[Any] = [None] * len(prog.indexes)
    for i, t in zip(prog.tensor_pos, objs):
        entries[i] = t
    if prog.byte_pos:
        for i, data in zip(prog.byte_pos, _bytes_known(prog, plan, flat, planner)):
            entries[i] = data
    return entries if same_tensors(prog, entries) else None


# ---- the writer ------------------------------------------------------------------------------

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
                plan_c = self.carry.plan(rank, slot_idx, slot, prog, entries, prog.tensor_pos, row_items(flat, entries, prog.tensor_pos, prog.fqns, prog.single))
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
        The groups go through :func:`copy_group` (fused per item when it can).
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
    if t.is_cuda and kind > EXT_KINDS and n:  # float8: copied, and counted on the device by a bit test
        return _copy_one(t, slot, offset, n, algo, block, pace, device_copier), count_nonfinite(t)
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
