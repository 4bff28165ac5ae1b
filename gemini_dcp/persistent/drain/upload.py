"""Uploading a step: each saving rank's items, verified as they are written into the store as DCP data files.

The torch side of the drain server, imported by it only when a step uploads (the server
stages without torch). For one request: check the staged record, decide what is left (a
resume, an adoption), write one or more ``__<rank>_<k>.distcp`` files per rank in parallel
from the held memory slots themselves or from the staged copy (each item's checksum computed
in the pass that writes it, :mod:`.fused`; progress recorded per file in ``progress.json``),
release the slot holds, write the node's part marker, then commit
``.metadata`` if every node's part is there and apply the store's retention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from ...core.faults import fault_point
from ...core.safe_pickle import restricted_loads
from ...errors import UntrustedDataError
from ...ext import loader as ext_loader
from ...local.job_dir import open_private
from ...local.record_codec import read_record
from ...local.record_types import StepRecord
from ...local.slot_holds import holds_intact, release_holds
from ...local.tier import read_lineage
from ...options.persistent import DrainOptions
from ..health_file import write_health
from ..side_files import SIDE_FILE_GLOBALS, PartMarker, node_tag
from ..stock_format import items_of_record, try_finalize, write_rank_file
from ..store import PersistentTier
from ..store_calls import DEFAULT_TIMEOUT_S
from ..timeline_file import write_timeline
from .fused import FusedDest, fused_reader
from .paths import Paths, write_atomic
from .request import DrainRequest, FileResult, Progress, SlotRef, StoredItem
from .status import StatusBook

__all__ = [
    "SPLIT_BYTES", "Uploader", "adoption_marker_id", "host_threads", "load_legacy_progress", "load_progress",
    "prepare_process", "save_progress", "zip_crc_off",
]

log = logging.getLogger("gemini_dcp.persistent.drain")

SPLIT_BYTES = 64 << 20  # a rank with more than this is written as several files in parallel
Outcome = tuple[str, str]  # ("done" | "await" | "abandon" | "retry", detail)


def host_threads(wanted: int) -> int:
    """The data files to write in parallel: ``wanted``, at most one per CPU this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(wanted, cpus))


def prepare_process() -> None:
    """Ready a detached drain process for uploads before its first request (``server._prewarm``).

    Turns off the zip CRC32 of ``torch.save`` for this process (a second pass over every byte;
    stock ``dcp.load`` reads such files, and each item keeps its own checksum in the step's
    index) and loads the checksum extension. Never called in a training process (thread mode).
    """
    set_crc32 = getattr(torch.serialization, "set_crc32_options", None)
    if set_crc32 is not None:
        set_crc32(False)
    ext_loader.load()


@contextlib.contextmanager
def zip_crc_off() -> Iterator[None]:
    """``torch.save`` without the zip CRC32 while the block runs, the setting restored after.

    For the drain's *bridge* (its thread in a training process, serving the first due step while
    the node's drain process imports torch): the setting is process-wide, so a ``torch.save`` of
    another thread of this process in that window also writes no zip CRC32 — ``torch.load``
    reads such files as usual.
    """
    get_crc32 = getattr(torch.serialization, "get_crc32_options", None)
    set_crc32 = getattr(torch.serialization, "set_crc32_options", None)
    if get_crc32 is None or set_crc32 is None:
        yield
        return
    before = bool(get_crc32())
    set_crc32(False)
    try:
        yield
    finally:
        set_crc32(before)


def adoption_marker_id(node_id: str, adopted_from: Sequence[str]) -> str:
    """The part-marker identity of ``node_id`` uploading the ranks of the lost nodes ``adopted_from``."""
    return f"{node_id} (adopting {', '.join(sorted(adopted_from))})"


