"""Per-step saves without re-planning: replay the last DCP save plan while the
state dict keeps its structure.

``dcp.save`` plans every call: each rank builds its local plan, the coordinator
gathers the plans, deduplicates replicated items and scatters the final plans,
and after the write the results are gathered and the metadata broadcast — four
pickled-object collectives through one coordinator, on top of the writer's own
commit gather. A job that checkpoints every step saves the same structure every
step, so the plan does not change; the planning is most of the background CPU
of a per-step snapshot, taken from training (figures: docs/async.md), and on a
large job every plan goes through rank 0.

:class:`PlanReplay` runs the first save (and any save whose structure changed)
through ``dcp.save`` with a planner that records the plans, then replays:

1. each rank compares a cheap key of its flattened state dict's structure
   (:func:`structure_key`: FQNs, shapes, dtypes, placements, meshes) with the
   recorded one, or, when the key differs or cannot be built, its full local
   plan with the recorded plan (local work, no collective);
2. one all-reduce of a few integers on the checkpoint control group (through
   its transport, :mod:`gemini_dcp.transport.p2p`) decides
   for all ranks together: replay only if every rank's plan is unchanged and
   every rank holds the plans of the same recorded save, else every rank runs
   ``dcp.save`` (ranks never split between the two protocols);
3. a replay writes the recorded final plan (the same items, deduplicated the
   same way) and commits with the recorded global metadata through
   :meth:`GeminiStorageWriter.write_replayed`: the write-result gather of the
   commit is the only pickled collective left.

The bytes, checksums and step record are those ``dcp.save`` would produce for
the same state dict; only the planning is skipped. Tensor *values* and
non-tensor values (a step counter) are read at write time as always.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import operator
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..core.compat import HAS_CHECKPOINTABLE_TENSOR, checkpointable_fields
from ..dcp.writer import GeminiStorageWriter
from ..local.record_types import ShardRef
from ..transport.comm import Comm
from ..transport.p2p import Transport, transport_for
from .replay_check import FastCheck

__all__ = ["ByteMemo", "PlanReplay", "RecordingSavePlanner", "same_plan", "structure_key"]

log = logging.getLogger(__name__)

_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes})


def _plain(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` is built of plain values only (exact types: None, bool, int, float, complex,
    str, bytes, and tuples, lists and dicts of them): no tensor, no object with its own pickling."""
    t = type(obj)
    if t in _PLAIN:
        return True
    if depth >= 8:
        return False
    if t is tuple or t is list:
        return all(_plain(v, depth + 1) for v in obj)
    if t is dict:
        return all(type(k) in _PLAIN and _plain(v, depth + 1) for k, v in obj.items())
    return False


def _frozen(obj: Any) -> bool:
    """Whether ``obj`` is an immutable plain value (an exact scalar type, or a tuple of them): the
    same object pickles to the same bytes at every save."""
    t = type(obj)
    return t in _PLAIN or (t is tuple and all(type(v) in _PLAIN for v in obj))


def _same_frozen(old: Any, obj: Any) -> bool:
    """``obj`` is ``old`` or a tuple of the same objects (a snapshot copies tuples), and immutable."""
    if old is not obj:
        if type(obj) is not tuple or type(old) is not tuple or len(old) != len(obj):
            return False
        if not all(map(operator.is_, old, obj)):
            return False
    return _frozen(obj)


