"""The structure map of a fast restore: each state-dict entry → one chunk in this node's slots.

:func:`gemini_dcp.dcp.fast_load.fast_load` restores without DCP's planning when every entry of
a rank's (flattened) state dict is exactly one stored chunk — same fqn, chunk offset, shape and
dtype — held in a slot of this rank's node. This module is that pure check, local to one rank
(no collective): :func:`walk` reads the structure of the live state dict (its *signature*, and
the destination tensors), :func:`build_plan` maps it onto a step record, and
:func:`cached_plan` / :func:`remember` keep the map per (job, step record, rank) so a second
restore of the same structure skips the metadata lookups.

The signature holds what the map depends on: fqn, kind, local shape and dtype, and for a DTensor
its global shape, placements and device mesh (the mesh object itself, so its id is never reused
while a plan is cached). It does not hold the tensors: destinations are taken anew each call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import ConfigError

__all__ = ["REMOTE_MAX_BYTES", "FastEntry", "FastPlan", "SourceView", "Walk", "build_plan", "cached_plan", "remember", "walk"]

_CACHE_SIZE = 8  # (job, step record, rank) keys kept; a trainer restores one structure at a time
REMOTE_MAX_BYTES = 1 << 20
"""A chunk this node does not hold may still take the fast path when it is at most this big (DCP's
deduplication stores a replicated value — a step counter, a scheduler's state — in one rank's slot
only): a rank whose node holds it reads, verifies and sends it in the agreement round."""


class FastEntry(NamedTuple):
    """One state-dict entry's stored chunk: in the slot of saving rank ``slot_rank`` at ``offset``."""

    fqn: str
    slot_rank: int
    offset: int
    length: int
    algo: str
    checksum: int
    is_bytes: bool  # a non-tensor value (``torch.save`` bytes), else a tensor chunk


class SourceView(NamedTuple):
    """A tensor chunk's bytes as the tensor: ``slot_as_dtype.as_strided(shape, stride, elem_offset)``,
    where ``slot_as_dtype`` is the slot's bytes viewed as ``dtype`` (``elem_offset``: in elements)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    elem_offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FastPlan:
    """A state dict's structure mapped onto one step record's chunks, in the state dict's order."""

    fingerprint: str
    signature: tuple[Any, ...]
    entries: tuple[FastEntry, ...]
    remote: tuple[int, ...] = ()  # positions in ``entries`` of small chunks this node does not hold
    # Per entry, how its verified bytes are viewed as the tensor (dtype, shape, contiguous strides,
    # offset in elements of the slot viewed as that dtype): one ``as_strided`` per chunk at restore
    # instead of a slice and two views. None: a bytes item or an empty tensor (nothing to copy).
    views: tuple[SourceView | None, ...] = ()

    def __post_init__(self) -> None:
        if len(self.entries) != len(self.signature) or (self.views and len(self.views) != len(self.entries)):
            raise ConfigError(
                f"a fast-restore plan needs one entry per state-dict entry: {len(self.entries)} entries "
                f"({len(self.views)} views) for {len(self.signature)} signature rows; build it with build_plan()."
            )

    @property
    def nbytes(self) -> int:
        """Stored bytes this plan reads (tensor chunks and bytes items)."""
        return sum(e.length for e in self.entries)


class Walk(NamedTuple):
    """What :func:`walk` read of a live state dict: its signature, each entry's destination tensor
    (None for a non-tensor value) and its chunk offset (DTensor: this rank's shard), or the reason
    no fast restore can fill it."""

    signature: tuple[Any, ...]
    dests: list[torch.Tensor | None]
    reason: str


def walk(flat: Mapping[str, Any]) -> Walk:
    """The signature and destinations of a flattened state dict (no metadata read)."""
    sig: list[Any] = []
    dests: list[torch.Tensor | None] = []
    add_row, add_dest = sig.append, dests.append  # per item: bound once (thousands of items per restore)
    dtensor_type = _dtensor_type()
    tensor_type, strided = torch.Tensor, torch.strided
    for fqn, value in flat.items():
        if dtensor_type is not None and isinstance(value, dtensor_type):
            local = getattr(value, "_local_tensor", None)  # to_local() is an autograd op: ~10x the cost
            if not isinstance(local, tensor_type):
                local = value.to_local()
            add_row((fqn, "d", tuple(local.shape), local.dtype, tuple(value.shape), tuple(value.placements), value.device_mesh))
        elif isinstance(value, tensor_type):
            local = value
            add_row((fqn, "t", tuple(local.shape), local.dtype))
        else:
            add_row((fqn, "b"))
            add_dest(None)
            continue
        if not local.is_cpu or local.layout != strided or local.is_quantized or not local.is_contiguous():
            return Walk((), [], f"{fqn!r} is not a dense contiguous CPU tensor")
        add_dest(local.detach())
    return Walk(tuple(sig), dests, "")