class Uploader:
    """Uploads and commits the staged steps of one drain state directory (one per server)."""

    def __init__(self, p: Paths, options: DrainOptions, status: StatusBook) -> None:
        self.p = p
        self.options = options
        self.status = status
        self.tiers: dict[tuple[str, str], PersistentTier] = {}
        # Set once the current upload has read every slot byte it needs (its holds are released): the
        # server then reads a newly arrived request in place, as what is left (marker, commit,
        # retention) touches no slot.
        self.slots_read = threading.Event()

    def _tier(self, req: DrainRequest) -> PersistentTier:
        key = (req.store.url, req.store.job_id)
        t = self.tiers.get(key)
        if t is None:
            t = PersistentTier(
                req.store.url, req.store.job_id, keep=req.store.keep, keep_every=req.store.keep_every, writable=True,
                timeout_s=float(req.store.timeout_s or DEFAULT_TIMEOUT_S),  # bounds every store call of the upload
            )
            self.tiers[key] = t
        return t

    def upload(self, req: DrainRequest) -> Outcome:
        """Upload the staged step of ``req`` (resuming its progress); the outcome and its detail."""
        step = req.step
        d = self.p.stage(step)
        ptier = self._tier(req)
        record = read_record(d / "record.rec")
        if record.fingerprint() != req.fingerprint:
            return "abandon", "the staged record does not belong to this request"
        staged = json.loads((d / "staged").read_bytes())
        direct = bool(staged.get("direct"))
        progress = load_progress(d)
        sd = ptier.step_dir(step)
        node_id = adoption_marker_id(req.node_id, req.adopted_from) if req.adopted_from else req.node_id
        if not progress.begun:
            lineage = read_lineage(Path(req.record_path).parent.parent)
            if lineage.gen:  # a rollback: the store learns of it before the new timeline's step lands there
                ptier.write_lineage(lineage)
            if _already_in_store(ptier, step, req.fingerprint):
                return "done", "the store already holds this exact save of the step"
            slots: tuple[SlotRef, ...] | None = None
            if req.adopted_from:
                finished, slots = _adoption_still_needed(ptier, sd, step, req, node_id)
                if finished is not None:
                    return finished  # the ranks no part marker covers yet (``slots``) are fixed for resumes
            sd.begin(node_id)
            # The file split must not change on resume: the thread count is fixed now.
            progress = dataclasses.replace(progress, begun=True, threads=host_threads(self.options.threads), slots=slots)
            save_progress(d, progress)
        slots_todo = progress.slots if progress.slots is not None else req.slots
        threads = progress.threads or self.options.threads
        # An adopting node names its files apart, so it never shares a file with a lost node's
        # torn upload (or with that node itself, should it come back and resume).
        prefix = f"a{node_tag(node_id)[:8]}_" if req.adopted_from else ""
        what = f"step {step}"
        # One or more data files per saving rank (__<rank>_<k>.distcp, as FileSystemWriter with
        # thread_count=k names them), written in parallel; progress is kept per file.
        jobs: list[tuple[str, Path, list[Any]]] = []
        for slot in slots_todo:
            items = items_of_record(record, [slot.rank])
            path = Path(slot.path) if direct else d / f"rank-{slot.rank:05d}.bin"
            n_files = threads if slot.nbytes >= SPLIT_BYTES and len(slots_todo) < threads else 1
            for k, bucket in enumerate(split_by_size(items, n_files)):
                jobs.append((f"__{slot.rank}_{prefix}{k}.distcp", path, bucket))
        lock = threading.Lock()
        state = {"progress": progress}

        # A staged copy is private; held slots are safe while their holds last; a slot read
        # without a hold (no room to stage) may change under us: copied block by block then.
        if not direct:
            intact: Callable[[], bool] | None = lambda: True  # noqa: E731
        elif req.holds:
            intact = lambda: holds_intact(req.holds, step)  # noqa: E731
        else:
            intact = None

        def run(job: tuple[str, Path, list[Any]]) -> None:
            rel, path, items = job
            dest = FusedDest(sd, intact)
            with _ReadMap(path) as buf:
                read, checked = fused_reader(dest, buf.mm, what)  # checksum fused into the write (.fused)
                result = write_rank_file(dest, rel, items, read, progress=checked, throttle_bps=self.options.throttle_bps)  # type: ignore[arg-type]
            with lock:
                state["progress"] = state["progress"].with_file(rel, encode_file(*result))
                save_progress(d, state["progress"])
                fault_point("drain.mid_upload")  # one data file in the store

        fault_point("drain.before_upload")
        t_write = time.monotonic()
        todo = [j for j in jobs if j[0] not in progress.files]
        if len(todo) == 1 or threads == 1:
            for j in todo:
                run(j)
        elif todo:
            with ThreadPoolExecutor(max_workers=min(threads, len(todo)), thread_name_prefix="gemini-drain-io") as ex:
                for fut in [ex.submit(run, j) for j in todo]:
                    fut.result()
        progress = state["progress"]
        release_holds(req.holds, step)  # the slots are read: the writer may reuse them
        self.slots_read.set()
        if not direct:
            drop_stage_bytes(d)  # give the tmpfs back as soon as the bytes are in the store
        storage: dict[MetadataIndex, _StorageInfo] = {}
        sums: dict[MetadataIndex, tuple[str, int]] = {}
        total = 0
        for rel, _path, _items in jobs:
            st, cs, n = decode_file(progress.files[rel])
            storage.update(st)
            sums.update(cs)
            total += n
        ranks = tuple(sorted(s.rank for s in slots_todo))
        t_marker = time.monotonic()
        sd.write_marker(PartMarker(step, req.fingerprint, node_id, ranks, storage, sums, total, time.time()))
        save_progress(d, dataclasses.replace(progress, marker=True))
        t_commit = time.monotonic()
        self.status.set(step, "part-written", bytes=total, write_seconds=round(t_marker - t_write, 4),
                        marker_seconds=round(t_commit - t_marker, 4), files=len(jobs))
        fault_point("drain.before_metadata")
        if self.try_commit(req, record):
            self.status.set(step, "committed", commit_seconds=round(time.monotonic() - t_commit, 4))
            return "done", ""
        return ("await", "") if req.rank0_node else ("done", "part written; another node commits")

    def try_commit(self, req: DrainRequest, record: StepRecord | None = None) -> bool:
        """Write ``.metadata`` of ``req``'s step if every node's part is in the store; then apply retention."""
        step = req.step
        if record is None:
            record = read_record(self.p.stage(step) / "record.rec")
        if not record.complete:  # the coordinator completes its record in finish(); take that one
            fresh = _completed_record(req, [self.p.stage(step) / "record.rec", Path(req.record_path)])
            if fresh is None:
                return False
            record = fresh
        ptier = self._tier(req)
        write_health(ptier.step_dir(step), record)  # beside the stock layout, before .metadata (the commit)
        lineage = read_lineage(Path(req.record_path).parent.parent)  # the job's history as this node knows it now
        write_timeline(ptier.step_dir(step), record.timeline, lineage)
        ok, _missing = try_finalize(
            ptier.step_dir(step), step, record.metadata, req.fingerprint, list(record.metadata.storage_data),
            req.store.job_id, prefer_node=dict(enumerate(record.rank_nodes)),
        )
        if ok:
            self.status.set(step, "committed", committed_unix=time.time())
            log.info("step %d committed to %s", step, ptier.step_url(step))
            protect = set(self.p.pending()) - {step}
            try:
                deleted = ptier.apply_retention(protect=protect, lineage=lineage)
                if deleted:
                    log.info("retention deleted steps %s from %s", deleted, ptier.url)
            except Exception as exc:  # noqa: BLE001 - retention must not undo a commit
                log.warning("retention in %s failed: %s", ptier.url, exc)
        return ok


