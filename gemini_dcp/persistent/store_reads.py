"""Reading the items of a committed step back from the persistent store, verified.

Every item is checked through the chunk sink (:mod:`gemini_dcp.core.chunk_sink`) against the
checksum recorded when it was saved — the in-memory ShardRef when the planner's metadata comes
from a memory record (a mixed restore of the same step), else the step's ``index.pkl`` — before
it is handed on. A stock checkpoint written without gemini_dcp has no index: its items are read
unverified (the tier logs that once per step). A corrupt item raises
:class:`PersistentChecksumError` (a ``PersistentTierError`` and a ``ChecksumMismatchError``)
with the sink's one message.

A tensor item is read straight into a fresh tensor of its saved dtype, its checksum taken block
by block as the bytes arrive (:mod:`.item_payload`: the payload range of its torch.save zip),
``torch.load`` of the whole item being the fallback for any other layout; the items of local
files are read by a few threads at once. Nothing is staged or landed unless every item of the
call was read and verified.
"""

from __future__ import annotations

import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from ..core.checksum import checksum
from ..core.chunk_sink import StagedChunks, check_chunk, corrupt_message
from ..core.regular_file import open_regular
from ..errors import ChecksumMismatchError, PersistentTierError
from ..local.record_types import ShardRef
from .item_payload import ItemWindow, MappedFile, ReadAt, flat_bytes, payload_layout, read_exact, read_hashing
from .side_files import StepIndex

if TYPE_CHECKING:
    from .store import PersistentTier

