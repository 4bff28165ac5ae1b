"""The one-server-per-node lock of a drain (``flock`` on ``daemon.lock``) and the standby wait for it.

A SIGKILLed server holds its lock until the kernel has closed its files, which can outlast
a worker restart: a *standby* server (at most one, ``standby.lock``) waits for the lock while
requests are pending. Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path

from .paths import Paths, private_dir

__all__ = ["STANDBY_POLL_S", "STANDBY_S", "lock_free", "lock_held", "take_lock", "try_flock"]

log = logging.getLogger("gemini_dcp.persistent.drain")

STANDBY_POLL_S = 0.1
STANDBY_S = 600.0  # a standby server gives up waiting for the lock after this long


def try_flock(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; False if another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lock_free(lock: Path, parent: Path) -> bool:
    """Whether no process holds ``lock`` (tested by taking and dropping it)."""
    private_dir(parent)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        return try_flock(fd)
    finally:
        os.close(fd)  # closing drops the lock if we took it


def lock_held(lock: Path) -> bool:
    """Whether a process holds ``lock``, probed without making anything: a missing file (or folder)
    is held by nobody. (:func:`lock_free` makes both, for a caller about to take the lock.)"""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        return not try_flock(fd)
    finally:
        os.close(fd)


def take_lock(p: Paths, fd: int, standby_s: float) -> bool:
    """Take the server lock on ``fd``; as a standby, wait for it while requests are pending."""
    if try_flock(fd):
        return True
    if standby_s <= 0:
        return False
    try:
        standby_fd = os.open(p.standby_lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        if not try_flock(standby_fd):
            return False  # another standby already waits
        log.info("drain lock held by another server; standing by for up to %.0f s", standby_s)
        deadline = time.monotonic() + standby_s
        while p.pending() and time.monotonic() < deadline:
            time.sleep(STANDBY_POLL_S)
            if try_flock(fd):
                log.info("drain lock taken over from the previous server")
                return True
        return False
    finally:
        os.close(standby_fd)
