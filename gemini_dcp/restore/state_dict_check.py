"""Does the state dict being loaded match the checkpoint? The reader's key/shape check.

DCP's own planner raises a bare RuntimeError / ValueError for a missing key or a size
mismatch, deep inside its planning; ``GeminiStorageReader`` runs this check first (from
``set_up_storage_reader`` when it can see the planner, else in ``read_data``) so that the
caller gets one :class:`~gemini_dcp.errors.CheckpointMismatchError` naming the step, the
launch that saved it and the offending keys, before any byte moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from ..core.compat import global_shape
from ..errors import CheckpointMismatchError
from ..local.record_types import StepRecord

__all__ = ["Mismatch", "find_mismatch", "planner_set_up_with", "resolve_destinations", "saved_by"]

MISMATCH_KEYS_SHOWN = 5  # offending keys named in a CheckpointMismatchError

ShapeMismatch = tuple[str, tuple[int, ...], tuple[int, ...]]  # (key, saved size, requested size)


@dataclass(frozen=True, slots=True, kw_only=True)
class Mismatch:
    """Keys of the state dict missing from the checkpoint and tensors (``what``) of another shape."""

    missing: tuple[str, ...] = ()
    shapes: tuple[ShapeMismatch, ...] = ()
    what: str = "tensor(s)"

    def error(self, *, step: int | None, job_id: str, saved_by: str) -> CheckpointMismatchError:
        """The error to raise, naming the step, its job and the launch that saved it (``saved_by``)."""
        parts = []
        if self.missing:
            shown = ", ".join(repr(k) for k in self.missing[:MISMATCH_KEYS_SHOWN])
            more = f" and {len(self.missing) - MISMATCH_KEYS_SHOWN} more" if len(self.missing) > MISMATCH_KEYS_SHOWN else ""
            parts.append(f"{len(self.missing)} key(s) of the state dict are not in the checkpoint: {shown}{more}")
        if self.shapes:
            shown = ", ".join(f"{k!r} saved {s} requested {r}" for k, s, r in self.shapes[:MISMATCH_KEYS_SHOWN])
            more = f" and {len(self.shapes) - MISMATCH_KEYS_SHOWN} more" if len(self.shapes) > MISMATCH_KEYS_SHOWN else ""
            parts.append(f"{len(self.shapes)} {self.what} with another shape: {shown}{more}")
        err = CheckpointMismatchError(
            f"step {step} of job {job_id!r} (saved by {saved_by}) does not match the state dict being "
            f"loaded: {'; '.join(parts)}. Nothing was copied into the state dict. The tier holds another "
            "model's checkpoint under this job id, or the model changed since that save: load it with the "
            "model that saved it, give this model its own job_id (or root), or, for keys that are new, "
            "load the rest with dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=True))."
        )
        err.step = step  # type: ignore[attr-defined]
        err.missing_keys = self.missing  # type: ignore[attr-defined]
        err.shape_mismatches = self.shapes  # type: ignore[attr-defined]
        return err


def find_mismatch(planner: LoadPlanner, metadata: Metadata | None) -> Mismatch | None:
    """Keys of the planner's state dict missing from ``metadata`` (unless the planner allows a
    partial load) and tensors whose saved size differs from the requested one; None if it matches
    or the planner shows no state dict."""
    sd = getattr(planner, "state_dict", None)
    if not isinstance(sd, Mapping) or metadata is None:
        return None
    saved = metadata.state_dict_metadata
    strict = not getattr(planner, "allow_partial_load", False)
    missing: list[str] = []
    shapes: list[ShapeMismatch] = []
    for fqn, obj in sd.items():
        smd = saved.get(fqn)
        if smd is None:
            if strict:
                missing.append(str(fqn))
            continue
        size = getattr(obj, "size", None)
        if isinstance(smd, TensorStorageMetadata) and isinstance(obj, torch.Tensor) and callable(size):
            want = global_shape(obj)  # a CheckpointableTensor (torch >= 2.15) is a slice of a larger tensor
            if tuple(smd.size) != want:
                shapes.append((str(fqn), tuple(smd.size), want))
    if not missing and not shapes:
        return None
    return Mismatch(missing=tuple(missing), shapes=tuple(shapes), what="tensor(s)")


def resolve_destinations(plan: LoadPlan, planner: LoadPlanner, dests: dict[int, torch.Tensor]) -> Mismatch | None:
    """Resolve every tensor item's destination once into ``dests`` (``id(item)`` -> tensor) and check
    each has the chunk's size; on a mismatch ``dests`` is emptied and the mismatch returned."""
    bad: list[ShapeMismatch] = []
    for item in plan.items:
        if item.type == LoadItemType.BYTE_IO:
            continue
        dest = planner.resolve_tensor(item).detach()
        if tuple(dest.size()) != tuple(item.lengths):
            bad.append((item.dest_index.fqn, tuple(item.lengths), tuple(dest.size())))
            continue
        dests[id(item)] = dest
    if bad:
        dests.clear()
        return Mismatch(shapes=tuple(bad), what="chunk(s)")
    return None


def saved_by(record: StepRecord | None) -> str:
    """``launch <description> (<id>)``: the launch that saved ``record``, for messages."""
    desc = getattr(record, "launch_description", "") if record is not None else ""
    lid = getattr(record, "launch_id", "") if record is not None else ""
    if desc or lid:
        return f"launch {desc or '?'} ({lid or '?'})"
    if record is None:
        return "a launch the persistent tier does not record"
    return "a launch its record does not name"


def planner_set_up_with(metadata: Metadata, frame: Any) -> LoadPlanner | None:
    """The LoadPlanner that DCP set up with ``metadata`` just before calling ``set_up_storage_reader``.

    DCP hands a storage reader no state dict before its planner plans, and the planner
    raises its own bare RuntimeError / ValueError there for a missing key or a size
    mismatch. ``dcp.load`` calls ``planner.set_up_planner(state_dict, metadata)`` and then
    ``storage_reader.set_up_storage_reader(metadata)`` from one function: the planner is a
    local of the calling frame (``frame``). Only a planner whose ``metadata`` *is* this object
    (set up for this very load) is used; anything else (another caller, a torch that calls it
    otherwise) gives None, and the check runs in ``read_data`` instead.
    """
    try:
        values = list(frame.f_locals.values()) if frame is not None else []
    except Exception:  # noqa: BLE001 - an optimisation of where the error comes from, never required
        return None
    for v in values:
        if isinstance(v, LoadPlanner) and getattr(v, "metadata", None) is metadata:
            return v
    return None
