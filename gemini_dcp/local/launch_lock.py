"""Launch locks: one live launch per job in a tier root.

Two jobs that share a job id must not evict each other's steps. Every process of a launch holds
``<job>/launches/<launch id>.lock`` (``lockf``) while its writer lives; a writer of another launch
that finds a live lock refuses with :class:`~gemini_dcp.errors.JobConflictError`, and a lock that
nobody holds (its launch died or finished) is removed. Sibling ranks probe each other's files with
a short bounded retry (docs/reliability.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
import weakref
from pathlib import Path

from ..errors import JobConflictError
from ..transport.launch import LaunchInfo
from .job_dir import ensure_private_dir, open_private, remove_quietly
from .tier import LocalTier, _warn_once

__all__ = ["hold_launch_lock", "live_launches"]


class _HeldLock:
    """This process's shared lock on its launch file of one job dir, held while a writer lives."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd, self.users = path, fd, 0


_held: dict[Path, _HeldLock] = {}
_held_guard = threading.Lock()
# Writers that died: their job dirs, one entry per writer. A writer's finalizer may run inside a
# garbage collection triggered anywhere, even inside hold_launch_lock with the guard held (same
# thread): it only queues its release, applied by whoever holds or next takes the guard.
_releases: list[Path] = []


def _launch_file_text(launch: LaunchInfo) -> bytes:
    return json.dumps(
        {"launch_id": launch.launch_id, "description": launch.description, "host": launch.host, "pid": launch.pid},
        sort_keys=True,
    ).encode()


def _open_lock_file(path: Path, create: bool) -> int:
    """A launch lock file, opened read-write through the checked path (ours, regular, never a link)."""
    return open_private(path, os.O_RDWR | (os.O_CREAT if create else 0))


def hold_launch_lock(tier: LocalTier, launch: LaunchInfo, owner: object) -> weakref.finalize:
    """Hold this launch's lock file of ``tier``'s job while ``owner`` (a writer) lives; refuse a
    second live launch of the same job on the same root.

    Every writer process of a launch holds ``<job_dir>/launches/<launch_id>.lock`` with a shared
    POSIX record lock; the kernel drops it when the process exits (however it dies), so a dead
    launch never blocks: its file is removed. Another launch's file that is still locked belongs
    to a live process: :class:`JobConflictError` names it. Called from every rank (local work only).
    Returns the release: called when ``owner`` goes, or earlier by hand (once; e.g. to hold the
    lock of another launch identity instead).

    POSIX locks (``lockf``), not ``flock``: a child forked without exec (a DataLoader worker) does
    not inherit them, so an orphaned child of a crashed worker cannot block the restarted launch.
    """
    job_dir = tier.layout.job_dir
    with _held_guard:
        _apply_releases()
        held = _held.get(job_dir)
        if held is None:
            ldir = ensure_private_dir(job_dir / "launches")
            path = ldir / f"{launch.launch_id}.lock"
            fd = _lock_own_file(path, launch)
            try:
                _refuse_live_launches(tier, ldir, path)
            except BaseException:
                os.close(fd)
                raise
            held = _held[job_dir] = _HeldLock(path, fd)
        held.users += 1
        release = weakref.finalize(owner, _release_launch_lock, job_dir)
        _apply_releases()
    return release


def _lock_own_file(path: Path, launch: LaunchInfo) -> int:
    """Open (create) and share-lock this launch's file; retried if a prober of another launch
    removed it between our open and our lock (it then looked like a dead launch's file)."""
    for _ in range(20):
        fd = _open_lock_file(path, create=True)
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH)
            try:
                same = os.lstat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                if os.fstat(fd).st_size == 0:
                    os.pwrite(fd, _launch_file_text(launch), 0)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise JobConflictError(f"could not hold {path}: it keeps being removed. Is another launch of this job starting?")


def _release_launch_lock(job_dir: Path) -> None:
    """A writer's finalizer: never blocks (see ``_releases``)."""
    _releases.append(job_dir)
    if _held_guard.acquire(blocking=False):
        try:
            _apply_releases()
        finally:
            _held_guard.release()


def _apply_releases() -> None:
    """Apply queued releases (the guard is held)."""
    while _releases:
        job_dir = _releases.pop()
        held = _held.get(job_dir)
        if held is None:
            continue
        held.users -= 1
        if held.users <= 0:
            del _held[job_dir]
            try:
                os.close(held.fd)  # drops the lock: this launch no longer blocks another
            except OSError:
                pass


