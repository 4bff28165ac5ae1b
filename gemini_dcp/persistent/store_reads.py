"""Reading the items of a committed step back from the persistent store, verified.

Every item is checked through the chunk sink (:mod:`gemini_dcp.core.chunk_sink`) against the
checksum recorded when it was saved — the in-memory ShardRef when the planner's metadata comes
from a memory record (a mixed restore of the same step), else the step's ``index.pkl`` — before
it is handed on. A stock checkpoint written without gemini_dcp has no index: its items are read
unverified (the tier logs that once per step). A corrupt item raises
:class:`PersistentChecksumError` (a ``PersistentTierError`` and a ``ChecksumMismatchError``)
with the sink's one message.
"""

from __future__ import annotations

import io
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from ..core.chunk_sink import StagedChunks, check_chunk
from ..errors import ChecksumMismatchError, PersistentTierError
from ..local.records import ShardRef
from .side_files import StepIndex

if TYPE_CHECKING:
    from .store import PersistentTier

__all__ = ["PersistentChecksumError", "expected_checksum", "load_item", "read_item_bytes", "read_items", "verify_item"]

log = logging.getLogger(__name__)


class PersistentChecksumError(PersistentTierError, ChecksumMismatchError):
    """An item read from the persistent tier does not match the checksum recorded when it was saved."""


def expected_checksum(planner_ref: Any, index: StepIndex | None, idx: MetadataIndex) -> tuple[str, int] | None:
    """``(algo, value)`` an item must match: its ShardRef's if the planner has one, else the index's."""
    if isinstance(planner_ref, ShardRef):
        return (planner_ref.algo, planner_ref.checksum)
    if index is not None:
        return index.checksums.get(idx)
    return None


def verify_item(data: torch.Tensor | bytes, expect: tuple[str, int] | None, what: str, source: str) -> None:
    """Check one item read from the store (its tensor, or a bytes item's raw bytes) against ``expect``."""
    if expect is not None:
        check_chunk(data, expect[0], expect[1], what=what, sources=source, error=PersistentChecksumError)


def _torch_load(raw: bytes, what: str) -> torch.Tensor:
    try:
        t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise PersistentTierError(f"{what} is not a readable torch.save tensor: {exc}") from exc
    if not isinstance(t, torch.Tensor):
        raise PersistentTierError(f"{what} holds a {type(t).__name__}, not a tensor.")
    return t


def read_items(
    tier: PersistentTier, step: int, plan: LoadPlan, planner: LoadPlanner, *, stage: StagedChunks | None = None
) -> int:
    """Read ``plan``'s items of ``step``, verified; returns the stored bytes read.

    ``stage``: each verified item is held there (the tensor in its saved dtype, or a bytes
    item's raw bytes) for the caller to land once everything is verified (the reader's
    all-or-nothing load). Without it, the items land in the planner's tensors /
    ``load_bytes`` once every one of them is verified.
    Raises PersistentTierError (PersistentChecksumError for bad bytes).
    """
    md, index = tier.read_metadata(step), tier.read_index(step)
    planner_sd = getattr(getattr(planner, "metadata", None), "storage_data", None) or {}
    by_index: dict[MetadataIndex, list[ReadItem]] = {}
    for item in plan.items:
        by_index.setdefault(item.storage_index, []).append(item)
    per_file: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
    for idx in by_index:
        info = md.storage_data.get(idx)
        if not isinstance(info, _StorageInfo):
            raise PersistentTierError(
                f"step {step} in {tier.url}: no item {idx.fqn!r} (offset {tuple(idx.offset or ())}) in its .metadata."
            )
        per_file.setdefault(info.relative_path, []).append((idx, info))
    held = stage if stage is not None else StagedChunks()
    total = 0
    for rel, entries in per_file.items():
        entries.sort(key=lambda e: e[1].offset)
        path = f"{tier.step_path(step)}/{rel}"
        shown = tier.shown(path)
        try:
            f = tier.call("open of", path, tier.fs.open, path, "rb", block_size=8 << 20)
            try:
                for idx, info in entries:
                    f.seek(info.offset)
                    raw = tier.call(f"read of {info.length} bytes at {info.offset} of", path, f.read, info.length)
                    if len(raw) != info.length:
                        raise PersistentTierError(
                            f"{shown} is truncated: item {idx.fqn!r} needs bytes {info.offset}+{info.length}."
                        )
                    what = f"item {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}"
                    items = by_index[idx]
                    stored: torch.Tensor | bytes
                    if items[0].type == LoadItemType.BYTE_IO:
                        stored = raw
                    else:
                        stored = _torch_load(raw, f"{what} in {shown}")
                    verify_item(stored, expected_checksum(planner_sd.get(idx), index, idx), what, f"persistent store {shown}")
                    held.add(items, stored)  # the saved dtype: converted as it lands
                    total += info.length
            finally:
                try:
                    tier.call("close of", path, f.close)
                except Exception as exc:  # noqa: BLE001 - a read-only handle; what was read stands
                    log.debug("closing %s failed: %s", shown, exc)
        except (PersistentTierError, ChecksumMismatchError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot read {shown}: {type(exc).__name__}: {exc}") from exc
    if stage is None:
        held.land_all(planner)
    return total


def read_item_bytes(tier: PersistentTier, step: int, idx: MetadataIndex) -> tuple[bytes, bool]:
    """Raw stored bytes of one item (torch.save bytes for a tensor) and whether it is a bytes item."""
    md = tier.read_metadata(step)
    info = md.storage_data[idx]
    path = f"{tier.step_path(step)}/{info.relative_path}"
    raw = tier.call("read of", path, tier.fs.cat_file, path, start=info.offset, end=info.offset + info.length)
    return raw, isinstance(md.state_dict_metadata.get(idx.fqn), BytesStorageMetadata)


def load_item(tier: PersistentTier, step: int, idx: MetadataIndex) -> torch.Tensor:
    """One stored item as a tensor (uint8 for bytes items), verified against the index."""
    raw, is_bytes = read_item_bytes(tier, step, idx)
    what = f"item {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}"
    if is_bytes:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    else:
        t = _torch_load(raw, f"{what} in {tier.url}")
    verify_item(t, expected_checksum(None, tier.read_index(step), idx), what, f"persistent store {tier.url}")
    return t
