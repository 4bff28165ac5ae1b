"""The structural snapshot of a state dict, and its cache: what ``AsyncCheckpointer.save()``
does before it returns.

A snapshot copies the *containers* of a state dict (dicts, lists, tuples), keeps every
tensor by reference (zero copy), clones the tensors whose storage is a model buffer's
(changed in the forward pass, so the guard cannot protect them), and turns top-level
``Stateful`` values into their ``state_dict()``. :func:`snapshot_structure` does it in one
walk, most of whose cost is the runtime-checkable ``Stateful`` Protocol ``isinstance``
(``inspect.getattr_static`` per value).

:class:`StructureCache` remembers the walk as a program (one :class:`_Node` per container)
and replays it while the structure holds. Per container, the revalidation is C-level work
over its items: a shallow copy (``dict(d)`` / ``list(l)``), the keys compared as a list,
the tensor leaves fetched with one ``itemgetter`` and compared by *identity* with the
remembered ones (``map(operator.is_, ...)``: the cache holds the leaves, so an object can
never be replaced by another at the same address), and the few non-tensor leaves (a step
counter) checked to be still non-tensor, non-container values; then only the child
containers, the cloned buffers and the top-level ``Stateful`` values are visited in
Python. No per-leaf Protocol check, no torch call per leaf. Any difference (a key, a
container type, another tensor object at a position, a scalar that became a tensor or a
container, a cloned buffer whose storage moved) walks the whole state dict again and
starts a new *generation*.

``Snapshot.generation`` names the structure: two snapshots of one cache with the same
generation hold the same keys in the same order and the same tensor objects at the same
places (buffers: fresh clones of the same objects). The background save uses it to skip
DCP's flattening and structure key (:mod:`gemini_dcp.snapshot.replay`); what the
identity does not cover — a tensor whose storage, shape or dtype changed in place
(``p.data = ...``) — is checked there, before the copy (the guard holds the optimizer
until then, so nothing a training loop does in ``optimizer.step()`` can change it in
between).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch

from ..core.compat import copy_checkpointable_fields

__all__ = ["Snapshot", "StructureCache", "buffer_storages", "snapshot_structure", "storage_key"]

_is = operator.is_


def storage_key(t: torch.Tensor) -> int | None:
    """The data pointer of a tensor's storage (a DTensor's local one); None without storage."""
    # No torch op here (each one releases and re-takes the GIL): DTensor's local tensor by attribute.
    local = getattr(t, "_local_tensor", t)
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def clone_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` with its sharding (DTensor placements, checkpointable fields)."""
    if hasattr(t, "to_local") and hasattr(t, "device_mesh"):
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - DTensor import is heavy; rare path

        local = t.to_local().detach().clone()
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())  # type: ignore[attr-defined]
    # A CheckpointableTensor's shard layout is in its attributes, which clone() does not carry.
    return copy_checkpointable_fields(t, t.detach().clone())


def buffer_storages(model: Any) -> set[int]:
    """The storage keys of the buffers of ``model`` (a module or a list of them): cloned at save()."""
    keys: set[int] = set()
    if model is None:
        return keys
    models = model if isinstance(model, (list, tuple)) else [model]
    for m in models:
        for b in m.buffers():
            k = storage_key(b)
            if k is not None and k != 0:
                keys.add(k)
    return keys


_STATEFUL: dict[type, bool] = {}


def _is_stateful(v: Any) -> bool:
    """``isinstance(v, Stateful)``, the Protocol check (slow: ``inspect.getattr_static``)."""
    from torch.distributed.checkpoint.stateful import Stateful  # noqa: PLC0415 - keeps this module light to import

    return isinstance(v, Stateful)


def _is_plain_tuple(o: Any) -> bool:
    return isinstance(o, tuple) and not hasattr(o, "_fields")


def _is_container(o: Any) -> bool:
    return isinstance(o, (dict, list)) or _is_plain_tuple(o)


# ---- one walk (the reference semantics) ----------------------------------------------------------
def snapshot_structure(
    obj: Any, clone_storages: set[int] | frozenset[int] = frozenset(), devices: set[torch.device] | None = None
) -> Any:
    """Copy the containers of a state dict, keep tensors by reference (zero copy),
    clone the tensors whose storage is in ``clone_storages``; top-level ``Stateful``
    values become their ``state_dict()``. The tensors' devices are added to ``devices``."""
    if not isinstance(obj, dict):
        raise TypeError(f"state_dict must be a dict, got {type(obj).__name__}")
    out, _ = _Builder(frozenset(clone_storages), devices if devices is not None else set()).top(obj)
    return out