def build_plan(
    flat: Mapping[str, Any], walked: Walk, metadata: Metadata, fingerprint: str, held_ranks: frozenset[int] | set[int]
) -> FastPlan | str:
    """Map ``walked`` (of ``flat``) onto the step's chunks; the plan, or why it does not map exactly.

    Every entry must be one stored chunk of the same fqn, offset, shape and dtype (no resharding, no
    dtype conversion) in a slot of a saving rank in ``held_ranks`` (the slots this node holds), or
    be at most :data:`REMOTE_MAX_BYTES` (listed in ``remote``: another node sends it).
    """
    sdm = metadata.state_dict_metadata
    storage = metadata.storage_data
    entries: list[FastEntry] = []
    views: list[SourceView | None] = []
    remote: list[int] = []
    for (fqn, value), row, dest in zip(flat.items(), walked.signature, walked.dests):
        md = sdm.get(fqn)
        if md is None:
            return f"{fqn!r} is not in the checkpoint"
        if dest is None:
            if not isinstance(md, BytesStorageMetadata):
                return f"{fqn!r} was saved as a tensor, the state dict holds a {type(value).__name__}"
            index = MetadataIndex(fqn)
        else:
            if not isinstance(md, TensorStorageMetadata):
                return f"{fqn!r} was saved as a non-tensor value"
            if md.properties.dtype != dest.dtype:
                return f"{fqn!r}: saved {md.properties.dtype}, state dict {dest.dtype} (converted by dcp.load)"
            if row[1] == "d":
                if tuple(md.size) != row[4]:
                    return f"{fqn!r}: saved size {tuple(md.size)}, state dict {row[4]}"
                chunks = value.__create_chunk_list__()
                if len(chunks) != 1:
                    return f"{fqn!r}: {len(chunks)} local chunks"
                offsets = tuple(chunks[0].offsets)
            else:
                if tuple(md.size) != row[2]:
                    return f"{fqn!r}: saved size {tuple(md.size)}, state dict {row[2]}"
                offsets = (0,) * dest.dim()
            if not any(tuple(c.offsets) == offsets and tuple(c.sizes) == tuple(dest.shape) for c in md.chunks):
                return f"{fqn!r}: no stored chunk at offset {offsets} of shape {tuple(dest.shape)} (resharded)"
            index = MetadataIndex(fqn, offsets)
        try:
            ref = storage[index]
        except KeyError:
            return f"{fqn!r}: the record has no chunk at {index.offset}"
        if ref.rank not in held_ranks:
            if ref.length > REMOTE_MAX_BYTES:
                return f"{fqn!r} is stored in rank {ref.rank}'s slot, which this node does not hold"
            remote.append(len(entries))
        if dest is not None:
            if ref.length != dest.numel() * dest.element_size():
                return f"{fqn!r}: the record's chunk has {ref.length} bytes, the tensor {dest.numel() * dest.element_size()}"
            if ref.offset % max(1, dest.element_size()):
                return f"{fqn!r}: chunk not aligned for {dest.dtype}"
        entries.append(FastEntry(fqn, ref.rank, ref.offset, ref.length, ref.algo, ref.checksum, dest is None))
        views.append(None if dest is None or not dest.numel() else SourceView(
            dest.dtype, tuple(dest.shape), _contiguous_strides(tuple(dest.shape)), ref.offset // dest.element_size()))
    return FastPlan(fingerprint=fingerprint, signature=walked.signature, entries=tuple(entries), remote=tuple(remote),
                    views=tuple(views))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_cache: OrderedDict[tuple[Any, ...], FastPlan] = OrderedDict()
_lock = threading.Lock()


def cached_plan(key: tuple[Any, ...], signature: tuple[Any, ...]) -> FastPlan | None:
    """The plan remembered under ``key`` (job root, job id, rank, record fingerprint) if it was built
    for this exact ``signature``, else None."""
    with _lock:
        plan = _cache.get(key)
        if plan is None:
            return None
        _cache.move_to_end(key)
    return plan if plan.signature == signature else None


def remember(key: tuple[Any, ...], plan: FastPlan) -> None:
    """Keep ``plan`` under ``key`` (the least recently used of more than a few keys is dropped)."""
    with _lock:
        _cache[key] = plan
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415
    except ImportError:  # a torch built without distributed
        return None
    return DTensor
