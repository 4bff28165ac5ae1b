"""Every call to an fsspec store, under a deadline: the persistent tier's I/O plumbing.

**Every store call has a deadline** (``timeout_s``: the writer's / reader's ``timeout_s``,
carried into the drain's requests): the probe, listings, reads, deletes and each buffered
write of an upload. A store that accepts connections but never answers raises
:class:`PersistentTimeoutError` (a ``PersistentTierError``) naming the URL, the operation and
the time waited, instead of blocking the caller. Remote calls run in a worker thread that is
abandoned (a daemon) when it overruns; s3fs additionally gets botocore connect/read timeouts
(``config_kwargs``) so the abandoned call ends by itself. ``file://`` and ``memory://`` calls
run inline (no network to wait on).

Also here: opening a URL as a filesystem with a clear error for an unknown protocol or a
missing package, and the explanation of a failed probe (credentials, permission, bucket).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec

from ..errors import PersistentTierError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INLINE_PROTOCOLS",
    "LOCAL_PROTOCOLS",
    "WRITE_BUFFER",
    "DeadlineWriter",
    "PersistentTimeoutError",
    "bounded_call",
    "explain",
    "fresh",
    "fsync_dir",
    "protocol_of",
    "rm_quiet",
    "url_to_fs",
]

LOCAL_PROTOCOLS = frozenset({"file", "local"})
# Calls to these run inline: no network between this process and the bytes.
INLINE_PROTOCOLS = LOCAL_PROTOCOLS | {"memory"}
DEFAULT_TIMEOUT_S = 300.0
WRITE_BUFFER = 8 << 20  # upload bytes buffered here, handed to the store in calls of at least this size
_T = TypeVar("_T")


class PersistentTimeoutError(PersistentTierError):
    """A persistent-store call did not finish within its deadline (``timeout_s``)."""


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


def with_timeouts(url: str, options: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
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


def url_to_fs(url: str, options: dict[str, Any], timeout_s: float | None = None) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(url, **with_timeouts(url, options, timeout_s))
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


def fresh(fs: Any, path: str) -> None:
    """Drop fsspec's listing cache (s3fs caches directory listings) so polls see new objects."""
    try:
        fs.invalidate_cache(path)
    except Exception:  # noqa: BLE001 - a cache is an optimisation
        pass


def rm_quiet(fs: Any, path: str, timeout_s: float | None = None, shown: str | None = None) -> None:
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


class DeadlineWriter:
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

    def __enter__(self) -> DeadlineWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def protocol_of(fs: Any) -> str:
    p = fs.protocol
    return p[0] if isinstance(p, (tuple, list)) else str(p)


def explain(exc: BaseException, url: str, base: str, writable: bool) -> str:
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


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