@dataclasses.dataclass(slots=True, eq=False)
class _Node:
    """The remembered walk of one container: what to compare, and what to visit in Python."""

    kind: type  # the container's exact type
    keys: list[Any] | None  # a dict's keys, in order
    length: int
    tensor_at: Callable[[Any], Any] | None  # itemgetter of the tensor positions (None: no tensor)
    tensors: tuple[Any, ...]  # the tensors at those positions, held (their ids stay theirs)
    scalars: tuple[int, ...]  # positions of non-tensor, non-container values
    children: tuple[tuple[int, Any, _Node], ...]  # (position, key, node) of child containers
    clones: tuple[tuple[int, Any], ...]  # (position, key) of tensors cloned at each snapshot
    # Top level only: (position, key, the Stateful object, the node of its state_dict() or None).
    stateful: tuple[tuple[int, Any, Any, _Node | None], ...] = ()


class _Miss(Exception):
    """The state dict no longer has the remembered structure."""


class _Builder:
    """The full walk: builds the snapshot and, beside it, the program that replays it."""

    def __init__(self, clone_storages: frozenset[int], devices: set[torch.device]) -> None:
        self.clone_storages = clone_storages
        self.devices = devices

    def top(self, obj: dict[Any, Any]) -> tuple[dict[Any, Any], _Node]:
        vals = list(obj.values())
        stateful = {i for i, v in enumerate(vals) if _is_stateful(v)}
        out: dict[Any, Any] = dict.fromkeys(obj)  # the input's key order
        node = self._node(dict, list(obj), vals, out, skip=stateful)
        entries = []
        for i in sorted(stateful):
            k, v = node.keys[i], vals[i]  # type: ignore[index]
            out[k], child = self.walk(v.state_dict())
            entries.append((i, k, v, child))
        node.stateful = tuple(entries)
        return out, node

    def walk(self, o: Any) -> tuple[Any, _Node | None]:
        """(the snapshot of ``o``, its node, or None for a leaf)."""
        if isinstance(o, torch.Tensor):
            return self._leaf(o), None
        if isinstance(o, dict):
            out: Any = {} if type(o) is dict else type(o)()
            node = self._node(type(o), list(o), list(o.values()), out)
            return out, node
        if isinstance(o, list) or _is_plain_tuple(o):
            items: list[Any] = [None] * len(o)
            node = self._node(type(o), None, list(o), items)
            return (items if isinstance(o, list) else tuple(items)), node  # plain list / tuple out
        return o, None

    def _leaf(self, t: torch.Tensor) -> torch.Tensor:
        self.devices.add(getattr(t, "_local_tensor", t).device)
        if self.clone_storages and storage_key(t) in self.clone_storages:
            return clone_tensor(t)
        return t

    def _node(self, kind: type, keys: list[Any] | None, vals: list[Any], out: Any, skip: set[int] | None = None) -> _Node:
        tensor_pos: list[int] = []
        scalars: list[int] = []
        children: list[tuple[int, Any, _Node]] = []
        clones: list[tuple[int, Any]] = []
        for i, v in enumerate(vals):
            if skip and i in skip:
                continue
            k = keys[i] if keys is not None else i
            if isinstance(v, torch.Tensor):
                tensor_pos.append(i)
                snap = self._leaf(v)
                if snap is not v:
                    clones.append((i, k))
            else:
                snap, child = self.walk(v)
                if child is not None:
                    children.append((i, k, child))
                else:
                    scalars.append(i)
            out[k] = snap
        getter = operator.itemgetter(*tensor_pos) if tensor_pos else None
        tensors = tuple(vals[i] for i in tensor_pos)
        return _Node(kind, keys, len(vals), getter, tensors, tuple(scalars), tuple(children), tuple(clones))


