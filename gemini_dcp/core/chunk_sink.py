"""The chunk sink: where a chunk read from any tier is verified and landed in its destination.

Every read path (the local tier, peer receives and repair rounds, the persistent store, the
operator commands) verifies a chunk against the checksum its record names before a byte of
it reaches a caller's tensor, and reports a corrupt chunk with the one message built here.
"""

from __future__ import annotations

from torch.distributed.checkpoint.planner import ReadItem

from ..errors import ChecksumMismatchError
from ..local.records import ShardRef

__all__ = ["corrupt_error", "describe_item"]


def describe_item(item: ReadItem, ref: ShardRef, step: int) -> str:
    """``shard 'fqn' (offset (..)) of step N, saved by rank R``: how messages name a chunk."""
    idx = item.storage_index
    return f"shard {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}, saved by rank {ref.rank}"


def corrupt_error(item: ReadItem, ref: ShardRef, step: int, sources: str) -> ChecksumMismatchError:
    """The error for a chunk that failed its checksum in every copy tried (``sources`` names them)."""
    return ChecksumMismatchError(
        f"{describe_item(item, ref, step)} failed its {ref.algo} checksum in every copy tried ({sources}); "
        "the checkpoint bytes were corrupted in memory. Nothing was copied into the state dict. "
        "Load an older step (checkpoint_id=...) or the persistent tier."
    )
