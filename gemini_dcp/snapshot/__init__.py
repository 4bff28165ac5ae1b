"""Per-step zero-stall snapshots: the async checkpointer, its traffic interleaving and plan replay.

==========================  ======================================================================
:mod:`.checkpointer`        ``AsyncCheckpointer`` (the recommended per-step path)
:mod:`.structure`           what ``save()`` does before it returns: the structural snapshot, cached
:mod:`.handles`             ``SnapshotHandle``, ``AsyncCheckpointError``, ``checkpoint_group``
:mod:`.async_writer`        ``AsyncGeminiStorageWriter`` (``dcp.async_save``)
:mod:`.replay`              plan replay (``PlanReplay``); :mod:`.replay_check` its fast plan check
:mod:`.interleave`          traffic interleaving: :mod:`.profiler`, :mod:`.gaps`, :mod:`.pacer`
==========================  ======================================================================
"""

from .async_writer import AsyncGeminiStorageWriter
from .checkpointer import AsyncCheckpointer, InterleaveOptions
from .handles import AsyncCheckpointError, SnapshotHandle, checkpoint_group
from .structure import snapshot_structure

__all__ = [
    "AsyncCheckpointer",
    "AsyncCheckpointError",
    "AsyncGeminiStorageWriter",
    "InterleaveOptions",
    "SnapshotHandle",
    "checkpoint_group",
    "snapshot_structure",
]
