"""The persistent tier: stock DCP checkpoints in any fsspec store.

Layout (one directory per drained step, each a **stock DCP checkpoint** that
``dcp.load(sd, checkpoint_id="<url>/<job_id>/step-<N>")`` reads with torch's own
FileSystemReader / FsspecReader)::

    <url>/<job_id>/step-<N>/__<rank>_0.distcp     # one file per saving rank, items as torch.save bytes
    <url>/<job_id>/step-<N>/.gemini/part-<node>.pkl  # a node finished its ranks' files (written after them)
    <url>/<job_id>/step-<N>/.gemini/index.pkl     # checksums of every item (written before .metadata)
    <url>/<job_id>/step-<N>/.metadata             # written LAST: its presence is the commit

Data files go first and ``.metadata`` last, as one object put (object stores)
or a tmp file + rename (local filesystems): a step without ``.metadata`` is
not a checkpoint, whatever else is there, so a drain that dies midway leaves
nothing a reader would take. Before any data of a step is (re)written its old
``.metadata`` is deleted, so a re-drain of the same step can never pair an old
``.metadata`` with new data.

Errors reaching the store (unknown protocol, missing package, missing
credentials, no permission, no such bucket) are raised as
:class:`PersistentTierError` when the tier is constructed, by a probe: a
writable tier writes and deletes a tiny object under ``<url>/<job_id>/``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import fsspec
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .checksum import as_bytes, checksum
from .config import resolve_job_id
from .errors import ChecksumMismatchError, ConfigError, PersistentTierError, StepNotFoundError
from .records import ShardRef

log = logging.getLogger(__name__)

METADATA = ".metadata"
SIDE_DIR = ".gemini"
INDEX = "index.pkl"
_STEP_DIR_RE = re.compile(r"^step-(\d+)$")
_LOCAL_PROTOCOLS = {"file", "local"}

# Successful probes, per process: a writer constructed for every save probes the store once.
_PROBED: set[tuple[str, str, bool]] = set()
_PROBE_LOCK = threading.Lock()


class PersistentChecksumError(PersistentTierError, ChecksumMismatchError):
    """An item read from the persistent tier does not match the checksum recorded when it was saved."""


def node_tag(node_id: str) -> str:
    """A file-name-safe tag for a node id (which may contain ':' and '/')."""
    return hashlib.sha1(node_id.encode()).hexdigest()[:16]


def data_file(rank: int) -> str:
    """The data file of a saving rank, named as FileSystemWriter names it."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True, slots=True)
class PartMarker:
    """What one node wrote for a step: its ranks' files, where each item is, and the checksums."""

    step: int
    fingerprint: str
    node_id: str
    ranks: tuple[int, ...]
    storage: dict[MetadataIndex, _StorageInfo]
    checksums: dict[MetadataIndex, tuple[str, int]]
    nbytes: int
    written_unix: float