def drop_stage_bytes(d: Path) -> None:
    """Delete the staged slot copies of a step (its record and progress stay)."""
    for f in d.glob("rank-*.bin"):
        try:
            f.unlink()
        except FileNotFoundError:
            pass


def _completed_record(req: DrainRequest, paths: list[Path]) -> StepRecord | None:
    """The first complete record of the request's save among ``paths`` (its staged copy, which
    ``Drainer.restage`` replaces once the coordinator completed it, then the tier's), or None."""
    for path in paths:
        try:
            rec = read_record(path)
        except (OSError, ValueError) as exc:
            log.debug("step %s: no complete record at %s (%s)", req.step, path, exc)
            continue
        if rec.complete and rec.fingerprint() == req.fingerprint:
            return rec
    return None


def _adoption_still_needed(
    ptier: PersistentTier, sd: Any, step: int, req: DrainRequest, marker_id: str
) -> tuple[Outcome | None, tuple[SlotRef, ...]]:
    """``(None, slots)``: the slots of an adoption request that no part marker of the same save
    covers yet; or ``(outcome, ())`` when nothing is left to do (a newer step is complete: the
    store's retention drops this one anyway; or the lost nodes' parts got there after all)."""
    newer = [s for s in ptier.live_steps(ptier.committed_steps()) if s > step]  # an abandoned timeline's: no
    if newer:
        return ("done", f"step {max(newer)} is complete in the store; step {step} is no longer needed there"), ()
    covered = {
        r for m in sd.read_markers() if m.fingerprint == req.fingerprint and m.node_id != marker_id for r in m.ranks
    }
    slots = tuple(s for s in req.slots if s.rank not in covered)
    if not slots:
        return ("done", "the lost nodes' parts reached the store after all"), ()
    return None, slots


def _already_in_store(ptier: PersistentTier, step: int, fingerprint: str) -> bool:
    """True if ``step`` is complete in the store from the same save (re-draining would only risk it)."""
    try:
        if not ptier.is_complete(step):
            return False
        index = ptier.read_index(step)
    except Exception:  # noqa: BLE001 - unreadable: drain it again
        return False
    return index is not None and index.fingerprint == fingerprint


