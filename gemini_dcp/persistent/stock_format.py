"""Write a committed step as a stock DCP checkpoint (FileSystemWriter / FsspecWriter layout).

The format written here is exactly what torch's ``FileSystemReader.read_data``
reads: ``.metadata`` is a pickled :class:`Metadata` whose ``storage_data`` maps
every ``MetadataIndex`` to ``_StorageInfo(relative_path, offset, length)``; each
tensor item is ``torch.save(tensor)`` bytes inside a data file and each bytes
item is stored raw; data files are named ``__<rank>_0.distcp`` after the saving
rank. No transform extensions are used (``transform_descriptors`` stays unset,
as FileSystemWriter leaves it without extensions).

Every item is verified against the checksum taken when it was saved, right
before its bytes are serialized, so corrupt memory is never made durable.

Entry points:

* :func:`write_rank_file` / :func:`try_finalize` — the pieces the background
  drain (``gemini_dcp.persistent.drain``) is built from.
* :func:`open_step` — a step's items readable from this host (local memory
  records, else the persistent tier), also used by ``gemini_dcp.persistent.export``.
* :func:`materialize_step` — write a step to any fsspec URL as a stock
  checkpoint (the CLI's ``flush`` and ``restore``).
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ..core.chunk_sink import check_chunk, copy_verified, stored_view
from ..core.compat import DCP_FORMAT_VERSION, metadata_kwargs
from ..core.config import resolve_node_id, resolve_root
from ..core.timelines import newest as newest_lineage
from ..errors import (
    ConfigError,
    PersistentTierError,
    ShardUnavailableError,
    StepNotFoundError,
    TierRootError,
)
from ..local.record_types import ShardRef, StepRecord
from ..local.slots import ReadOnlySlot
from ..local.tier import LocalTier
from .side_files import PartMarker, StepIndex, data_file, node_tag
from .step_dir import StepDir
from .store import PersistentTier
from .store_calls import PersistentTimeoutError

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
_RANK_FILE_RE = re.compile(r"^__([0-9]+)_")


@dataclass(frozen=True, slots=True)
class StockItem:
    """One stored item of a step: a tensor chunk (``dtype``/``shape``) or a bytes blob (``dtype`` None)."""

    index: MetadataIndex
    rank: int                          # saving rank: its data file is __<rank>_0.distcp
    dtype: str | None
    shape: tuple[int, ...] | None
    length: int                        # raw bytes (tensor bytes, not torch.save bytes)
    algo: str | None = None
    checksum: int | None = None
    offset: int = 0                    # offset in the saving rank's slot (memory items)

    @property
    def is_bytes(self) -> bool:
        return self.dtype is None

    @property
    def name(self) -> str:
        off = tuple(self.index.offset or ())
        return f"{self.index.fqn}{list(off) if off else ''}@rank{self.rank}"


def items_of_record(record: StepRecord, ranks: Iterable[int] | None = None) -> list[StockItem]:
    """The items of ``record`` (of ``ranks`` only, if given), ordered by rank then slot offset."""
    want = None if ranks is None else set(ranks)
    out = []
    for idx, ref in record.metadata.storage_data.items():
        if not isinstance(ref, ShardRef) or (want is not None and ref.rank not in want):
            continue
        out.append(StockItem(idx, ref.rank, ref.dtype, ref.shape, ref.length, ref.algo, ref.checksum, ref.offset))
    out.sort(key=lambda it: (it.rank, it.offset))
    return out


def typed(raw: torch.Tensor, item: StockItem) -> torch.Tensor:
    """View flat uint8 bytes as the item's tensor (dtype and shape); bytes items stay uint8."""
    if item.dtype is None:
        return raw
    return stored_view(raw, getattr(torch, item.dtype), tuple(item.shape or ()), item.name)


def exact_view(buf: Any, offset: int, length: int) -> torch.Tensor:
    """A uint8 tensor over ``buf[offset:offset+length]`` whose storage is exactly those bytes.

    ``torch.save`` writes a tensor's whole storage, so a slice of a larger
    mapping must not be saved; this view has its own, exact storage (zero copy).
    """
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mappings
        return torch.frombuffer(buf, dtype=torch.uint8, count=length, offset=offset)


def verify(raw: torch.Tensor, item: StockItem, what: str) -> None:
    """Check an item's bytes before they are serialized (ChecksumMismatchError; nothing uploaded then)."""
    if item.algo is None or item.checksum is None:
        return
    check_chunk(raw, item.algo, item.checksum, what=f"{item.name} of {what}", sources="memory, before upload")