__all__ = [
    "MAX_READ_THREADS",
    "PersistentChecksumError",
    "expected_checksum",
    "load_item",
    "read_item_bytes",
    "read_items",
    "read_stored",
    "read_workers",
    "verify_item",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
MAX_READ_THREADS = 4  # past the cores (a 2-core host reads with 2) the copies contend for memory bandwidth


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


def _torch_load(raw: bytes | bytearray, what: str) -> torch.Tensor:
    try:
        t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise PersistentTierError(f"{what} is not a readable torch.save tensor: {exc}") from exc
    if not isinstance(t, torch.Tensor):
        raise PersistentTierError(f"{what} holds a {type(t).__name__}, not a tensor.")
    return t


def read_workers(n_items: int) -> int:
    """Threads reading one load's items from local files: sized to the host, at least 2 (one
    waits on the disk while another hashes), at most :data:`MAX_READ_THREADS`."""
    return max(1, min(n_items, MAX_READ_THREADS, max(2, os.cpu_count() or 1)))


@dataclass(frozen=True, kw_only=True, slots=True)
class _Task:
    """One stored item to read: where it is, what it serves, what it must hash to."""

    index: MetadataIndex
    info: _StorageInfo
    is_bytes: bool
    expect: tuple[str, int] | None
    what: str     # the item, as messages name it
    shown: str    # its data file, as messages name it


def read_stored(read_at: ReadAt, task: _Task) -> torch.Tensor | bytearray:
    """One item read through ``read_at`` and verified: the tensor as saved, or a bytes item's bytes.

    A tensor whose torch.save payload is its own bytes is read straight into a fresh tensor,
    hashed block by block as it arrives (:mod:`.item_payload`); any other item is read whole
    and given to ``torch.load``. Raises PersistentTierError (truncated, unreadable),
    PersistentChecksumError (bytes that differ from those saved: nothing is returned).
    """
    info, expect = task.info, task.expect
    sources = f"persistent store {task.shown}"
    if not task.is_bytes:
        layout = payload_layout(ItemWindow(read_at, info.offset, info.length))
        if layout is not None:
            out = torch.empty(layout.shape, dtype=layout.dtype)
            got, value = read_hashing(read_at, flat_bytes(out), info.offset + layout.offset, expect[0] if expect else None)
            if got != layout.nbytes:
                raise PersistentTierError(f"{task.shown} is truncated: item {task.index.fqn!r} needs bytes {info.offset}+{info.length}.")
            if expect is not None and value != expect[1]:
                raise PersistentChecksumError(corrupt_message(task.what, expect[0], sources))
            return out
    raw = bytearray(info.length)
    if read_exact(read_at, memoryview(raw), info.offset) != info.length:
        raise PersistentTierError(f"{task.shown} is truncated: item {task.index.fqn!r} needs bytes {info.offset}+{info.length}.")
    stored: torch.Tensor | bytearray = raw if task.is_bytes else _torch_load(raw, f"{task.what} in {task.shown}")
    verify_item(stored, expect, task.what, sources)  # type: ignore[arg-type]
    return stored


def read_items(
    tier: PersistentTier,
    step: int,
    plan: LoadPlan,
    planner: LoadPlanner,
    *,
    stage: StagedChunks | None = None,
    keep: Callable[[MappedFile], None] | None = None,
) -> int:
    """Read ``plan``'s items of ``step``, verified; returns the stored bytes read.

    ``stage``: each verified item is held there (the tensor in its saved dtype, or a bytes
    item's raw bytes) for the caller to land once everything is verified (the reader's
    all-or-nothing load); nothing is added to it unless every item was read and verified.
    Without it, the items land in the planner's tensors / ``load_bytes`` once every one of
    them is verified. Items of local files are read by a few threads (:func:`read_workers`).
    Raises PersistentTierError (PersistentChecksumError for bad bytes).
    """
    md, index = tier.read_metadata(step), tier.read_index(step)
    planner_sd = getattr(getattr(planner, "metadata", None), "storage_data", None) or {}
    by_index: dict[MetadataIndex, list[ReadItem]] = {}
    for item in plan.items:
        by_index.setdefault(item.storage_index, []).append(item)
    per_file: dict[str, list[_Task]] = {}
    for idx, items in by_index.items():
        info = md.storage_data.get(idx)
        if not isinstance(info, _StorageInfo):
            raise PersistentTierError(
                f"step {step} in {tier.url}: no item {idx.fqn!r} (offset {tuple(idx.offset or ())}) in its .metadata."
            )
        path = f"{tier.step_path(step)}/{info.relative_path}"
        per_file.setdefault(path, []).append(
            _Task(
                index=idx, info=info, is_bytes=items[0].type == LoadItemType.BYTE_IO,
                expect=expected_checksum(planner_sd.get(idx), index, idx),
                what=f"item {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}", shown=tier.shown(path),
            )
        )
    for tasks in per_file.values():
        tasks.sort(key=lambda t: t.info.offset)
    if tier.is_local:
        files = {path: _map(path, tier) for path in per_file}
        for path, tasks in per_file.items():
            if keep is not None:
                keep(files[path])
            for task in tasks:
                files[path].prefetch(task.info.offset, task.info.length)
        jobs: list[tuple[Callable[[], torch.Tensor | bytearray], _Task]] = [
            (partial(_guarded, partial(stage_mapped, files[path], task), task), task)
            for path, tasks in per_file.items() for task in tasks
        ]
    else:
        jobs = [
            (partial(_guarded, partial(_read_fetched, tier, path, task), task), task)
            for path, tasks in per_file.items() for task in tasks
        ]
    results = _run([job for job, _ in jobs], parallel=tier.is_local)
    held = stage if stage is not None else StagedChunks()
    for (_, task), stored in zip(jobs, results):
        held.add(by_index[task.index], stored)  # type: ignore[arg-type]  # the saved dtype: converted as it lands
    if stage is None:
        held.land_all(planner)
    return sum(task.info.length for _, task in jobs)


def stage_mapped(mapped: MappedFile, task: _Task) -> torch.Tensor | bytearray:
    """One item of a mapped local file, verified, staged in place: a read-only view of the page
    cache (no copy until it lands), or a bytes item's bytes. Errors as :func:`read_stored`."""
    info, expect = task.info, task.expect
    if not task.is_bytes:
        layout = payload_layout(ItemWindow(mapped.read_at, info.offset, info.length))
        if layout is not None and info.offset + layout.offset + layout.nbytes <= mapped.size:
            start = info.offset + layout.offset
            mapped.populate(start, layout.nbytes)
            view = mapped.typed_view(start, layout.dtype, layout.shape)
            if expect is not None and layout.nbytes:
                raw = mapped.typed_view(start, torch.uint8, (layout.nbytes,))
                if checksum(raw, expect[0]) != expect[1]:
                    raise PersistentChecksumError(corrupt_message(task.what, expect[0], f"persistent store {task.shown}"))
            elif expect is not None:
                verify_item(view, expect, task.what, f"persistent store {task.shown}")
            return view
    return read_stored(mapped.read_at, task)


def _read_fetched(tier: PersistentTier, path: str, task: _Task) -> torch.Tensor | bytearray:
    return read_stored(_fetched_reader(tier, path, task.info), task)


def _map(path: str, tier: PersistentTier) -> MappedFile:
    try:
        return MappedFile(path)
    except Exception as exc:  # noqa: BLE001
        raise PersistentTierError(f"cannot read {tier.shown(path)}: {type(exc).__name__}: {exc}") from exc


def _run(jobs: list[Callable[[], _T]], *, parallel: bool) -> list[_T]:
    """Every job's result, in order; the first failure is raised once the jobs in flight end."""
    workers = read_workers(len(jobs)) if parallel else 1
    if workers <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gemini-dcp-pread") as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise  # the pool's exit joins the reads still running: no thread outlives the load


def _guarded(read: Callable[[], _T], task: _Task) -> _T:
    """``read()``, any error but ours turned into a PersistentTierError naming ``task``'s file."""
    try:
        return read()
    except (PersistentTierError, ChecksumMismatchError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise PersistentTierError(f"cannot read {task.shown}: {type(exc).__name__}: {exc}") from exc


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


def _fetched_reader(tier: PersistentTier, path: str, info: _StorageInfo) -> ReadAt:
    """``read_at`` over one item of a remote (or ``memory://``) data file: its bytes fetched in
    one bounded call (``tier.call``), the reads served from them."""
    end = info.offset + info.length
    try:
        raw = tier.call(f"read of {info.length} bytes at {info.offset} of", path, tier.fs.cat_file, path, start=info.offset, end=end)
    except (PersistentTierError, ChecksumMismatchError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise PersistentTierError(f"cannot read {tier.shown(path)}: {type(exc).__name__}: {exc}") from exc
    data = memoryview(raw)

    def read_at(buf: memoryview, off: int) -> int:
        lo = off - info.offset
        if lo < 0 or lo >= len(data):
            return 0
        n = min(len(buf), len(data) - lo)
        buf[:n] = data[lo : lo + n]
        return n

    return read_at


def read_item_bytes(tier: PersistentTier, step: int, idx: MetadataIndex) -> tuple[bytes, bool]:
    """Raw stored bytes of one item (torch.save bytes for a tensor) and whether it is a bytes item."""
    md = tier.read_metadata(step)
    info = md.storage_data[idx]
    path = f"{tier.step_path(step)}/{info.relative_path}"
    raw = tier.call("read of", path, tier.fs.cat_file, path, start=info.offset, end=info.offset + info.length)
    return raw, isinstance(md.state_dict_metadata.get(idx.fqn), BytesStorageMetadata)


def load_item(tier: PersistentTier, step: int, idx: MetadataIndex, expect: tuple[str, int] | None = None) -> torch.Tensor:
    """One stored item as a private tensor (uint8 for bytes items), verified against ``expect``
    (``(algo, checksum)``), else against the step's index."""
    md = tier.read_metadata(step)
    info = md.storage_data.get(idx)
    if not isinstance(info, _StorageInfo):
        raise PersistentTierError(f"step {step} in {tier.url}: no item {idx.fqn!r} (offset {tuple(idx.offset or ())}) in its .metadata.")
    path = f"{tier.step_path(step)}/{info.relative_path}"
    task = _Task(
        index=idx, info=info, is_bytes=isinstance(md.state_dict_metadata.get(idx.fqn), BytesStorageMetadata),
        expect=expect if expect is not None else expected_checksum(None, tier.read_index(step), idx),
        what=f"item {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step}", shown=tier.shown(path),
    )
    if tier.is_local:
        with ExitStack() as files:
            try:
                fd = open_regular(path)
            except Exception as exc:  # noqa: BLE001
                raise PersistentTierError(f"cannot read {task.shown}: {type(exc).__name__}: {exc}") from exc
            files.callback(os.close, fd)
            stored = _guarded(partial(read_stored, partial(_pread, fd), task), task)
    else:
        stored = _guarded(partial(_read_fetched, tier, path, task), task)
    if isinstance(stored, torch.Tensor):
        return stored
    return torch.frombuffer(stored, dtype=torch.uint8) if stored else torch.empty(0, dtype=torch.uint8)
