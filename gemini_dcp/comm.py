"""The control plane: a dedicated gloo process group for checkpoint traffic.

Checkpoint collectives never run on the training group, so they cannot
deadlock with, or reorder, training collectives (even when training uses NCCL
or its own gloo group). The group is created once per process and shared by
every writer and reader: **all ranks must reach the first save/load together**,
as ``torch.distributed.new_group`` is collective.

Without an initialized process group everything degrades to a single process.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


class Comm:
    """Collectives over the checkpoint control group; a trivial one for a single process."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def all_gather_object(self, obj: T) -> list[T]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: T, src: int) -> T:
        """Broadcast ``obj`` from group rank ``src`` to all ranks."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


def get_comm(timeout_s: float, process_group: dist.ProcessGroup | None = None) -> Comm:
    """The control-plane Comm for the ranks of ``process_group`` (default: WORLD).

    Collective on first use: all ranks of the default group must call it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return Comm(None)
    base = process_group or dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(base))
    group = _GROUPS.get(ranks)
    if group is None:
        if len(ranks) == 1:
            return Comm(None)
        group = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s))
        _GROUPS[ranks] = group
    return Comm(group)


def reset_groups() -> None:
    """Forget cached groups (after ``destroy_process_group``)."""
    _GROUPS.clear()