# ---- writing -------------------------------------------------------------------------------------
def write_rank_file(
    dest: StepDir,
    rel: str,
    items: list[StockItem],
    read: Callable[[StockItem], torch.Tensor],
    *,
    progress: Callable[[int], None] | None = None,
    throttle_bps: float | None = None,
) -> tuple[dict[MetadataIndex, _StorageInfo], dict[MetadataIndex, tuple[str, int]], int]:
    """Write ``items`` into the data file ``rel`` of ``dest`` as FileSystemWriter would.

    ``read(item)`` returns the item's verified tensor (exact storage). Returns
    the storage infos, the checksums and the bytes written.
    """
    storage: dict[MetadataIndex, _StorageInfo] = {}
    sums: dict[MetadataIndex, tuple[str, int]] = {}
    t_start = time.monotonic()
    raw_total = 0
    f = dest.open_write(rel)
    try:
        for item in items:
            t = read(item)
            start = f.tell()
            if item.is_bytes:
                if t.numel():
                    f.write(memoryview(t.numpy()))
            else:
                torch.save(t, f)
            end = f.tell()
            storage[item.index] = _StorageInfo(rel, start, end - start)
            if item.algo is not None and item.checksum is not None:
                sums[item.index] = (item.algo, item.checksum)
            raw_total += item.length
            if progress is not None:
                progress(item.length)
            if throttle_bps:
                ahead = raw_total / throttle_bps - (time.monotonic() - t_start)
                if ahead > 0:
                    time.sleep(ahead)
        written = f.tell()
        if dest.is_local:
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            f.close()
        finally:
            raise
    f.close()
    return storage, sums, written


def stock_metadata(metadata: Metadata, storage: dict[MetadataIndex, _StorageInfo], checkpoint_id: str, save_id: str) -> Metadata:
    """The ``.metadata`` of a stock checkpoint: the step's DCP metadata with file storage infos."""
    return Metadata(
        **metadata_kwargs(
            state_dict_metadata=metadata.state_dict_metadata,
            planner_data=metadata.planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
            version=DCP_FORMAT_VERSION,
        )
    )


def try_finalize(
    dest: StepDir,
    step: int,
    metadata: Metadata,
    fingerprint: str,
    expected: Iterable[MetadataIndex],
    job_id: str,
    *,
    prefer_node: dict[int, str] | None = None,
) -> tuple[bool, list[MetadataIndex]]:
    """Write ``.metadata`` if the part markers of ``dest`` (same save) cover every expected item.

    Each node writes its marker *before* calling this, so of nodes finishing
    at the same time at least one sees all markers. Returns (committed, missing).
    """
    markers = [m for m in dest.read_markers() if m.fingerprint == fingerprint and m.step == step]
    # Prefer a rank's origin node when several nodes wrote the same rank (replicas flushed twice).
    prefer = prefer_node or {}
    markers.sort(key=lambda m: 0 if any(prefer.get(r) == m.node_id for r in m.ranks) else 1)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    sums: dict[MetadataIndex, tuple[str, int]] = {}
    for m in reversed(markers):  # first (preferred) marker wins
        storage.update(m.storage)
        sums.update(m.checksums)
    expected = list(expected)
    missing = [idx for idx in expected if idx not in storage]
    if missing:
        return False, missing
    storage = {idx: storage[idx] for idx in expected}
    md = stock_metadata(metadata, storage, dest.url, fingerprint)
    index = StepIndex(step, fingerprint, {i: sums[i] for i in expected if i in sums}, tuple(sorted({m.node_id for m in markers})), job_id)
    dest.commit(md, index)
    return True, []


# ---- reading a step from this host -----------------------------------------------------------------
@dataclass
class StepSource:
    """A step's items as readable from this host: local memory where held, else the persistent tier."""

    step: int
    job_id: str
    metadata: Metadata                 # DCP metadata (state_dict_metadata is what matters)
    fingerprint: str
    items: list[StockItem]
    where: dict[MetadataIndex, str]    # "memory" | "persistent"; absent: unavailable here
    rank_nodes: tuple[str, ...] = ()
    record: StepRecord | None = None
    slot_paths: dict[int, Path] = field(default_factory=dict)
    persistent: PersistentTier | None = None
    bytes_from: dict[str, int] = field(default_factory=lambda: {"memory": 0, "persistent": 0})
    _maps: dict[Path, Any] = field(default_factory=dict)

    @property
    def missing(self) -> list[StockItem]:
        return [it for it in self.items if it.index not in self.where]

    def read(self, item: StockItem) -> torch.Tensor:
        """The item's tensor (private copy, verified against its saved checksum)."""
        src = self.where.get(item.index)
        if src == "memory":
            path = self.slot_paths[item.rank]
            m = self._maps.get(path)
            if m is None:
                m = self._maps[path] = ReadOnlySlot(path)
            view = m.view(item.offset, item.length)
            if item.checksum is None:
                out = view.clone()
            else:  # hashes exactly the bytes copied: a slot rewritten concurrently fails here, never silently
                out = copy_verified(view, item.algo or "xxh3", item.checksum, what=f"{item.name} of step {self.step}",
                                    sources=f"local memory, slot {path.name} (reused by a newer save?)")
            self.bytes_from["memory"] += item.length
            return typed(out, item)
        if src == "persistent":
            assert self.persistent is not None
            # read and hashed in one pass, against the checksum the item was saved with
            expect = (item.algo or "xxh3", item.checksum) if item.checksum is not None else None
            t = self.persistent.load_item(self.step, item.index, expect)
            self.bytes_from["persistent"] += item.length
            return t
        raise ShardUnavailableError(f"{item.name} of step {self.step} is not readable from this host.")