@dataclass(frozen=True, slots=True)
class StepIndex:
    """Written next to ``.metadata``: checksums of every item (the raw tensor / bytes, as in memory)."""

    step: int
    fingerprint: str
    checksums: dict[MetadataIndex, tuple[str, int]]
    nodes: tuple[str, ...]
    job_id: str


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
        self.storage_options = dict(storage_options or {})
        self.fs, root_path = _url_to_fs(self.url, self.storage_options)
        self.protocol = _protocol(self.fs)
        self.root_path = root_path.rstrip("/") or "/"
        self.base = f"{self.root_path}/{self.job_id}" if self.root_path != "/" else f"/{self.job_id}"
        self._meta_cache: dict[int, tuple[Metadata, StepIndex | None]] = {}
        self._probe()

    # ---- paths ---------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return self.protocol in _LOCAL_PROTOCOLS

    def step_path(self, step: int) -> str:
        return f"{self.base}/step-{int(step)}"

    def step_url(self, step: int) -> str:
        """What to pass as ``checkpoint_id`` to stock ``dcp.load`` (a plain path for local files)."""
        path = self.step_path(step)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def marker_path(self, step: int, node_id: str) -> str:
        return f"{self.step_path(step)}/{SIDE_DIR}/part-{node_tag(node_id)}.pkl"

    # ---- probe ---------------------------------------------------------------------------
    def _probe(self) -> None:
        key = (self.url, self.job_id, self.writable)
        with _PROBE_LOCK:
            if key in _PROBED:
                return
        try:
            if self.writable:
                if self.is_local:
                    self.fs.makedirs(self.base, exist_ok=True)
                probe = f"{self.base}/.gemini-probe-{uuid.uuid4().hex[:12]}"
                self.fs.pipe_file(probe, b"gemini_dcp write probe")
                self.fs.rm_file(probe)
            else:
                self.fs.exists(self.base)
        except Exception as exc:  # noqa: BLE001 - classified into one clear error
            raise PersistentTierError(_explain(exc, self.url, self.base, self.writable)) from exc
        with _PROBE_LOCK:
            _PROBED.add(key)

    # ---- listing -------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Every step directory present (complete or not), ascending."""
        self._fresh(self.base)
        try:
            entries = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot list {self._u(self.base)}: {type(exc).__name__}: {exc}") from exc
        steps = []
        for e in entries:
            m = _STEP_DIR_RE.match(str(e).rstrip("/").rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return sorted(set(steps))

    def is_complete(self, step: int) -> bool:
        self._fresh(self.step_path(step))
        try:
            return bool(self.fs.exists(f"{self.step_path(step)}/{METADATA}"))
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot reach {self._u(self.step_path(step))}: {type(exc).__name__}: {exc}") from exc

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
            raw = self.fs.cat_file(path)
        except FileNotFoundError as exc:
            raise StepNotFoundError(
                f"step {step} of job {self.job_id!r} is not complete in the persistent tier {self.url} "
                f"(no {self._u(path)}); complete steps: {self.committed_steps()}."
            ) from exc
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot read {self._u(path)}: {type(exc).__name__}: {exc}") from exc
        try:
            md = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"{self._u(path)} is not a readable DCP metadata file: {exc}") from exc
        if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
            raise PersistentTierError(f"{self._u(path)} does not hold DCP Metadata with storage_data.")
        index: StepIndex | None = None
        ipath = f"{self.step_path(step)}/{SIDE_DIR}/{INDEX}"
        try:
            obj = pickle.loads(self.fs.cat_file(ipath))
            index = obj if isinstance(obj, StepIndex) else None
        except FileNotFoundError:
            index = None  # a checkpoint written by something else: no checksums to verify against
        except Exception as exc:  # noqa: BLE001
            log.warning("ignoring unreadable checksum index %s: %s", self._u(ipath), exc)
        self._meta_cache[step] = (md, index)
        return md, index

    def read_items(self, step: int, plan: LoadPlan, planner: LoadPlanner) -> int:
        """Read ``plan``'s items of ``step`` into the planner's tensors / ``load_bytes``; returns bytes read.

        Every item is checked against the checksum recorded when it was saved:
        the in-memory ShardRef when the planner's metadata comes from a memory
        record (a mixed restore of the same step), else the step's index.
        Raises PersistentTierError (ChecksumMismatchError for bad bytes).
        """
        md, index = self._load(step)
        planner_sd = getattr(getattr(planner, "metadata", None), "storage_data", None) or {}
        by_index: dict[MetadataIndex, list[ReadItem]] = {}
        for item in plan.items:
            by_index.setdefault(item.storage_index, []).append(item)
        per_file: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
        for idx in by_index:
            info = md.storage_data.get(idx)
            if not isinstance(info, _StorageInfo):
                raise PersistentTierError(
                    f"step {step} in {self.url}: no item {idx.fqn!r} (offset {tuple(idx.offset or ())}) in its .metadata."
                )
            per_file.setdefault(info.relative_path, []).append((idx, info))
        total = 0
        for rel, entries in per_file.items():
            entries.sort(key=lambda e: e[1].offset)
            path = f"{self.step_path(step)}/{rel}"
            try:
                with self.fs.open(path, "rb", block_size=8 << 20) as f:
                    for idx, info in entries:
                        f.seek(info.offset)
                        raw = f.read(info.length)
                        if len(raw) != info.length:
                            raise PersistentTierError(
                                f"{self._u(path)} is truncated: item {idx.fqn!r} needs bytes {info.offset}+{info.length}."
                            )
                        expect = _expected(planner_sd.get(idx), index, idx)
                        self._apply(step, idx, raw, by_index[idx], planner, expect, path)
                        total += info.length
            except (PersistentTierError, ChecksumMismatchError):
                raise
            except Exception as exc:  # noqa: BLE001
                raise PersistentTierError(f"cannot read {self._u(path)}: {type(exc).__name__}: {exc}") from exc
        return total

    def read_item_bytes(self, step: int, idx: MetadataIndex) -> tuple[bytes, bool]:
        """Raw stored bytes of one item (torch.save bytes for a tensor) and whether it is a BYTE_IO item."""
        md, _ = self._load(step)
        info = md.storage_data[idx]
        path = f"{self.step_path(step)}/{info.relative_path}"
        raw = self.fs.cat_file(path, start=info.offset, end=info.offset + info.length)
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # noqa: PLC0415

        return raw, isinstance(md.state_dict_metadata.get(idx.fqn), BytesStorageMetadata)

    def load_item(self, step: int, idx: MetadataIndex) -> torch.Tensor:
        """One stored item as a tensor (uint8 for bytes items), verified against the index."""
        raw, is_bytes = self.read_item_bytes(step, idx)
        _, index = self._load(step)
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if is_bytes else _torch_load(raw)
        expect = _expected(None, index, idx)
        if expect is not None:
            _verify(t, expect, f"item {idx.fqn!r} of step {step} in {self.url}")
        return t

    def _apply(
        self, step: int, idx: MetadataIndex, raw: bytes, items: list[ReadItem], planner: LoadPlanner,
        expect: tuple[str, int] | None, path: str,
    ) -> None:
        what = f"item {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step} in {self._u(path)}"
        if items[0].type == LoadItemType.BYTE_IO:
            if expect is not None:
                _verify(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8), expect, what)
            for item in items:
                planner.load_bytes(item, io.BytesIO(raw))
            return
        try:
            stored = _torch_load(raw)
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"{what} is not a readable torch.save tensor: {exc}") from exc
        if expect is not None:
            _verify(stored, expect, what)
        for item in items:
            src = stored
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, off, length)
            dest = planner.resolve_tensor(item).detach()
            if dest.size() != src.size():
                raise PersistentTierError(f"{what}: stored chunk {tuple(src.size())} does not fit {tuple(dest.size())}.")
            dest.copy_(src)
            planner.commit_tensor(item, dest)

    # ---- writing (used by the drain and stock.materialize_step) -----------------------------------
    def step_dir(self, step: int) -> "StepDir":
        return StepDir(self.fs, self.step_path(step), self.is_local, self._u(self.step_path(step)), step=step)

    def read_markers(self, step: int) -> list[PartMarker]:
        return self.step_dir(step).read_markers()

    def delete_step(self, step: int) -> None:
        """Remove ``.metadata`` first (the step stops being a checkpoint at once), then the rest."""
        self._rm_quiet(f"{self.step_path(step)}/{METADATA}")
        try:
            self.fs.rm(self.step_path(step), recursive=True)
        except FileNotFoundError:
            pass
        self._meta_cache.pop(step, None)

    def apply_retention(self, protect: Iterable[int] = ()) -> list[int]:
        """Keep the newest ``keep`` complete steps and every ``keep_every``-th; never the newest complete one.

        Incomplete step directories older than the newest complete step, and not
        in ``protect`` (still being drained), are leftovers of abandoned drains
        and are removed too. Returns the steps deleted.
        """
        steps = self.all_steps()
        complete = [s for s in steps if self.is_complete(s)]
        if not complete:
            return []
        newest = complete[-1]
        keep = set(complete if self.keep is None else complete[-self.keep :])
        if self.keep_every:
            keep |= {s for s in complete if s % self.keep_every == 0}
        keep.add(newest)
        protect = set(protect)
        deleted = []
        for s in steps:
            if s in keep or s in protect:
                continue
            if s in complete or s < newest:
                self.delete_step(s)
                deleted.append(s)
        return deleted

    # ---- helpers -------------------------------------------------------------------------
    def _fresh(self, path: str) -> None:
        _fresh(self.fs, path)

    def _rm_quiet(self, path: str) -> None:
        _rm_quiet(self.fs, path)

    def _u(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def __repr__(self) -> str:
        return f"PersistentTier({self.url!r}, job_id={self.job_id!r}, keep={self.keep}, keep_every={self.keep_every})"


class StepDir:
    """One checkpoint directory being written in a store: data files, part markers, index, ``.metadata``."""

    def __init__(self, fs: Any, path: str, is_local: bool, url: str, step: int | None = None) -> None:
        self.fs = fs
        self.path = path.rstrip("/")
        self.is_local = is_local
        self.url = url
        self.step = step

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None, probe: bool = True) -> "StepDir":
        """A checkpoint directory given by its own URL (``materialize_step``'s destination)."""
        url = url.rstrip("/") if "://" in url else os.path.abspath(os.path.expanduser(url))
        fs, path = _url_to_fs(url, dict(storage_options or {}))
        is_local = _protocol(fs) in _LOCAL_PROTOCOLS
        sd = cls(fs, path, is_local, path if is_local else fs.unstrip_protocol(path))
        if probe:
            try:
                if is_local:
                    fs.makedirs(sd.path, exist_ok=True)
                p = f"{sd.path}/.gemini-probe-{uuid.uuid4().hex[:12]}"
                fs.pipe_file(p, b"gemini_dcp write probe")
                fs.rm_file(p)
            except Exception as exc:  # noqa: BLE001
                raise PersistentTierError(_explain(exc, url, sd.path, True)) from exc
        return sd

    def file(self, rel: str) -> str:
        return f"{self.path}/{rel}"

    def marker_path(self, node_id: str) -> str:
        return self.file(f"{SIDE_DIR}/part-{node_tag(node_id)}.pkl")

    def is_complete(self) -> bool:
        _fresh(self.fs, self.path)
        return bool(self.fs.exists(self.file(METADATA)))

    def begin(self, node_id: str) -> None:
        """Before (re)writing data here: remove ``.metadata`` (so old metadata never meets new data) and this node's marker."""
        for path in (self.file(METADATA), self.marker_path(node_id)):
            _rm_quiet(self.fs, path)
        if self.is_local:
            self.fs.makedirs(self.file(SIDE_DIR), exist_ok=True)

    def open_write(self, rel: str) -> Any:
        if self.is_local:
            self.fs.makedirs(self.path, exist_ok=True)
            return open(self.file(rel), "wb")  # noqa: SIM115 - closed by the caller
        return self.fs.open(self.file(rel), "wb", block_size=64 << 20)

    def put_bytes(self, rel: str, data: bytes, *, atomic: bool = False) -> None:
        """Write one small object; ``atomic``: tmp + fsync + rename on local filesystems (one put elsewhere)."""
        path = self.file(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}" if atomic else path
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if atomic:
                os.replace(tmp, path)
                _fsync_dir(os.path.dirname(path))
        else:
            self.fs.pipe_file(path, data)

    def write_marker(self, marker: PartMarker) -> None:
        self.put_bytes(f"{SIDE_DIR}/part-{node_tag(marker.node_id)}.pkl", pickle.dumps(marker), atomic=True)

    def read_markers(self) -> list[PartMarker]:
        side = self.file(SIDE_DIR)
        _fresh(self.fs, side)
        try:
            names = self.fs.ls(side, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = str(n).rstrip("/").rsplit("/", 1)[-1]
            if not (base.startswith("part-") and base.endswith(".pkl")):
                continue
            try:
                obj = pickle.loads(self.fs.cat_file(f"{side}/{base}"))
            except FileNotFoundError:
                continue
            except Exception as exc:  # noqa: BLE001
                log.warning("ignoring unreadable part marker %s/%s: %s", side, base, exc)
                continue
            if isinstance(obj, PartMarker):
                out.append(obj)
        return out

    def commit(self, metadata: Metadata, index: StepIndex) -> None:
        """Write the checksum index, then ``.metadata`` (last: the commit)."""
        self.put_bytes(f"{SIDE_DIR}/{INDEX}", pickle.dumps(index), atomic=True)
        self.put_bytes(METADATA, pickle.dumps(metadata), atomic=True)


# ---- module helpers ----------------------------------------------------------------------------
def _url_to_fs(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ValueError as exc:
        proto = url.split("://", 1)[0] if "://" in url else "file"
        known = sorted(p for p in fsspec.available_protocols() if len(p) < 12)
        raise PersistentTierError(
            f"persistent={url!r}: fsspec does not know the protocol {proto!r} ({exc}). "
            f"Use one of {known[:30]} (e.g. file://, s3://, gs://, memory://)."
        ) from exc
    except ImportError as exc:
        raise PersistentTierError(
            f"persistent={url!r}: the package that implements this protocol is not installed ({exc}). "
            "Install it (s3:// needs s3fs, gs:// gcsfs, az:// adlfs) in every worker's environment."
        ) from exc
    except Exception as exc:  # noqa: BLE001
        raise PersistentTierError(f"persistent={url!r}: cannot open the store: {type(exc).__name__}: {exc}") from exc


def _fresh(fs: Any, path: str) -> None:
    """Drop fsspec's listing cache (s3fs caches directory listings) so polls see new objects."""
    try:
        fs.invalidate_cache(path)
    except Exception:  # noqa: BLE001 - a cache is an optimisation
        pass


def _rm_quiet(fs: Any, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if fs.exists(path):
            raise PersistentTierError(f"cannot delete {path}: {exc}") from exc


def _protocol(fs: Any) -> str:
    p = fs.protocol
    return p[0] if isinstance(p, (tuple, list)) else str(p)


def _explain(exc: BaseException, url: str, base: str, writable: bool) -> str:
    name = type(exc).__name__
    text = f"{name}: {exc}"
    act = "write to" if writable else "reach"
    if "Credential" in name or "credential" in str(exc).lower() and "no" in str(exc).lower():
        return (
            f"persistent={url!r}: missing credentials for the store ({text}). Configure them in every worker's "
            "environment (e.g. AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE for s3://) before training starts."
        )
    if isinstance(exc, PermissionError) or "AccessDenied" in str(exc) or "Forbidden" in str(exc) or "403" in str(exc):
        return (
            f"persistent={url!r}: no permission to {act} {base} ({text}). Grant this user write access "
            "to that location, or choose another URL."
        )
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in str(exc):
        return (
            f"persistent={url!r}: {base} cannot be created or does not exist ({text}). Create the bucket / "
            "parent directory first, or fix the URL."
        )
    if isinstance(exc, OSError) and getattr(exc, "errno", None) is not None:
        return f"persistent={url!r}: cannot {act} {base} ({text})."
    return f"persistent={url!r}: cannot {act} the store at {base} ({text}). Check the URL, endpoint and network."


def _expected(planner_ref: Any, index: StepIndex | None, idx: MetadataIndex) -> tuple[str, int] | None:
    if isinstance(planner_ref, ShardRef):
        return (planner_ref.algo, planner_ref.checksum)
    if index is not None:
        return index.checksums.get(idx)
    return None


def _torch_load(raw: bytes) -> torch.Tensor:
    t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor):
        raise PersistentTierError(f"stored item holds a {type(t).__name__}, not a tensor.")
    return t


def _verify(t: torch.Tensor, expect: tuple[str, int], what: str) -> None:
    algo, value = expect
    flat = as_bytes(t.contiguous())
    if flat is None:
        return
    got = checksum(flat, algo)
    if got != value:
        raise PersistentChecksumError(
            f"{what} failed its {algo} checksum (stored bytes differ from what was saved): the object was "
            "corrupted or overwritten in the store. Load another step."
        )


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
