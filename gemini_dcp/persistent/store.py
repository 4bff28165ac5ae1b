"""The persistent tier: stock DCP checkpoints in any fsspec store.

Layout (one directory per drained step, each a **stock DCP checkpoint** that
``dcp.load(sd, checkpoint_id="<url>/<job_id>/step-<N>")`` reads with torch's own
FileSystemReader / FsspecReader)::

    <url>/<job_id>/step-<N>/__<rank>_0.distcp     # one file per saving rank, items as torch.save bytes
    <url>/<job_id>/step-<N>/.gemini/part-<node>.pkl  # a node finished its ranks' files (written after them)
    <url>/<job_id>/step-<N>/.gemini/index.pkl     # checksums of every item (written before .metadata)
    <url>/<job_id>/step-<N>/.metadata             # written LAST: its presence is the commit

This module is the store itself: one job's steps in a store (paths, the access probe,
listing, the committed steps, their ``.metadata`` and index, retention). Its parts, each a
module of its own, and re-exported here (the drain, the CLI and the tests import them from
``gemini_dcp.persistent.store``):

* :mod:`~gemini_dcp.persistent.step_dir` — a step directory being written (data files go
  first, ``.metadata`` last: its presence is the commit).
* :mod:`~gemini_dcp.persistent.store_reads` — items read back, each verified by the chunk
  sink (:mod:`gemini_dcp.core.chunk_sink`) before it is handed on.
* :mod:`~gemini_dcp.persistent.side_files` — the marker and index records and their decoding
  (**side files are untrusted input**: decoded without running code).
* :mod:`~gemini_dcp.persistent.store_calls` — every store call under a deadline
  (:class:`PersistentTimeoutError` instead of a hang), opening a URL, explaining a failure.

Errors reaching the store (unknown protocol, missing package, missing
credentials, no permission, no such bucket) are raised as
:class:`PersistentTierError` when the tier is constructed, by a probe: a
writable tier writes and deletes a tiny object under ``<url>/<job_id>/``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from typing import Any, Callable, Iterable, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ..core.chunk_sink import StagedChunks
from ..core.config import check_timeout, resolve_job_id
from ..errors import ConfigError, PersistentTierError, StepNotFoundError
from . import store_reads
from .health_file import read_health
from .item_payload import MappedFile
from .side_files import (
    INDEX,
    METADATA,
    SIDE_DIR,
    SIDE_FILE_GLOBALS,
    PartMarker,
    StepIndex,
    UntrustedSideFileError,
    data_file,
    decode_side_file,
    node_tag,
)
from .step_dir import StepDir
from .store_calls import (
    DEFAULT_TIMEOUT_S,
    INLINE_PROTOCOLS,
    LOCAL_PROTOCOLS,
    WRITE_BUFFER,
    PersistentTimeoutError,
    bounded_call,
    explain,
    fresh,
    protocol_of,
    rm_quiet,
    url_to_fs,
)
from .store_reads import PersistentChecksumError

__all__ = [  # the names the drain, the CLI and the tests import from here
    "DEFAULT_TIMEOUT_S",
    "INDEX",
    "METADATA",
    "SIDE_DIR",
    "SIDE_FILE_GLOBALS",
    "WRITE_BUFFER",
    "PartMarker",
    "PersistentChecksumError",
    "PersistentTier",
    "PersistentTimeoutError",
    "StepDir",
    "StepIndex",
    "UntrustedSideFileError",
    "bounded_call",
    "data_file",
    "decode_side_file",
    "node_tag",
]

log = logging.getLogger(__name__)

_STEP_DIR_RE = re.compile(r"^step-(\d+)$")
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
        """Read ``plan``'s items of ``step``, verified; bytes read (:func:`.store_reads.read_items`).

        ``keep`` is handed every local data file mapped for the staged views, so the caller
        decides where the mapping is undone (off the restore's critical path)."""
        return store_reads.read_items(self, step, plan, planner, stage=stage, keep=keep)

    def read_item_bytes(self, step: int, idx: MetadataIndex) -> tuple[bytes, bool]:
        """Raw stored bytes of one item (torch.save bytes for a tensor) and whether it is a BYTE_IO item."""
        return store_reads.read_item_bytes(self, step, idx)

    def load_item(self, step: int, idx: MetadataIndex, expect: tuple[str, int] | None = None) -> torch.Tensor:
        """One stored item as a tensor (uint8 for bytes items), verified against ``expect`` or the index."""
        return store_reads.load_item(self, step, idx, expect)

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
            data = read_health(self.step_dir(s))
            if data is not None and not data["healthy"]:
                out.append(s)
        return out

    def apply_retention(self, protect: Iterable[int] = ()) -> list[int]:
        """Keep the newest ``keep`` complete steps and every ``keep_every``-th; never the newest complete one,
        nor the newest healthy one while unhealthy steps follow it (:mod:`gemini_dcp.health`).

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
        for s in reversed(complete):  # the newest healthy step stays restorable behind unhealthy ones
            if not self.unhealthy_steps([s]):
                keep.add(s)
                break
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
        fresh(self.fs, path)

    def _rm_quiet(self, path: str) -> None:
        rm_quiet(self.fs, path, self._deadline, self.shown(path))

    def shown(self, path: str) -> str:
        """``path`` as messages show it: a plain path for local files, else a URL."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def __repr__(self) -> str:
        return f"PersistentTier({self.url!r}, job_id={self.job_id!r}, keep={self.keep}, keep_every={self.keep_every})"