def open_step(
    step: int | None,
    *,
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    persistent: str | PersistentTier | None = None,
) -> StepSource:
    """Find ``step`` (None: the newest) in local memory and/or the persistent tier of ``job_id``."""
    tier: LocalTier | None
    try:
        tier = LocalTier(root, job_id, create=False)
    except TierRootError:
        if persistent is None:
            raise
        tier = None
    jid = tier.job_id if tier is not None else job_id
    ptier = PersistentTier(persistent, jid) if isinstance(persistent, str) else persistent
    if ptier is not None:
        jid = ptier.job_id
    persisted = ptier.committed_steps() if ptier is not None else []
    records = {s: r for s, r in (tier.records().items() if tier is not None and tier.layout.exists() else []) if r.complete}
    if step is None:  # the newest step of the live history: never one of a timeline a rollback abandoned
        timelines, known = ptier.timelines(persisted) if ptier is not None else ({}, None)
        lineage = newest_lineage([known, tier.lineage() if tier is not None and tier.layout.exists() else None])
        persisted = [s for s in persisted if lineage.live(s, timelines.get(s, ""))]
        records = {s: r for s, r in records.items() if lineage.live(s, r.timeline)}
        cands = sorted(set(records) | set(persisted))
        if not cands:
            where = f"tier root {tier.root if tier else root}" + (f" or {ptier.url}" if ptier else "")
            raise StepNotFoundError(f"no committed step of job {jid!r} in {where}.")
        step = cands[-1]
    rec = records.get(step)
    if rec is not None:
        items = items_of_record(rec)
        held = {s.rank: tier.slot_path(s.rank, s.slot) for s in rec.slots} if tier is not None else {}
        where: dict[MetadataIndex, str] = {}
        in_store = step in persisted
        for it in items:
            if it.rank in held:
                where[it.index] = "memory"
            elif in_store:
                where[it.index] = "persistent"
        return StepSource(step, rec.job_id, rec.metadata, rec.fingerprint(), items, where, rec.rank_nodes, rec, held, ptier)
    if step in persisted:
        assert ptier is not None
        md = ptier.read_metadata(step)
        index = ptier.read_index(step)
        items = _items_of_stock(md, index)
        fp = index.fingerprint if index is not None else f"stock-{step}"
        return StepSource(step, ptier.job_id, md, fp, items, {it.index: "persistent" for it in items}, (), None, {}, ptier)
    known = sorted(set(records) | set(persisted))
    raise StepNotFoundError(
        f"step {step} of job {jid!r} is not committed in this host's memory tier"
        f"{' or in ' + ptier.url if ptier else ''}; steps available here: {known}."
    )


def _items_of_stock(md: Metadata, index: StepIndex | None) -> list[StockItem]:
    items = []
    for idx, info in md.storage_data.items():
        m = _RANK_FILE_RE.match(info.relative_path)
        rank = int(m.group(1)) if m else 0
        sdm = md.state_dict_metadata.get(idx.fqn)
        algo, cs = (index.checksums.get(idx) if index is not None else None) or (None, None)
        if isinstance(sdm, TensorStorageMetadata):
            chunk = next((c for c in sdm.chunks if tuple(c.offsets) == tuple(idx.offset or ())), None)
            shape = tuple(chunk.sizes) if chunk is not None else tuple(sdm.size)
            dtype = str(sdm.properties.dtype).removeprefix("torch.")
            n = 1
            for d in shape:
                n *= d
            items.append(StockItem(idx, rank, dtype, shape, n * torch.empty(0, dtype=sdm.properties.dtype).element_size(), algo, cs, info.offset))
        else:
            items.append(StockItem(idx, rank, None, None, info.length, algo, cs, info.offset))
    items.sort(key=lambda it: (it.rank, it.offset))
    return items


