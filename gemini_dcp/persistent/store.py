"""The persistent tier: stock DCP checkpoints in any fsspec store.

Layout (one directory per drained step, each a **stock DCP checkpoint** that
``dcp.load(sd, checkpoint_id="<url>/<job_id>/step-<N>")`` reads with torch's own
FileSystemReader / FsspecReader)::

    <url>/<job_id>/step-<N>/__<rank>_0.distcp     # one file per saving rank, items as torch.save bytes
    <url>/<job_id>/step-<N>/.gemini/part-<node>.pkl  # a node finished its ranks' files (written after them)
    <url>/<job_id>/step-<N>/.gemini/index.pkl     # checksums of every item (written before .metadata)
    <url>/<job_id>/step-<N>/.metadata             # written LAST: its presence is the commit

This module is the store: one job's steps in a store (paths, the access probe, listing, the
committed steps, their ``.metadata`` and index, retention) and the reading of their items
back, verified. Its parts with a reason of their own to change:

* :mod:`~gemini_dcp.persistent.step_dir` — a step directory being written (data files go
  first, ``.metadata`` last: its presence is the commit).
* :mod:`~gemini_dcp.persistent.side_files` — the marker and index records and their decoding
  (**side files are untrusted input**: decoded without running code).
* :mod:`~gemini_dcp.persistent.store_calls` — every store call under a deadline
  (:class:`PersistentTimeoutError` instead of a hang), opening a URL, explaining a failure.
* :mod:`~gemini_dcp.persistent.item_payload` — where a tensor's bytes sit in a stored item.

Reading items back: Every item is checked through the chunk sink (:mod:`gemini_dcp.core.chunk_sink`) against the
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

Errors reaching the store (unknown protocol, missing package, missing
credentials, no permission, no such bucket) are raised as
:class:`PersistentTierError` when the tier is constructed, by a probe: a
writable tier writes and deletes a tiny object under ``<url>/<job_id>/``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..core.checksum import checksum
from ..core.chunk_sink import StagedChunks, check_chunk, corrupt_message
from ..core.config import resolve_job_id
from ..core.regular_file import open_regular
from ..core.timelines import Lineage, newest as newest_lineage
from ..errors import ChecksumMismatchError, ConfigError, PersistentTierError, StepNotFoundError
from ..local.record_types import ShardRef
from ..options.checks import check_timeout
from .health_file import read_health
from .item_payload import ItemWindow, MappedFile, ReadAt, flat_bytes, payload_layout, read_exact, read_hashing
from .side_files import (
    INDEX,
    METADATA,
    SIDE_DIR,
    PartMarker,
    StepIndex,
    decode_side_file,
    node_tag,
)
from .step_dir import StepDir
from .store_calls import (
    DEFAULT_TIMEOUT_S,
    INLINE_PROTOCOLS,
    LOCAL_PROTOCOLS,
    PersistentTimeoutError,
    bounded_call,
    explain,
    fresh,
    protocol_of,
    rm_quiet,
    url_to_fs,
)
from .timeline_file import JOB_TIMELINE, read_timeline

__all__ = [
    "MAX_READ_THREADS",
    "PersistentChecksumError",
    "PersistentTier",
    "expected_checksum",
    "load_item",
    "read_item_bytes",
    "read_items",
    "read_stored",
    "read_workers",
    "verify_item",
]

log = logging.getLogger(__name__)

_STEP_DIR_RE = re.compile(r"^step-([0-9]+)$")
_T = TypeVar("_T")

# Successful probes, per process: a writer constructed for every save probes the store once.
_PROBED: set[tuple[str, str, bool]] = set()
_PROBE_LOCK = threading.Lock()


class PersistentTier:
    """One job's checkpoints in an fsspec store.

    Args:
        url: fsspec URL of the store root (``file:///mnt/ckpt``, ``memory://ckpt``,
            ``s3://bucket/prefix``, ...). Checkpoints go to ``<url>/<job_id>/step-<N>/``.
        job_id: the job (same as the memory tiers').
        keep: complete steps to keep (None: keep all). The newest complete step is never deleted.
        keep_every: also keep forever every step that is a multiple of this.
        writable: probe write access (the writer); False only checks the store can be reached.
        storage_options: extra fsspec options (e.g. ``{"endpoint_url": ...}``); by default
            fsspec's own configuration and environment (``FSSPEC_S3_ENDPOINT_URL``, AWS_* ...) apply.
        timeout_s: deadline of every store call (probe, listing, read, delete, each buffered
            write), positive and finite; an overrun raises :class:`PersistentTimeoutError`.
            The writer and reader pass their own ``timeout_s``. For s3:// it also sets botocore's
            connect/read timeouts unless ``storage_options`` give ``config_kwargs`` of their own.
    """

    def __init__(
        self,
        url: str,
        job_id: str | None = None,
        *,
        keep: int | None = 2,
        keep_every: int | None = None,
        writable: bool = False,
        storage_options: dict[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(url, str) or not url.strip():
            raise PersistentTierError(f"persistent={url!r}: give an fsspec URL such as file:///mnt/ckpt or s3://bucket/prefix.")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"persist_keep={keep!r}: keep at least 1 complete step in the persistent tier, or None for all.")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ConfigError(f"persist_keep_every={keep_every!r}: give an int >= 1 or None.")
        self.url = url.rstrip("/") if "://" in url else os.path.abspath(os.path.expanduser(url))
        self.job_id = resolve_job_id(job_id)
        self.keep = keep
        self.keep_every = keep_every
        self.writable = writable
        self.timeout_s = check_timeout(timeout_s)
        self.storage_options = dict(storage_options or {})
        self.fs, root_path = url_to_fs(self.url, self.storage_options, self.timeout_s)
        self.protocol = protocol_of(self.fs)
        self._deadline: float | None = None if self.protocol in INLINE_PROTOCOLS else self.timeout_s
        self.root_path = root_path.rstrip("/") or "/"
        self.base = f"{self.root_path}/{self.job_id}" if self.root_path != "/" else f"/{self.job_id}"
        self._meta_cache: dict[int, tuple[Metadata, StepIndex | None]] = {}
        self._probe()

    # ---- paths ---------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return self.protocol in LOCAL_PROTOCOLS

    def step_path(self, step: int) -> str:
        return f"{self.base}/step-{int(step)}"

    def step_url(self, step: int) -> str:
        """What to pass as ``checkpoint_id`` to stock ``dcp.load`` (a plain path for local files)."""
        path = self.step_path(step)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def marker_path(self, step: int, node_id: str) -> str:
        return f"{self.step_path(step)}/{SIDE_DIR}/part-{node_tag(node_id)}.pkl"

    def call(self, op: str, path: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """One store call under this tier's deadline (inline for file:// and memory://); ``op`` and
        ``path`` name it in a PersistentTimeoutError."""
        return bounded_call(self._deadline, f"persistent store {self.url}: {op} {self.shown(path)}", fn, *args, **kwargs)

    # ---- probe ---------------------------------------------------------------------------
    def _probe(self) -> None:
        key = (self.url, self.job_id, self.writable)
        with _PROBE_LOCK:
            if key in _PROBED:
                return
        def probe() -> None:
            if self.writable:
                if self.is_local:
                    self.fs.makedirs(self.base, exist_ok=True)
                path = f"{self.base}/.gemini-probe-{uuid.uuid4().hex[:12]}"
                self.fs.pipe_file(path, b"gemini_dcp write probe")
                self.fs.rm_file(path)
            else:
                self.fs.exists(self.base)

        try:
            self.call("write probe of" if self.writable else "probe of", self.base, probe)
        except PersistentTimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified into one clear error
            raise PersistentTierError(explain(exc, self.url, self.base, self.writable)) from exc
        with _PROBE_LOCK:
            _PROBED.add(key)

    # ---- listing -------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Every step directory present (complete or not), ascending."""
        self._fresh(self.base)
        try:
            entries = self.call("listing of", self.base, self.fs.ls, self.base, detail=False)
        except FileNotFoundError:
            return []
        except PersistentTierError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot list {self.shown(self.base)}: {type(exc).__name__}: {exc}") from exc
        steps = []
        for e in entries:
            m = _STEP_DIR_RE.match(str(e).rstrip("/").rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return sorted(set(steps))

    def is_complete(self, step: int) -> bool:
        self._fresh(self.step_path(step))
        path = f"{self.step_path(step)}/{METADATA}"
        try:
            return bool(self.call("existence check of", path, self.fs.exists, path))
        except PersistentTierError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot reach {self.shown(self.step_path(step))}: {type(exc).__name__}: {exc}") from exc

    def committed_steps(self) -> list[int]:
        """Steps with a complete ``.metadata`` in the store, ascending."""
        self._invalidate_stale()
        return [s for s in self.all_steps() if self.is_complete(s)]

    def wait_for_step(self, step: int, timeout_s: float = 60.0, poll_s: float = 0.1) -> bool:
        """Poll until ``step`` is complete in the store; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.is_complete(step):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)

    # ---- reading -------------------------------------------------------------------------
    def read_metadata(self, step: int) -> Metadata:
        return self._load(step)[0]

    def read_index(self, step: int) -> StepIndex | None:
        return self._load(step)[1]

    def _invalidate_stale(self) -> None:
        self._meta_cache.clear()

    def _load(self, step: int) -> tuple[Metadata, StepIndex | None]:
        hit = self._meta_cache.get(step)
        if hit is not None:
            return hit
        path = f"{self.step_path(step)}/{METADATA}"
        try:
            raw = self.call("read of", path, self.fs.cat_file, path)
        except FileNotFoundError as exc:
            raise StepNotFoundError(
                f"step {step} of job {self.job_id!r} is not complete in the persistent tier {self.url} "
                f"(no {self.shown(path)}); complete steps: {self.committed_steps()}."
            ) from exc
        except PersistentTierError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot read {self.shown(path)}: {type(exc).__name__}: {exc}") from exc
        md = decode_side_file(raw, self.shown(path), Metadata)
        if not isinstance(md.storage_data, dict):
            raise PersistentTierError(f"{self.shown(path)} does not hold DCP Metadata with storage_data.")
        index: StepIndex | None = None
        ipath = f"{self.step_path(step)}/{SIDE_DIR}/{INDEX}"
        try:
            raw_index = self.call("read of", ipath, self.fs.cat_file, ipath)
        except FileNotFoundError:
            # A stock checkpoint written by something else (plain DCP): it has no checksums to verify.
            log.info("%s has no %s: its items are loaded without checksum verification", self.shown(path), self.shown(ipath))
            raw_index = None
        except PersistentTierError:
            raise
        except Exception as exc:  # noqa: BLE001 - never "no checksums" for an index that exists
            raise PersistentTierError(
                f"cannot read the checksum index {self.shown(ipath)} of step {step}: {type(exc).__name__}: {exc}. "
                "Without it the step's bytes cannot be verified, so it is not loaded: check the store, or load another step."
            ) from exc
        if raw_index is not None:
            index = decode_side_file(raw_index, self.shown(ipath), StepIndex)
        self._meta_cache[step] = (md, index)
        return md, index

    def read_items(
        self,
        step: int,
        plan: LoadPlan,
        planner: LoadPlanner,
        *,
        stage: StagedChunks | None = None,
        keep: Callable[[MappedFile], None] | None = None,
    ) -> int:
        """Read ``plan``'s items of ``step``, verified; bytes read (:func:`read_items`).

        ``keep`` is handed every local data file mapped for the staged views, so the caller
        decides where the mapping is undone (off the restore's critical path)."""
        return read_items(self, step, plan, planner, stage=stage, keep=keep)

    def read_item_bytes(self, step: int, idx: MetadataIndex) -> tuple[bytes, bool]:
        """Raw stored bytes of one item (torch.save bytes for a tensor) and whether it is a BYTE_IO item."""
        return read_item_bytes(self, step, idx)

    def load_item(self, step: int, idx: MetadataIndex, expect: tuple[str, int] | None = None) -> torch.Tensor:
        """One stored item as a tensor (uint8 for bytes items), verified against ``expect`` or the index."""
        return load_item(self, step, idx, expect)

    # ---- writing (used by the drain and stock.materialize_step) -----------------------------------
    def step_dir(self, step: int) -> StepDir:
        return StepDir(
            self.fs, self.step_path(step), self.is_local, self.shown(self.step_path(step)), step=step, timeout_s=self._deadline
        )

    def read_markers(self, step: int) -> list[PartMarker]:
        return self.step_dir(step).read_markers()

    def delete_step(self, step: int) -> None:
        """Remove ``.metadata`` first (the step stops being a checkpoint at once), then the rest."""
        self._rm_quiet(f"{self.step_path(step)}/{METADATA}")
        try:
            self.call("delete of", self.step_path(step), self.fs.rm, self.step_path(step), recursive=True)
        except FileNotFoundError:
            pass
        self._meta_cache.pop(step, None)

    def unhealthy_steps(self, steps: Iterable[int]) -> list[int]:
        """Those of ``steps`` whose drain stored them marked unhealthy (:mod:`.health_file`)."""
        out = []
        for s in steps:
            data = self.step_health(s)
            if data is not None and not data["healthy"]:
                out.append(s)
        return out

    def step_health(self, step: int) -> dict[str, Any] | None:
        """The health the drain stored for ``step`` (:func:`.health_file.read_health`; None: none, counts as healthy)."""
        return read_health(self.step_dir(step))

    def timelines(self, steps: Iterable[int]) -> tuple[dict[int, str], Lineage]:
        """The timeline each of ``steps`` was saved on (:mod:`.timeline_file`; absent: ``""``) and the
        newest lineage their files hold (the job's history as the store knows it)."""
        out: dict[int, str] = {}
        lineages: list[Lineage | None] = [self.read_lineage()]
        for s in steps:
            out[s], lin = read_timeline(self.step_dir(s))
            lineages.append(lin)
        return out, newest_lineage(lineages)

    def read_lineage(self) -> Lineage | None:
        """The job-level lineage a drain wrote (:meth:`write_lineage`); None when there is none."""
        path = f"{self.base}/{JOB_TIMELINE}"
        try:
            raw = self.call("read of", path, self.fs.cat_file, path)
        except (OSError, PersistentTierError):
            return None
        return Lineage.from_json(raw)

    def write_lineage(self, lineage: Lineage) -> None:
        """Tell the store about a rollback before the new timeline's first step is drained: with the
        node's memory lost before that step is durable, a restore still never takes an abandoned step."""
        known = self.read_lineage()
        if known is not None and known.gen >= lineage.gen:
            return
        job = StepDir(self.fs, self.base, self.is_local, self.shown(self.base), timeout_s=self._deadline)
        job.put_bytes(JOB_TIMELINE, json.dumps(lineage.to_json(), sort_keys=True).encode(), atomic=True)

    def live_steps(self, steps: Iterable[int], lineage: Lineage | None = None) -> list[int]:
        """Those of ``steps`` that no rollback abandoned, judged by ``lineage`` joined with the store's own."""
        steps = list(steps)
        timelines, known = self.timelines(steps)
        lin = newest_lineage([known, lineage])
        return [s for s in steps if lin.live(s, timelines.get(s, ""))]

    def apply_retention(self, protect: Iterable[int] = (), lineage: Lineage | None = None) -> list[int]:
        """Keep the newest ``keep`` complete steps and every ``keep_every``-th; never the newest complete one,
        nor the newest healthy one while unhealthy steps follow it (:mod:`gemini_dcp.health`).

        Incomplete step directories older than the newest complete step, and not
        in ``protect`` (still being drained), are leftovers of abandoned drains
        and are removed too, and so are the steps of a timeline a rollback abandoned (by
        ``lineage`` joined with the store's own, :mod:`gemini_dcp.core.timelines`): they count for
        nothing, and are never restored by default. Returns the steps deleted.
        """
        steps = self.all_steps()
        complete = [s for s in steps if self.is_complete(s)]
        if not complete:
            return []
        live = set(self.live_steps(complete, lineage))
        abandoned = [s for s in complete if s not in live and s not in set(protect)]
        for s in abandoned:
            self.delete_step(s)
        steps = [s for s in steps if s not in abandoned]
        complete = [s for s in complete if s in live]
        if not complete:
            return abandoned
        newest = complete[-1]
        keep = set(complete if self.keep is None else complete[-self.keep :])
        if self.keep_every:
            keep |= {s for s in complete if s % self.keep_every == 0}
        keep.add(newest)
        for s in reversed(complete):  # the newest healthy step stays restorable behind unhealthy ones
            if not self.unhealthy_steps([s]):
                keep.add(s)
                break
        protect = set(protect)
        deleted = abandoned
        for s in steps:
            if s in keep or s in protect:
                continue
            if s in complete or s < newest:
                self.delete_step(s)
                deleted.append(s)
        return deleted

    # ---- helpers -------------------------------------------------------------------------
    def _fresh(self, path: str) -> None:
        fresh(self.fs, path)

    def _rm_quiet(self, path: str) -> None:
        rm_quiet(self.fs, path, self._deadline, self.shown(path))

    def shown(self, path: str) -> str:
        """``path`` as messages show it: a plain path for local files, else a URL."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def __repr__(self) -> str:
        return f"PersistentTier({self.url!r}, job_id={self.job_id!r}, keep={self.keep}, keep_every={self.keep_every})"


# ---- reading a step's items back, verified ---------------------------------------------------

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
