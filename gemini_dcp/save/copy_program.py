"""The copy program of a plan: what a save of the same items does, computed once, and the
cheap per-save resolution of the items against it.

:class:`gemini_dcp.save.local_write.LocalWriter` keeps one :class:`Program` per rank (see that
module for why): the items' offsets in the slot, the write results' templates, the typed
destination views, the groups of small items. This module holds the program and what each save
does with it before the copy:

* :func:`resolve_known` resolves the items of a plan the program already describes with a few
  C-level maps over its FQNs (the objects of the flattened state dict, the DTensors' local
  tensors and specs) and checks them against it (shapes, dtypes, devices, layouts), instead of
  ``resolve_tensor`` item by item;
* :class:`WriteResults` builds the DCP write results only when read (a compact commit report
  never reads them).
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

from ..local.record_types import ShardRef
from ..local.slots import align
from .batch_copy import SourceViews

__all__ = [  # the program seam LocalWriter runs
    "CPU_DEVICE", "Group", "Program", "WriteResults", "bytes_of", "direct_lookup", "direct_types", "fits_room",
    "get_device", "get_dtype", "get_fqn", "get_index", "get_offset", "get_shape", "get_type", "getter_of",
    "item_sizes", "layout_of", "relocated", "resolve_known", "resolve_tensor", "same_items", "same_items_sized",
    "same_tensors",
]

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
Pacer = Callable[[int], None]


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
    into the slot by ``local_write._copy_bytes``)."""
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
    """What a save of ``plan`` does, computed once (module docstring); compared by identity."""

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