class ByteMemo:
    """``torch.save`` bytes of the non-tensor values of a per-step save, reused while a value is the same.

    DCP writes every non-tensor value (a learning rate, Adam's betas, a step counter, a data loader's
    state) as its own ``torch.save`` blob: ~40 us each here, and an optimizer's flattened param groups
    have a dozen per parameter (torchtitan's llama3 debugmodel: ~650 per save, all on the coordinator).
    For a value made of plain types only (:func:`_plain`), the blob is a function of the value's pickle,
    so a value whose ``pickle.dumps`` (~0.3 us) equals the previous save's for that FQN gets the previous
    blob again: the same bytes ``torch.save`` would write now. Anything else is serialized as DCP does.
    One instance per :class:`PlanReplay` (its background thread); :meth:`rotate` after each save keeps
    only the last save's values.
    """

    def __init__(self) -> None:
        # fqn -> (the value, its pickle, its blob): the value is held, so ``is`` on it is safe.
        self._old: dict[str, tuple[Any, bytes, bytes]] = {}
        self._new: dict[str, tuple[Any, bytes, bytes]] = {}
        # pickle -> blob, of this save and the last: a value equal to another FQN's (one learning
        # rate in every param group) is serialized once.
        self._blobs: dict[bytes, bytes] = {}
        self._old_blobs: dict[bytes, bytes] = {}
        self.hits = 0  # the FQN's value pickles as at the last save (or is the same immutable object)
        self.shared = 0  # another FQN's value of this save or the last pickles the same: its blob
        self.misses = 0  # serialized with torch.save
        # serialize_many's last call: (its FQN list, by identity; the values; their bytes; whether
        # each value is immutable and plain). Values are held, so ``is`` on them is safe.
        self._many: tuple[list[str], list[Any], list[Any], list[bool]] | None = None

    def _data(self, fqn: str, obj: Any) -> bytes | None:
        hit = self._old.get(fqn)
        if hit is not None and _same_frozen(hit[0], obj):  # the same immutable value: no pickling
            self.hits += 1
            self._new[fqn] = hit
            self._blobs[hit[1]] = hit[2]
            return hit[2]
        if not _plain(obj):
            return None
        key = pickle.dumps(obj, protocol=2)
        if hit is not None and hit[1] == key:
            data = hit[2]
            self.hits += 1
        else:
            got = self._blobs.get(key)
            if got is None:
                got = self._old_blobs.get(key)
            if got is None:
                buf = io.BytesIO()
                torch.save(obj, buf)
                got = buf.getvalue()
                self.misses += 1
            else:
                self.shared += 1
            data = got
        self._new[fqn] = (obj, key, data)
        self._blobs[key] = data
        return data

    def serialize(self, fqn: str, obj: Any) -> io.BytesIO | None:
        """``torch.save(obj)`` into a BytesIO, reused when ``obj`` pickles as last time; None if not plain."""
        data = self._data(fqn, obj)
        return None if data is None else io.BytesIO(data)

    def serialize_many(self, fqns: list[str], objs: list[Any], missing: Any) -> list[Any]:
        """The ``torch.save`` bytes of each value (None where not plain, or where ``objs`` holds
        ``missing``): :meth:`serialize` for a whole save's values in one call (the writer's
        ``local_write._bytes_known``)."""
        last = self._many
        if last is not None and last[0] is fqns and len(last[1]) == len(objs):
            # Values that are the same immutable objects as at the last call keep their bytes: one
            # C-level identity map over the values, Python work only for the others.
            _, lobjs, ldata, lfrozen = last
            out: list[Any] = [d if s and f else None for d, s, f in zip(ldata, map(operator.is_, objs, lobjs), lfrozen)]
            frozen = list(lfrozen)
            self.hits += len(out) - out.count(None)
        else:
            out = [None] * len(objs)
            frozen = [False] * len(objs)
        data = self._data
        for k in [k for k, d in enumerate(out) if d is None]:
            o = objs[k]
            if o is not missing:
                out[k] = data(fqns[k], o)
            frozen[k] = out[k] is not None and _frozen(o)
        self._many = (fqns, list(objs), out, frozen)
        return list(out)

    def rotate(self) -> None:
        """This save's values become the ones the next save compares with."""
        self._old, self._new = self._new, {}
        self._old_blobs, self._blobs = self._blobs, {}


class RecordingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that keeps this rank's local plan (before the coordinator's
    deduplication) and final plan (after it) of the save it planned.

    It also resolves a DTensor's shard to its local tensor directly: the same tensor
    ``DTensor.to_local()`` returns (what DCP's lookup does), without the autograd
    wrapper call, which costs ~0.1 ms per tensor (the writer detaches it anyway).
    """

    local_plan: SavePlan | None = None
    final_plan: SavePlan | None = None
    direct_lookup = True  # lookup_object below is DCP's, faster: the writer may resolve items itself
    direct_transform = True  # transform_object below is DCP's for tensors (byte items: the same bytes)
    byte_memo: ByteMemo | None = None  # set by PlanReplay: serialized non-tensor values reused across saves

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.local_plan = plan
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.final_plan = plan
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if type(obj) is DTensor:
            local = obj._local_tensor
            if type(local) is torch.Tensor and not any(p.is_partial() for p in obj.placements):
                return local
        return super().lookup_object(index)  # also raises DCP's errors (a Partial placement, a missing key)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's parameter name
        memo = self.byte_memo
        if memo is not None and write_item.type == WriteItemType.BYTE_IO:
            out = memo.serialize(write_item.index.fqn, object)
            if out is not None:
                return out
        return super().transform_object(write_item, object)


def structure_key(state_dict: dict[str, Any], mappings: Any) -> tuple[Any, ...] | None:
    """What ``DefaultSavePlanner.create_local_plan`` reads from a *flattened* state dict,
    as a cheap comparable key; None when an object's plan cannot be keyed this way.

    Keyed: the FQNs in order and the flattening paths; for a DTensor (exact type, plain
    local tensor) its global shape, placements, device mesh (by identity) and local
    dtype/layout/requires_grad/pinned; for a plain tensor or Parameter its shape and the
    same properties, and on torch >= 2.15 the fields of a ``CheckpointableTensor`` (its global
    shape and shard boundaries: moving a boundary changes the plan even when the local shape
    stays); for a non-tensor value nothing but its FQN (its plan item does not
    depend on the value). Anything else (ShardedTensor, tensor subclasses, objects with
    ``__create_write_items__``) returns None: the caller compares full local plans.
    Building DTensor plan items costs ~0.4 ms each (offsets computed with tensor ops);
    this key ~3 us.
    """
    grad = torch.is_grad_enabled()
    items: list[tuple[Any, ...]] = []
    for fqn, obj in state_dict.items():
        t = type(obj)
        if t is DTensor:
            local = obj._local_tensor
            if type(local) is not torch.Tensor:
                return None
            items.append((fqn, 1, tuple(obj.shape), tuple(obj.placements), id(obj.device_mesh), local.dtype, local.layout,
                          obj.requires_grad, local.is_pinned()))
        elif t is torch.Tensor or t is torch.nn.Parameter:
            shards = None
            if HAS_CHECKPOINTABLE_TENSOR:  # torch >= 2.15 plans a CheckpointableTensor by these fields
                try:
                    shards = checkpointable_fields(obj)
                except (TypeError, ValueError):
                    return None
            items.append((fqn, 2, tuple(obj.shape), obj.dtype, obj.layout, obj.requires_grad, obj.is_pinned(), shards))
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return None
        else:
            items.append((fqn, 0))
    return (grad, tuple(items), tuple((mappings or {}).items()))


def _meshes(state_dict: dict[str, Any]) -> tuple[Any, ...]:
    """The device meshes a structure key refers to by id (kept alive with the key, so an id is never reused)."""
    return tuple({id(o.device_mesh): o.device_mesh for o in state_dict.values() if type(o) is DTensor}.values())


@dataclasses.dataclass(frozen=True, slots=True)
class _Recorded:
    generation: int  # the step of the recorded save: equal on every rank that recorded the same save
    local_plan: SavePlan
    final_plan: SavePlan
    metadata: Metadata
    key: tuple[Any, ...] | None = None  # structure_key of the recorded state dict (None: compare plans)
    meshes: tuple[Any, ...] = ()  # keeps the meshes in ``key`` alive
    layout: Mapping[MetadataIndex, ShardRef] | None = None  # the recorded save's committed_layout: replays send only checksums
    # The snapshot generation (:class:`~gemini_dcp.snapshot.structure.StructureCache`) the recorded
    # save was planned from, with what a snapshot of that generation needs to skip DCP's
    # flattening and the structure key (None: compare as above).
    fast: FastCheck | None = None


def same_plan(a: SavePlan, b: SavePlan) -> bool:
    """Plans that lead to the same global plan (``MetadataIndex.index`` hints are not compared)."""
    return a.items == b.items and a.planner_data == b.planner_data and a.storage_data == b.storage_data


class PlanReplay:
    """Save through ``dcp.save`` once, then replay its plan while the structure holds.

    One instance per writer and checkpoint group; :meth:`save` is collective over
    ``group``: **all ranks must call it together, for the same step**.
    """

    def __init__(self, writer: GeminiStorageWriter, group: Any, *, no_dist: bool) -> None:
        self.writer = writer
        self.group = group
        self.no_dist = no_dist
        self._recorded: _Recorded | None = None
        self._transport: Transport | None = None  # over ``group``, made at the first agreement
        self.byte_memo = ByteMemo()  # non-tensor values' torch.save bytes, reused while unchanged
        self.replayed = 0  # saves that skipped planning
        self.planned = 0  # saves that went through dcp.save
        self.fast_checked = 0  # replays whose plan was checked by FastCheck (same snapshot generation)

    def save(self, state_dict: dict[str, Any], step: int, *, generation: int | None = None) -> Metadata:
        """Save ``state_dict`` as ``step``; returns the global metadata. Collective.

        ``generation``: the :class:`~gemini_dcp.snapshot.structure.StructureCache` generation
        of ``state_dict`` (a snapshot of it); when the recorded save was planned from the same
        generation, the plan is checked by :class:`FastCheck` (no flattening, no structure key).
        """
        rank = 0 if self.no_dist or self.group is None else dist.get_rank(self.group)
        try:
            return self._save(state_dict, step, generation, rank)
        finally:
            self.byte_memo.rotate()

    def _save(self, state_dict: dict[str, Any], step: int, generation: int | None, rank: int) -> Metadata:
        is_coordinator = rank == 0
        w = self.writer
        w.reset(step)
        planner = self._planner()
        rec = self._recorded
        hit = False
        if rec is not None and generation is not None and rec.fast is not None and rec.fast.generation == generation:
            hit = rec.fast.set_up(planner, state_dict, is_coordinator)
            if hit:
                self.fast_checked += 1
        if rec is not None and not hit:
            try:
                planner.set_up_planner(state_dict, w.storage_meta(), is_coordinator)
                key = structure_key(planner.state_dict, planner.mappings)
                hit = key is not None and key == rec.key
                if not hit:  # the exact test: DCP's own local plan
                    hit = same_plan(planner.create_local_plan(), rec.local_plan)
                    if hit and key is not None:
                        self._recorded = rec = dataclasses.replace(rec, key=key, meshes=_meshes(planner.state_dict))
                if hit and key is not None and generation is not None:  # this generation checks fast from now on
                    fast = FastCheck.of(generation, planner.state_dict, planner.mappings)
                    self._recorded = rec = dataclasses.replace(rec, fast=fast)
            except Exception:  # noqa: BLE001 - planned again below by dcp.save, which reports it to every rank
                log.debug("step %s: local planning failed; dcp.save will plan and report it", step, exc_info=True)
        # The writer's pre-write agreement (the step committed on every node, a repeated step)
        # rides in the same all-reduce: a replayed save runs no collective of its own before it writes.
        pre = w.prewrite_values(step)
        if self._agree(hit, rec.generation if rec is not None else -1, pre):
            assert rec is not None
            w.set_up_storage_writer(is_coordinator, rank=rank, use_collectives=True)
            meta = rec.metadata
            if meta.storage_meta is not None:
                meta = dataclasses.replace(meta, storage_meta=w.storage_meta())
            w.write_replayed(rec.final_plan, planner, meta, rec.layout, agreed=pre)
            self.replayed += 1
            return meta
        return self._plan_and_save(state_dict, step, generation)

    def _plan_and_save(self, state_dict: dict[str, Any], step: int, generation: int | None = None) -> Metadata:
        self._recorded = None  # a failed save below leaves nothing to replay
        planner = self._planner()
        meta = dcp.save(
            state_dict, storage_writer=self.writer, checkpoint_id=step, planner=planner,
            process_group=self.group, no_dist=self.no_dist,
        )
        self.planned += 1
        global_meta = self.writer.commit.planned_metadata
        if planner.local_plan is not None and planner.final_plan is not None and isinstance(global_meta, Metadata):
            # The step names the recorded save: one collective save per step, so ranks that
            # recorded the same step recorded the same save (a counter would drift apart for
            # good after a save that committed on some ranks and raised on others).
            key = structure_key(planner.state_dict, planner.mappings)
            fast = FastCheck.of(generation, planner.state_dict, planner.mappings) if key is not None else None
            self._recorded = _Recorded(
                step, planner.local_plan, planner.final_plan, global_meta, key, _meshes(planner.state_dict),
                self.writer.commit.committed_layout, fast,
            )
        return meta

    def _planner(self) -> RecordingSavePlanner:
        planner = RecordingSavePlanner()
        planner.byte_memo = self.byte_memo
        return planner

    def _agree(self, hit: bool, generation: int, pre: list[int] | None = None) -> bool:
        """True on every rank iff every rank hit and all hold the same recorded save.

        ``pre`` (the writer's ``prewrite_values``) is combined by MIN in the same all-reduce
        and replaced in place by the result."""
        if self.no_dist or self.group is None:
            return hit
        if self._transport is None:
            self._transport = transport_for(Comm(self.group))
        extra = list(pre) if pre is not None else []
        flags = self._transport.all_reduce_ints([int(hit), generation, -generation, *extra], "min")
        if pre is not None:
            pre[:] = flags[3:]
        return flags[0] == 1 and flags[1] == -flags[2]
