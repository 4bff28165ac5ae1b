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

**Every store call has a deadline** (``timeout_s``: the writer's / reader's
``timeout_s``, carried into the drain's requests): the probe, listings, reads,
deletes and each buffered write of an upload. A store that accepts connections
but never answers raises :class:`PersistentTimeoutError` (a
``PersistentTierError``) naming the URL, the operation and the time waited,
instead of blocking the caller. Remote calls run in a worker thread that is
abandoned (a daemon) when it overruns; s3fs additionally gets botocore
connect/read timeouts (``config_kwargs``) so the abandoned call ends by itself.
``file://`` and ``memory://`` calls run inline (no network to wait on).

**Side files are untrusted input**: ``.metadata``, ``index.pkl`` and
``part-*.pkl`` are decoded with :func:`gemini_dcp.core.safe_pickle.restricted_loads`
(only DCP metadata classes and this module's :class:`StepIndex` /
:class:`PartMarker` may appear); a refused or unreadable index is an error, never
a load without checksums.
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
from typing import Any, Callable, Iterable, TypeVar

import fsspec
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..core.checksum import as_bytes, checksum
from ..core.config import check_timeout, resolve_job_id
from ..errors import ChecksumMismatchError, ConfigError, PersistentTierError, StepNotFoundError, UntrustedDataError
from ..local.records import ShardRef
from ..core.safe_pickle import restricted_loads

log = logging.getLogger(__name__)

METADATA = ".metadata"
SIDE_DIR = ".gemini"
INDEX = "index.pkl"
_STEP_DIR_RE = re.compile(r"^step-(\d+)$")
_LOCAL_PROTOCOLS = {"file", "local"}
# Calls to these run inline: no network between this process and the bytes.
_INLINE_PROTOCOLS = _LOCAL_PROTOCOLS | {"memory"}
DEFAULT_TIMEOUT_S = 300.0
WRITE_BUFFER = 8 << 20  # upload bytes buffered here, handed to the store in calls of at least this size
_T = TypeVar("_T")

#: Globals a side file of the persistent tier may name, beyond safe_pickle's DCP metadata classes.
SIDE_FILE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("gemini_dcp.persistent.store", "StepIndex"),
        ("gemini_dcp.persistent.store", "PartMarker"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
)

# Successful probes, per process: a writer constructed for every save probes the store once.
_PROBED: set[tuple[str, str, bool]] = set()
_PROBE_LOCK = threading.Lock()


class PersistentChecksumError(PersistentTierError, ChecksumMismatchError):
    """An item read from the persistent tier does not match the checksum recorded when it was saved."""


class PersistentTimeoutError(PersistentTierError):
    """A persistent-store call did not finish within its deadline (``timeout_s``)."""


class UntrustedSideFileError(PersistentTierError, UntrustedDataError):
    """A side file of the persistent store (index, part marker, metadata) was refused or is unreadable."""


def bounded_call(
    timeout_s: float | None, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any
) -> _T:
    """Run ``fn(*args, **kwargs)`` in a worker thread; PersistentTimeoutError after ``timeout_s``.

    ``what`` names the operation and URL for the message. The worker is a daemon
    thread: one that overruns is abandoned (it cannot be interrupted) and never
    blocks the interpreter's exit. ``timeout_s=None`` calls ``fn`` inline.
    """
    if timeout_s is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=run, name="gemini-dcp-store-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise PersistentTimeoutError(
            f"{what} did not finish within {timeout_s:g} s (waited {time.monotonic() - t0:.1f} s): the store "
            "accepts the request but does not answer. Check the endpoint, the network and the store's health; "
            "if it is merely slow, raise timeout_s (the writer's / reader's, which bounds every store call)."
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def decode_side_file(data: bytes, source: str, expect: type | tuple[type, ...]) -> Any:
    """Decode a pickled side file without running code; UntrustedSideFileError if refused or not ``expect``."""
    try:
        obj = restricted_loads(data, source=source, allowed=SIDE_FILE_GLOBALS)
    except UntrustedDataError as exc:
        raise UntrustedSideFileError(
            f"{exc} It was refused; nothing in it ran and the step is not used. Delete {source} (or the whole "
            "step directory) and let the drain write the step again, or load another step."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - IncompatibleCheckpointError and the like
        raise UntrustedSideFileError(
            f"{source} cannot be decoded ({type(exc).__name__}: {exc}); the step is not used. Delete it, or load "
            "another step."
        ) from exc
    if not isinstance(obj, expect):
        names = expect.__name__ if isinstance(expect, type) else "/".join(t.__name__ for t in expect)
        raise UntrustedSideFileError(
            f"{source} holds a {type(obj).__name__}, not a {names}: it was not written by gemini_dcp. "
            "Delete it (or the step directory), or load another step."
        )
    return obj


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
        self.fs, root_path = _url_to_fs(self.url, self.storage_options, self.timeout_s)
        self.protocol = _protocol(self.fs)
        self._deadline: float | None = None if self.protocol in _INLINE_PROTOCOLS else self.timeout_s
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

    def _call(self, op: str, path: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """One store call under this tier's deadline (inline for file:// and memory://)."""
        return bounded_call(self._deadline, f"persistent store {self.url}: {op} {self._u(path)}", fn, *args, **kwargs)

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
            self._call("write probe of" if self.writable else "probe of", self.base, probe)
        except PersistentTimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified into one clear error
            raise PersistentTierError(_explain(exc, self.url, self.base, self.writable)) from exc
        with _PROBE_LOCK:
            _PROBED.add(key)

    # ---- listing -------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Every step directory present (complete or not), ascending."""
        self._fresh(self.base)
        try:
            entries = self._call("listing of", self.base, self.fs.ls, self.base, detail=False)
        except FileNotFoundError:
            return []
        except PersistentTierError:
            raise
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
        path = f"{self.step_path(step)}/{METADATA}"
        try:
            return bool(self._call("existence check of", path, self.fs.exists, path))
        except PersistentTierError:
            raise
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
            raw = self._call("read of", path, self.fs.cat_file, path)
        except FileNotFoundError as exc:
            raise StepNotFoundError(
                f"step {step} of job {self.job_id!r} is not complete in the persistent tier {self.url} "
                f"(no {self._u(path)}); complete steps: {self.committed_steps()}."
            ) from exc
        except PersistentTierError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"cannot read {self._u(path)}: {type(exc).__name__}: {exc}") from exc
        md = decode_side_file(raw, self._u(path), Metadata)
        if not isinstance(md.storage_data, dict):
            raise PersistentTierError(f"{self._u(path)} does not hold DCP Metadata with storage_data.")
        index: StepIndex | None = None
        ipath = f"{self.step_path(step)}/{SIDE_DIR}/{INDEX}"
        try:
            raw_index = self._call("read of", ipath, self.fs.cat_file, ipath)
        except FileNotFoundError:
            # A stock checkpoint written by something else (plain DCP): it has no checksums to verify.
            log.info("%s has no %s: its items are loaded without checksum verification", self._u(path), self._u(ipath))
            raw_index = None
        except PersistentTierError:
            raise
        except Exception as exc:  # noqa: BLE001 - never "no checksums" for an index that exists
            raise PersistentTierError(
                f"cannot read the checksum index {self._u(ipath)} of step {step}: {type(exc).__name__}: {exc}. "
                "Without it the step's bytes cannot be verified, so it is not loaded: check the store, or load another step."
            ) from exc
        if raw_index is not None:
            index = decode_side_file(raw_index, self._u(ipath), StepIndex)
        self._meta_cache[step] = (md, index)
        return md, index

    def read_items(
        self, step: int, plan: LoadPlan, planner: LoadPlanner, *, stage: list[tuple[list[ReadItem], Any]] | None = None
    ) -> int:
        """Read ``plan``'s items of ``step`` into the planner's tensors / ``load_bytes``; returns bytes read.

        Every item is checked against the checksum recorded when it was saved:
        the in-memory ShardRef when the planner's metadata comes from a memory
        record (a mixed restore of the same step), else the step's index.
        Raises PersistentTierError (ChecksumMismatchError for bad bytes).

        ``stage``: nothing is applied; each verified item is appended as ``(read items,
        stored tensor in its saved dtype | raw bytes of a bytes item)`` for the caller to
        apply once everything is verified (the reader's all-or-nothing load).
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
                f = self._call("open of", path, self.fs.open, path, "rb", block_size=8 << 20)
                try:
                    for idx, info in entries:
                        f.seek(info.offset)
                        raw = self._call(f"read of {info.length} bytes at {info.offset} of", path, f.read, info.length)
                        if len(raw) != info.length:
                            raise PersistentTierError(
                                f"{self._u(path)} is truncated: item {idx.fqn!r} needs bytes {info.offset}+{info.length}."
                            )
                        expect = _expected(planner_sd.get(idx), index, idx)
                        self._apply(step, idx, raw, by_index[idx], planner, expect, path, stage)
                        total += info.length
                finally:
                    try:
                        self._call("close of", path, f.close)
                    except Exception as exc:  # noqa: BLE001 - a read-only handle; what was read stands
                        log.debug("closing %s failed: %s", self._u(path), exc)
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
        raw = self._call("read of", path, self.fs.cat_file, path, start=info.offset, end=info.offset + info.length)
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
        expect: tuple[str, int] | None, path: str, stage: list[tuple[list[ReadItem], Any]] | None = None,
    ) -> None:
        what = f"item {idx.fqn!r} (offset {tuple(idx.offset or ())}) of step {step} in {self._u(path)}"
        if items[0].type == LoadItemType.BYTE_IO:
            if expect is not None:
                _verify(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8), expect, what)
            if stage is not None:
                stage.append((items, raw))
                return
            for item in items:
                planner.load_bytes(item, io.BytesIO(raw))
            return
        try:
            stored = _torch_load(raw)
        except Exception as exc:  # noqa: BLE001
            raise PersistentTierError(f"{what} is not a readable torch.save tensor: {exc}") from exc
        if expect is not None:
            _verify(stored, expect, what)
        if stage is not None:
            stage.append((items, stored))  # the saved dtype: the reader converts as it applies
            return
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
        return StepDir(
            self.fs, self.step_path(step), self.is_local, self._u(self.step_path(step)), step=step, timeout_s=self._deadline
        )

    def read_markers(self, step: int) -> list[PartMarker]:
        return self.step_dir(step).read_markers()

    def delete_step(self, step: int) -> None:
        """Remove ``.metadata`` first (the step stops being a checkpoint at once), then the rest."""
        self._rm_quiet(f"{self.step_path(step)}/{METADATA}")
        try:
            self._call("delete of", self.step_path(step), self.fs.rm, self.step_path(step), recursive=True)
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
        _rm_quiet(self.fs, path, self._deadline, self._u(path))

    def _u(self, path: str) -> str:
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def __repr__(self) -> str:
        return f"PersistentTier({self.url!r}, job_id={self.job_id!r}, keep={self.keep}, keep_every={self.keep_every})"


class StepDir:
    """One checkpoint directory being written in a store: data files, part markers, index, ``.metadata``."""

    def __init__(
        self, fs: Any, path: str, is_local: bool, url: str, step: int | None = None, timeout_s: float | None = None
    ) -> None:
        self.fs = fs
        self.path = path.rstrip("/")
        self.is_local = is_local
        self.url = url
        self.step = step
        # Deadline of each store call (None: inline, for file:// and memory://).
        self.timeout_s = None if _protocol(fs) in _INLINE_PROTOCOLS else timeout_s

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        probe: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> "StepDir":
        """A checkpoint directory given by its own URL (``materialize_step``'s destination).

        ``timeout_s`` bounds every store call made through it (PersistentTimeoutError).
        """
        timeout_s = check_timeout(timeout_s)
        url = url.rstrip("/") if "://" in url else os.path.abspath(os.path.expanduser(url))
        fs, path = _url_to_fs(url, dict(storage_options or {}), timeout_s)
        is_local = _protocol(fs) in _LOCAL_PROTOCOLS
        sd = cls(fs, path, is_local, path if is_local else fs.unstrip_protocol(path), timeout_s=timeout_s)
        if probe:

            def run() -> None:
                if is_local:
                    fs.makedirs(sd.path, exist_ok=True)
                p = f"{sd.path}/.gemini-probe-{uuid.uuid4().hex[:12]}"
                fs.pipe_file(p, b"gemini_dcp write probe")
                fs.rm_file(p)

            try:
                sd._call("write probe of", sd.path, run)
            except PersistentTimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise PersistentTierError(_explain(exc, url, sd.path, True)) from exc
        return sd

    def _call(self, op: str, path: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """One store call under the deadline (inline for file:// and memory://)."""
        shown = path if self.is_local else self.fs.unstrip_protocol(path)
        return bounded_call(self.timeout_s, f"persistent store: {op} {shown}", fn, *args, **kwargs)

    def file(self, rel: str) -> str:
        return f"{self.path}/{rel}"

    def marker_path(self, node_id: str) -> str:
        return self.file(f"{SIDE_DIR}/part-{node_tag(node_id)}.pkl")

    def is_complete(self) -> bool:
        _fresh(self.fs, self.path)
        return bool(self._call("existence check of", self.file(METADATA), self.fs.exists, self.file(METADATA)))

    def begin(self, node_id: str) -> None:
        """Before (re)writing data here: remove ``.metadata`` (so old metadata never meets new data) and this node's marker."""
        for path in (self.file(METADATA), self.marker_path(node_id)):
            _rm_quiet(self.fs, path, self.timeout_s, path)
        if self.is_local:
            self.fs.makedirs(self.file(SIDE_DIR), exist_ok=True)

    def open_write(self, rel: str) -> Any:
        """A binary file for writing ``rel`` (``write``/``tell``/``flush``/``close``): local, or a
        remote one whose every store call runs under the deadline (:class:`_DeadlineWriter`)."""
        if self.is_local:
            self.fs.makedirs(self.path, exist_ok=True)
            return open(self.file(rel), "wb")  # noqa: SIM115 - closed by the caller
        path = self.file(rel)
        f = self._call("open for writing of", path, self.fs.open, path, "wb", block_size=64 << 20)
        if self.timeout_s is None:
            return f
        return _DeadlineWriter(f, self.timeout_s, f"persistent store: upload of {self.fs.unstrip_protocol(path)}")

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
            self._call(f"write of {len(data)} bytes to", path, self.fs.pipe_file, path, data)

    def write_marker(self, marker: PartMarker) -> None:
        self.put_bytes(f"{SIDE_DIR}/part-{node_tag(marker.node_id)}.pkl", pickle.dumps(marker), atomic=True)

    def read_markers(self) -> list[PartMarker]:
        """The part markers written here (decoded without running code).

        Raises UntrustedSideFileError for a marker that is refused or unreadable (naming it):
        a part nobody can trust must stop the commit, not be skipped silently.
        """
        side = self.file(SIDE_DIR)
        _fresh(self.fs, side)
        try:
            names = self._call("listing of", side, self.fs.ls, side, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = str(n).rstrip("/").rsplit("/", 1)[-1]
            if not (base.startswith("part-") and base.endswith(".pkl")):
                continue
            path = f"{side}/{base}"
            try:
                raw = self._call("read of", path, self.fs.cat_file, path)
            except FileNotFoundError:
                continue
            shown = path if self.is_local else self.fs.unstrip_protocol(path)
            out.append(decode_side_file(raw, shown, PartMarker))
        return out

    def read_index(self) -> StepIndex | None:
        """The checksum index written here (None if there is none); decoded without running code."""
        path = self.file(f"{SIDE_DIR}/{INDEX}")
        try:
            raw = self._call("read of", path, self.fs.cat_file, path)
        except FileNotFoundError:
            return None
        return decode_side_file(raw, path if self.is_local else self.fs.unstrip_protocol(path), StepIndex)

    def commit(self, metadata: Metadata, index: StepIndex) -> None:
        """Write the checksum index, then ``.metadata`` (last: the commit)."""
        self.put_bytes(f"{SIDE_DIR}/{INDEX}", pickle.dumps(index), atomic=True)
        self.put_bytes(METADATA, pickle.dumps(metadata), atomic=True)


# ---- module helpers ----------------------------------------------------------------------------
def _with_timeouts(url: str, options: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    """``options`` plus botocore connect/read timeouts for s3:// (unless the caller set ``config_kwargs``).

    The deadline of :func:`bounded_call` frees the caller; these make the abandoned
    request end by itself too, instead of waiting on a dead socket for ever.
    """
    proto = url.split("://", 1)[0].lower() if "://" in url else "file"
    if timeout_s is None or proto not in ("s3", "s3a") or "config_kwargs" in options:
        return options
    conf = (fsspec.config.conf.get("s3") or {}).get("config_kwargs") or {}
    cfg = {"connect_timeout": min(timeout_s, 60.0), "read_timeout": timeout_s, "retries": {"max_attempts": 2}}
    return {**options, "config_kwargs": {**cfg, **conf}}


def _url_to_fs(url: str, options: dict[str, Any], timeout_s: float | None = None) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(url, **_with_timeouts(url, options, timeout_s))
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


def _rm_quiet(fs: Any, path: str, timeout_s: float | None = None, shown: str | None = None) -> None:
    what = f"persistent store: delete of {shown or path}"
    try:
        bounded_call(timeout_s, what, fs.rm_file, path)
    except FileNotFoundError:
        pass
    except PersistentTierError:
        raise
    except OSError as exc:
        if bounded_call(timeout_s, what, fs.exists, path):
            raise PersistentTierError(f"cannot delete {shown or path}: {exc}") from exc


class _DeadlineWriter:
    """A remote file opened for writing whose store calls each run under a deadline.

    Writes are buffered here and handed to the store in calls of at least
    :data:`WRITE_BUFFER` bytes (few worker-thread hand-offs for the many small
    writes of ``torch.save``); ``close`` uploads the rest. An overrun raises
    PersistentTimeoutError; the store's own file is then abandoned, never committed.
    """

    def __init__(self, f: Any, timeout_s: float, what: str) -> None:
        self._f = f
        self._timeout = timeout_s
        self._what = what
        self._buf = bytearray()
        self._pos = 0  # bytes handed to the store
        self._failed = False  # a call failed or overran: the upload is abandoned, close() does nothing

    def write(self, data: Any) -> int:
        if self._failed:
            raise PersistentTierError(f"{self._what} was abandoned after an earlier failure; start the upload again.")
        mv = memoryview(data).cast("B")
        self._buf += mv
        if len(self._buf) >= WRITE_BUFFER:
            self._drain()
        return mv.nbytes

    def _drain(self) -> None:
        if self._buf:
            chunk, self._buf = self._buf, bytearray()  # handed over whole: no copy
            try:
                bounded_call(self._timeout, f"{self._what} ({len(chunk)} bytes at {self._pos})", self._f.write, chunk)
            except BaseException:
                self._failed = True
                raise
            self._pos += len(chunk)

    def tell(self) -> int:
        return self._pos + len(self._buf)

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        self._drain()

    def close(self) -> None:
        if self._failed:
            return
        try:
            self._drain()
            bounded_call(self._timeout, f"{self._what} (final part, {self._pos} bytes in all)", self._f.close)
        except BaseException:
            self._failed = True
            discard = getattr(self._f, "discard", None)
            if callable(discard):
                try:
                    discard()  # no network: drops the unfinished upload's buffer
                except Exception:  # noqa: BLE001 - best effort: the upload is abandoned anyway
                    pass
            raise

    def __enter__(self) -> "_DeadlineWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
