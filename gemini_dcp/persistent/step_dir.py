"""One checkpoint directory being written in a store: data files, part markers, index, ``.metadata``.

Data files go first and ``.metadata`` last, as one object put (object stores) or a tmp file +
rename (local filesystems): a step without ``.metadata`` is not a checkpoint, whatever else is
there, so a drain that dies midway leaves nothing a reader would take. Before any data of a step
is (re)written its old ``.metadata`` is deleted (:meth:`StepDir.begin`), so a re-drain of the
same step can never pair an old ``.metadata`` with new data. Every store call runs under the
deadline (:mod:`gemini_dcp.persistent.store_calls`).
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import PersistentTierError
from ..options.checks import check_timeout
from .side_files import (
    INDEX,
    METADATA,
    SIDE_DIR,
    PartMarker,
    StepIndex,
    decode_side_file,
    node_tag,
)
from .store_calls import (
    DEFAULT_TIMEOUT_S,
    INLINE_PROTOCOLS,
    LOCAL_PROTOCOLS,
    DeadlineWriter,
    PersistentTimeoutError,
    bounded_call,
    explain,
    fresh,
    fsync_dir,
    protocol_of,
    rm_quiet,
    url_to_fs,
)

__all__ = ["StepDir"]

_T = TypeVar("_T")


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
        self.timeout_s = None if protocol_of(fs) in INLINE_PROTOCOLS else timeout_s

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        probe: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> StepDir:
        """A checkpoint directory given by its own URL (``materialize_step``'s destination).

        ``timeout_s`` bounds every store call made through it (PersistentTimeoutError).
        """
        timeout_s = check_timeout(timeout_s)
        url = url.rstrip("/") if "://" in url else os.path.abspath(os.path.expanduser(url))
        fs, path = url_to_fs(url, dict(storage_options or {}), timeout_s)
        is_local = protocol_of(fs) in LOCAL_PROTOCOLS
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
                raise PersistentTierError(explain(exc, url, sd.path, True)) from exc
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
        fresh(self.fs, self.path)
        return bool(self._call("existence check of", self.file(METADATA), self.fs.exists, self.file(METADATA)))

    def begin(self, node_id: str) -> None:
        """Before (re)writing data here: remove ``.metadata`` (so old metadata never meets new data) and this node's marker."""
        for path in (self.file(METADATA), self.marker_path(node_id)):
            rm_quiet(self.fs, path, self.timeout_s, path)
        if self.is_local:
            self.fs.makedirs(self.file(SIDE_DIR), exist_ok=True)

    def open_write(self, rel: str) -> Any:
        """A binary file for writing ``rel`` (``write``/``tell``/``flush``/``close``): local, or a
        remote one whose every store call runs under the deadline (:class:`DeadlineWriter`)."""
        if self.is_local:
            self.fs.makedirs(self.path, exist_ok=True)
            return open(self.file(rel), "wb")  # noqa: SIM115 - closed by the caller
        path = self.file(rel)
        f = self._call("open for writing of", path, self.fs.open, path, "wb", block_size=64 << 20)
        if self.timeout_s is None:
            return f
        return DeadlineWriter(f, self.timeout_s, f"persistent store: upload of {self.fs.unstrip_protocol(path)}")

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
                fsync_dir(os.path.dirname(path))
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
        fresh(self.fs, side)
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
