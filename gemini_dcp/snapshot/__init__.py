"""Per-step zero-stall snapshots: the async checkpointer, its traffic interleaving and plan replay."""

from .checkpointer import (
    AsyncCheckpointer,
    AsyncCheckpointError,
    AsyncGeminiStorageWriter,
    InterleaveOptions,
    SnapshotHandle,
    checkpoint_group,
    snapshot_structure,
)

__all__ = [
    "AsyncCheckpointer",
    "AsyncCheckpointError",
    "AsyncGeminiStorageWriter",
    "InterleaveOptions",
    "SnapshotHandle",
    "checkpoint_group",
    "snapshot_structure",
]
