"""The plan check of a replayed save whose snapshot has the recorded save's structure generation.

:class:`~gemini_dcp.snapshot.structure.StructureCache` gives two snapshots the same
generation only when they hold the same keys and the same tensor objects at the same
places. What DCP's plan of such a snapshot can still depend on is what changes *in place*
on those objects: a tensor's shape, dtype, layout, ``requires_grad`` or pinned memory
(``p.data = ...``, ``requires_grad_()``), a DTensor's spec (placements, mesh, global
shape), and the grad mode. :class:`FastCheck` compares exactly those, with C-level maps
over the tensor leaves, far cheaper than
:func:`~gemini_dcp.snapshot.replay.structure_key` and DCP's flattening. It also rebuilds the planner's flattened state dict by following
the recorded flattening paths (``mappings``) into the new snapshot, so non-tensor values
(a step counter) and cloned buffers are this save's.

Any difference, or a path that no longer resolves, returns False: the caller then runs the
exact check (structure key, else DCP's local plan).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from ..core.compat import HAS_CHECKPOINTABLE_TENSOR

__all__ = ["FastCheck"]

_spec = operator.attrgetter("_spec")
_local = operator.attrgetter("_local_tensor")
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_layout = operator.attrgetter("layout")
_grad = operator.attrgetter("requires_grad")


def _signature(values: list[Any], dt_pos: Any, t_pos: Any, pinned: bool) -> tuple[Any, ...]:
    """What the plan of these tensor leaves depends on, as lists built by C-level maps."""
    dts = dt_pos(values) if dt_pos is not None else ()
    ts = t_pos(values) if t_pos is not None else ()
    locals_ = list(map(_local, dts)) + list(ts)
    sig = (
        torch.is_grad_enabled(),
        list(map(_spec, dts)),  # DTensorSpec: placements, mesh, global shape (identity, else ==)
        list(map(_grad, dts)),
        list(map(_shape, locals_)),
        list(map(_dtype, locals_)),
        list(map(_layout, locals_)),
        list(map(_grad, ts)),
        list(map(type, locals_)),
    )
    if pinned:
        sig += (list(map(torch.Tensor.is_pinned, locals_)),)  # type: ignore[assignment]
    return sig


def _getter(pos: list[int]) -> Any:
    if not pos:
        return None
    if len(pos) == 1:
        i = pos[0]
        return lambda v: (v[i],)
    return operator.itemgetter(*pos)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FastCheck:
    """The recorded save's flattened structure and the in-place properties of its tensors."""

    generation: int
    fqns: tuple[str, ...]
    paths: tuple[tuple[Any, ...], ...]  # DCP's flattening path of every FQN, in FQN order
    mappings: Any  # DCP's FLATTEN_MAPPING, handed to the planner as its own
    dt_pos: Any  # itemgetter of the DTensor positions in the flattened values
    t_pos: Any  # itemgetter of the plain tensor / Parameter positions
    pinned: bool  # compare pinned memory too (CUDA builds)
    signature: tuple[Any, ...]
    # ``paths`` as runs of consecutive FQNs under one container: (its path, a getter of their
    # keys in it, always a tuple). ``flatten`` resolves each container once and takes its leaves
    # with one C-level call (a DCP flattening is depth-first: siblings are consecutive).
    runs: tuple[tuple[tuple[Any, ...], Any], ...] = ()

    @classmethod
    def of(cls, generation: int | None, flat: dict[str, Any], mappings: Any) -> FastCheck | None:
        """The check of a save planned from ``flat`` (the planner's flattened state dict)
        and ``mappings``; None when the snapshot had no generation or some value is a
        tensor the structure key does not cover (the exact check stays)."""
        if generation is None or HAS_CHECKPOINTABLE_TENSOR or not mappings or set(mappings) != set(flat):
            return None
        values = list(flat.values())
        dts: list[int] = []
        ts: list[int] = []
        for i, v in enumerate(values):
            t = type(v)
            if t is DTensor and type(v._local_tensor) is torch.Tensor:
                dts.append(i)
            elif t is torch.Tensor or t is torch.nn.Parameter:
                ts.append(i)
            elif isinstance(v, torch.Tensor) or hasattr(v, "__create_write_items__"):
                return None
        pinned = torch.cuda.is_available()
        dt_pos, t_pos = _getter(dts), _getter(ts)
        fqns = tuple(flat)
        paths = tuple(tuple(mappings[f]) for f in fqns)
        if not all(paths):
            return None
        return cls(
            generation=generation, fqns=fqns, paths=paths, mappings=mappings,
            dt_pos=dt_pos, t_pos=t_pos, pinned=pinned, signature=_signature(values, dt_pos, t_pos, pinned),
            runs=_runs(paths),
        )

    def flatten(self, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        """``state_dict`` flattened along the recorded paths; None if a path no longer resolves."""
        values: list[Any] = []
        extend = values.extend
        try:
            for parent, get in self.runs:
                o: Any = state_dict
                for k in parent:
                    o = o[k]
                extend(get(o))
        except (KeyError, IndexError, TypeError):
            return None
        return dict(zip(self.fqns, values))

    def set_up(self, planner: DefaultSavePlanner, state_dict: dict[str, Any], is_coordinator: bool) -> bool:
        """Set ``planner`` up on ``state_dict`` as ``set_up_planner`` would, if the recorded
        plan still holds for it (True); else leave the planner alone (False)."""
        flat = self.flatten(state_dict)
        if flat is None:
            return False
        values = list(flat.values())
        try:
            same = _signature(values, self.dt_pos, self.t_pos, self.pinned) == self.signature
        except (AttributeError, TypeError, RuntimeError):  # a value of another kind at a tensor position
            return False
        if not same:
            return False
        planner.state_dict = flat
        planner.mappings = self.mappings
        planner.is_coordinator = is_coordinator
        return True


def _runs(paths: tuple[tuple[Any, ...], ...]) -> tuple[tuple[tuple[Any, ...], Any], ...]:
    """``FastCheck.runs`` of ``paths`` (each non-empty)."""
    out: list[tuple[tuple[Any, ...], Any]] = []
    parent: tuple[Any, ...] | None = None
    keys: list[Any] = []

    def close() -> None:
        if parent is not None and keys:
            if len(keys) == 1:
                k = keys[0]
                out.append((parent, lambda o: (o[k],)))
            else:
                out.append((parent, operator.itemgetter(*keys)))

    for path in paths:
        if path[:-1] != parent:
            close()
            parent, keys = path[:-1], []
        keys.append(path[-1])
    close()
    return tuple(out)