# ---- the cache -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """One structural snapshot. ``generation``: equal for two snapshots of one
    :class:`StructureCache` iff they have the same structure and tensor objects
    (module docstring); ``reused``: this one was made by replaying the cached walk."""

    state_dict: dict[str, Any]
    devices: frozenset[torch.device]
    generation: int
    reused: bool


class StructureCache:
    """:func:`snapshot_structure` with the walk remembered and revalidated cheaply (module docstring).

    Not thread-safe: one caller (the training thread) at a time. ``clone_storages``: the
    storage keys of the tensors to clone at every snapshot (:func:`buffer_storages`).
    """

    _generations = itertools.count(1)

    def __init__(self, clone_storages: set[int] | frozenset[int] = frozenset()) -> None:
        self.clone_storages = frozenset(clone_storages)
        self._root: _Node | None = None
        self._devices: frozenset[torch.device] = frozenset()
        self._generation = 0
        self.walks = 0  # full walks (first snapshot and every structure change)
        self.reuses = 0  # snapshots made from the cached walk

    def snapshot(self, state_dict: dict[str, Any]) -> Snapshot:
        """The structural snapshot of ``state_dict`` (containers copied, tensors by reference)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        root = self._root
        if root is not None:
            try:
                out = _replay_top(root, state_dict, self.clone_storages)
            except _Miss:
                pass
            else:
                self.reuses += 1
                return Snapshot(state_dict=out, devices=self._devices, generation=self._generation, reused=True)
        devices: set[torch.device] = set()
        self._root = None  # a walk that raises leaves nothing cached
        out, root = _Builder(self.clone_storages, devices).top(state_dict)
        self._root, self._devices = root, frozenset(devices)
        self._generation = next(self._generations)
        self.walks += 1
        return Snapshot(state_dict=out, devices=self._devices, generation=self._generation, reused=False)

    def forget(self) -> None:
        """Drop the cached walk (and the references it holds); the next snapshot walks again."""
        self._root = None


def _replay_top(node: _Node, obj: dict[Any, Any], clone_storages: frozenset[int]) -> dict[Any, Any]:
    return _replay_items(node, obj, list(obj.values()), clone_storages, dict(obj), top=True)


def _replay(node: _Node, o: Any, clone_storages: frozenset[int]) -> Any:
    if type(o) is not node.kind:
        raise _Miss
    if node.keys is not None:
        if node.kind is dict:
            out = dict(o)  # type: ignore[call-overload]
        else:
            out = node.kind()
            out.update(o)
        return _replay_items(node, o, list(o.values()), clone_storages, out)  # type: ignore[attr-defined]
    vals = list(o)  # type: ignore[call-overload]
    out_list = _replay_items(node, o, vals, clone_storages, list(vals))
    return out_list if issubclass(node.kind, list) else tuple(out_list)


def _replay_items(node: _Node, o: Any, vals: list[Any], clone_storages: frozenset[int], out: Any, top: bool = False) -> Any:
    """Check ``o`` (its values ``vals``) against ``node`` and fill ``out`` (a shallow copy of it)."""
    if len(vals) != node.length or (node.keys is not None and list(o) != node.keys):
        raise _Miss
    if node.tensor_at is not None:
        got = node.tensor_at(vals)
        if len(node.tensors) == 1:
            if got is not node.tensors[0]:
                raise _Miss
        elif not all(map(_is, got, node.tensors)):
            raise _Miss
    for i in node.scalars:
        v = vals[i]
        if isinstance(v, torch.Tensor) or _is_container(v) or (top and _stateful_type(v)):
            raise _Miss
    for i, k, child in node.children:
        out[k] = _replay(child, vals[i], clone_storages)
    for i, k, obj, child in node.stateful:  # type: ignore[assignment]  # top level: state_dict() of the same Stateful objects
        if vals[i] is not obj:
            raise _Miss
        sd = obj.state_dict()
        if child is not None:
            out[k] = _replay(child, sd, clone_storages)
        elif isinstance(sd, torch.Tensor) or _is_container(sd):
            raise _Miss
        else:
            out[k] = sd
    for i, k in node.clones:
        t = vals[i]
        if storage_key(t) not in clone_storages:
            raise _Miss
        out[k] = clone_tensor(t)
    return out


def _stateful_type(v: Any) -> bool:
    """Whether a (new) top-level value is Stateful, decided once per type."""
    t = type(v)
    hit = _STATEFUL.get(t)
    if hit is None:
        hit = _STATEFUL[t] = _is_stateful(v)
    return hit