# ---- materialize ------------------------------------------------------------------------------------
def materialize_step(
    step: int | None,
    dest_url: str,
    *,
    root: str | os.PathLike[str] | None = None,
    job_id: str | None = None,
    persistent: str | PersistentTier | None = None,
    allow_partial: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``step`` (None: the newest) as a stock DCP checkpoint at ``dest_url`` (any fsspec URL).

    Items come from this host's memory tier (own and replica copies), else from
    the ``persistent`` tier. If some are readable from neither, raises
    :class:`ShardUnavailableError` naming them, unless ``allow_partial``: then
    this host writes what it holds plus a part marker, and ``.metadata`` is
    written by whichever host completes the set (run it on every node).
    ``progress(done_bytes, total_bytes)`` is called as items are written.

    Returns ``{"step", "dest", "complete", "bytes", "items", "files", "missing",
    "from_memory", "from_persistent", "seconds"}`` (plus ``"already_there": True``
    when ``dest`` already holds this exact save of the step, which is then left as is).
    """
    t0 = time.perf_counter()
    src = open_step(step, root=root, job_id=job_id, persistent=persistent)
    missing = src.missing
    if missing and not allow_partial:
        names = [it.name for it in missing]
        raise ShardUnavailableError(
            f"step {src.step} of job {src.job_id!r}: {len(missing)} shard(s) are not readable from this host: "
            f"{names[:20]}{' ...' if len(names) > 20 else ''}. Run this on the nodes that hold them with "
            "allow_partial=True (each writes its part; the last one writes .metadata), or pass persistent=<url> "
            "if the step was drained."
        )
    dest = StepDir.from_url(dest_url)
    if src.persistent is not None and "persistent" in src.where.values():
        same = src.persistent.step_dir(src.step)
        if same.fs.protocol == dest.fs.protocol and same.path == dest.path:
            raise ConfigError(
                f"{dest.url} is where step {src.step} is read from in the persistent tier; write it somewhere else."
            )
    if dest.is_complete():
        try:
            done = dest.read_index()  # decoded without running code (gemini_dcp.core.safe_pickle)
        except PersistentTierError as exc:  # a timeout stops here; anything else is rewritten
            if isinstance(exc, PersistentTimeoutError):
                raise
            log.warning("%s: its checksum index is not usable (%s); writing the step again", dest.url, exc)
            done = None
        if isinstance(done, StepIndex) and done.fingerprint == src.fingerprint and done.step == src.step:
            return {"step": src.step, "dest": dest.url, "complete": True, "bytes": 0, "items": len(done.checksums),
                    "files": [], "missing": [], "from_memory": 0, "from_persistent": 0,
                    "seconds": time.perf_counter() - t0, "already_there": True}
    node_id = _this_node(root)
    dest.begin(node_id)
    by_rank: dict[int, list[StockItem]] = {}
    for it in src.items:
        by_rank.setdefault(it.rank, []).append(it)
    avail = {it.index for it in src.items} - {it.index for it in missing}
    writable = {r: its for r, its in by_rank.items() if all(it.index in avail for it in its)}
    total = sum(it.length for its in writable.values() for it in its)
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    storage: dict[MetadataIndex, _StorageInfo] = {}
    sums: dict[MetadataIndex, tuple[str, int]] = {}
    files = []
    nbytes = 0
    own = node_id
    for rank, its in sorted(writable.items()):
        origin = src.rank_nodes[rank] if rank < len(src.rank_nodes) else None
        # A replica holder flushing someone else's rank names its file apart, so two hosts never share a file.
        rel = data_file(rank) if (not allow_partial or origin in (None, own)) else f"__{rank}_r{node_tag(own)}.distcp"
        st, cs, n = write_rank_file(dest, rel, its, src.read, progress=tick)
        storage.update(st)
        sums.update(cs)
        files.append(rel)
        nbytes += n
    dest.write_marker(PartMarker(src.step, src.fingerprint, node_id, tuple(sorted(writable)), storage, sums, nbytes, time.time()))
    prefer = {r: n for r, n in enumerate(src.rank_nodes)}
    complete, still = try_finalize(
        dest, src.step, src.metadata, src.fingerprint, [it.index for it in src.items], src.job_id, prefer_node=prefer
    )
    missing_names = sorted({it.name for it in src.items if it.index in set(still)})
    return {
        "step": src.step,
        "dest": dest.url,
        "complete": complete,
        "bytes": nbytes,
        "items": len(storage),
        "files": files,
        "missing": missing_names,
        "from_memory": src.bytes_from["memory"],
        "from_persistent": src.bytes_from["persistent"],
        "seconds": time.perf_counter() - t0,
    }


def _this_node(root: str | os.PathLike[str] | None) -> str:
    return resolve_node_id(resolve_root(root))


__all__ = [
    "StockItem",
    "StepSource",
    "items_of_record",
    "open_step",
    "write_rank_file",
    "try_finalize",
    "materialize_step",
]