def _refuse_live_launches(tier: LocalTier, ldir: Path, mine: Path) -> None:
    try:
        names = os.listdir(ldir)
    except FileNotFoundError:
        return
    for name in sorted(names):
        path = ldir / name
        if path == mine or not name.endswith(".lock"):
            continue
        try:
            fd = _open_lock_file(path, create=False)
        except FileNotFoundError:
            continue  # removed meanwhile by another prober
        except OSError as exc:
            _warn_once(str(path), "cannot check launch file %s: %s", path, exc)
            continue
        try:
            verdict = _probe(path, fd)
            if verdict == "gone":
                continue  # a sibling rank's probe found it dead and removed it
            if verdict == "alive":
                try:
                    info = json.loads(os.pread(fd, 4096, 0) or b"{}")
                except ValueError:
                    info = {}
                raise JobConflictError(
                    f"job {tier.job_id!r} in tier root {tier.root} is in use by another live launch: "
                    f"{info.get('description', '?')} (host {info.get('host', '?')}, pid {info.get('pid', '?')}). "
                    "Two runs sharing a job id would delete and restore each other's steps. Give this run its own "
                    "job_id (GeminiStorageWriter(job_id=...), or torchrun --rdzv-id), or stop the other run first."
                ) from None
            remove_quietly(path)  # locked by nobody: its launch is dead (a restarted or finished run)
        finally:
            os.close(fd)


PROBE_PATIENCE_S = 2.0  # how long a lock held on another launch's file may be a sibling's probe


def _probe(path: Path, fd: int) -> str:
    """"dead" (we now hold it exclusively), "gone" (removed meanwhile) or "alive".

    A failed exclusive lock is not proof of life: a sibling rank of the restarted launch may be
    probing the same dead launch's file this very moment (it holds the lock exclusively, then
    unlinks the file). A live launch holds its shared lock for as long as it runs, so the lock
    stays taken and the file stays in place for the whole ``PROBE_PATIENCE_S``; a probe does not.
    """
    deadline = time.monotonic() + PROBE_PATIENCE_S
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        else:
            try:
                if os.lstat(path).st_ino != os.fstat(fd).st_ino:
                    return "gone"  # removed (and maybe made anew by its launch: then it is looked at next time)
            except FileNotFoundError:
                return "gone"
            return "dead"
        try:
            if os.lstat(path).st_ino != os.fstat(fd).st_ino:
                return "gone"
        except FileNotFoundError:
            return "gone"
        if time.monotonic() >= deadline:
            return "alive"
        time.sleep(0.02)


def live_launches(job_dir: Path) -> list[dict[str, object]]:
    """The launches whose lock file in ``job_dir`` is held right now: what each wrote of itself
    (``description``, ``host``, ``pid``; a pid is that of the launch's own PID namespace).

    Proof of life that crosses PID namespaces and containers: the lock is the kernel's, on the
    tmpfs inode every container sharing the memory volume sees, where ``/proc`` shows only this
    namespace's processes. Changes nothing (a dead launch's file stays for its next writer to
    remove). A launch held by this very process counts as live: a POSIX lock never conflicts
    with its own process, so this process's locks are looked up, not probed (and probing one
    would drop it: closing any descriptor of a file releases the process's locks on it).
    """
    ldir = job_dir / "launches"
    try:
        names = sorted(os.listdir(ldir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    with _held_guard:
        _apply_releases()
        mine = {_inode(h.fd): h.fd for h in _held.values()}
    out: list[dict[str, object]] = []
    for name in names:
        path = ldir / name
        if not name.endswith(".lock"):
            continue
        try:
            held_fd = mine.get(_inode_of(path))
        except OSError:
            continue
        if held_fd is not None:
            out.append(_read_fd_info(held_fd))  # through the held descriptor: no second one to close
            continue
        try:
            fd = _open_lock_file(path, create=False)
        except OSError:
            continue  # gone, or not a lock file of ours (a link, another owner): not a launch
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                out.append(_read_fd_info(fd))
            else:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return out


def _inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def _inode_of(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return (st.st_dev, st.st_ino)


def _read_fd_info(fd: int) -> dict[str, object]:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        info = {}
    if not isinstance(info, dict):
        info = {}
    return {k: info.get(k, "?") for k in ("launch_id", "description", "host", "pid")}