def split_by_size(items: list[Any], n: int) -> list[list[Any]]:
    """Deterministic split into ``n`` buckets of similar bytes (largest first), each kept in slot order."""
    if n <= 1 or len(items) <= 1:
        return [items]
    buckets: list[list[Any]] = [[] for _ in range(n)]
    sizes = [0] * n
    for it in sorted(items, key=lambda it: (-it.length, it.offset)):
        i = min(range(n), key=lambda b: (sizes[b], b))
        buckets[i].append(it)
        sizes[i] += it.length
    return [sorted(b, key=lambda it: it.offset) for b in buckets if b]


# ---- progress: JSON, and the previous release's pickle ----------------------------------------------
def encode_file(
    storage: dict[MetadataIndex, _StorageInfo], sums: dict[MetadataIndex, tuple[str, int]], nbytes: int
) -> FileResult:
    """What ``write_rank_file`` returned, as a JSON-able :class:`FileResult`."""
    items = []
    for idx, info in storage.items():
        algo, cs = sums.get(idx, (None, None))
        items.append(StoredItem(
            fqn=idx.fqn, offset=None if idx.offset is None else tuple(int(x) for x in idx.offset), index=idx.index,
            storage={f.name: getattr(info, f.name) for f in dataclasses.fields(info)}, algo=algo, checksum=cs,
        ))
    return FileResult(items=tuple(items), nbytes=int(nbytes))


_INFO_FIELDS = frozenset(f.name for f in dataclasses.fields(_StorageInfo))


def decode_file(fr: FileResult) -> tuple[dict[MetadataIndex, _StorageInfo], dict[MetadataIndex, tuple[str, int]], int]:
    """The inverse of :func:`encode_file`."""
    storage: dict[MetadataIndex, _StorageInfo] = {}
    sums: dict[MetadataIndex, tuple[str, int]] = {}
    for it in fr.items:
        idx = MetadataIndex(it.fqn, None if it.offset is None else torch.Size(it.offset), it.index)
        storage[idx] = _StorageInfo(**{k: v for k, v in it.storage.items() if k in _INFO_FIELDS})
        if it.algo is not None and it.checksum is not None:
            sums[idx] = (it.algo, int(it.checksum))
    return storage, sums, fr.nbytes


def save_progress(d: Path, progress: Progress) -> None:
    write_atomic(d / "progress.json", progress.to_json().encode())


def load_progress(d: Path) -> Progress:
    """The upload progress of a staged step: ``progress.json``, else the previous release's
    ``progress.pkl`` (a drain left pending across an upgrade; decoded without running code),
    else a fresh one."""
    try:
        return Progress.from_json((d / "progress.json").read_bytes(), str(d / "progress.json"))
    except FileNotFoundError:
        pass
    old = load_legacy_progress(d)
    files = {rel: encode_file(*res) for rel, res in old.get("files", {}).items()}
    slots = old.get("slots")
    return Progress(
        begun=bool(old.get("begun")), threads=old.get("threads"), files=files, marker=bool(old.get("marker")),
        slots=None if slots is None else tuple(SlotRef(rank=r, path=str(p), nbytes=int(n)) for r, p, n in slots),
    )


def load_legacy_progress(d: Path) -> dict[str, Any]:
    """The previous release's pickled progress of a staged step (fresh if none), decoded without running code.

    A ``progress.pkl`` that names anything but the classes a progress record holds is
    refused (UntrustedDataError, which abandons the step's drain with the reason in its
    status): it was planted or damaged, and nothing in it ever runs.
    """
    path = d / "progress.pkl"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {"begun": False, "files": {}}
    obj = restricted_loads(raw, source=str(path), allowed=SIDE_FILE_GLOBALS)
    if not isinstance(obj, dict) or not isinstance(obj.get("files", {}), dict):
        raise UntrustedDataError(
            f"{path} holds a {type(obj).__name__}, not a drain progress record: it was not written by gemini_dcp. "
            "The step's drain is abandoned; remove the job's persist/ directory if this recurs."
        )
    obj.setdefault("files", {})
    return obj


# ---- reading the staged bytes -------------------------------------------------------------------
class _ReadMap:
    """A file mapped read-only for the upload (closed when done)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mm: Any = None
        self._fd = -1

    def __enter__(self) -> "_ReadMap":
        self._fd = open_private(self.path, os.O_RDONLY)  # a slot or stage file of ours in the tier root
        size = os.fstat(self._fd).st_size
        self.mm = mmap.mmap(self._fd, size, prot=mmap.PROT_READ) if size else b""
        return self

    def __exit__(self, *exc: Any) -> None:
        if isinstance(self.mm, mmap.mmap):
            try:
                self.mm.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes with it
        os.close(self._fd)
