"""Preallocated, pre-faulted slot files: the memory of the local tier.

Writing fresh tmpfs pages costs a page fault per 4 KiB, while rewriting pages
already present runs at memcpy speed (docs/architecture.md). So each rank
keeps a ring of ``keep + 1`` slot files per job, maps them once with
``MAP_POPULATE`` and reuses them step after step: ``keep`` slots hold the
retained committed steps, one receives the step being saved.

Space is reserved with ``posix_fallocate`` before any byte is written, so a
full tmpfs raises :class:`TierFullError` instead of killing the process with
SIGBUS on a page fault.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import TierFullError
from .job_dir import ensure_private_dir, open_private

ALIGN = 64
GROW_ROUND = 4 << 20
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def round_capacity(n: int) -> int:
    return max(GROW_ROUND, (n + GROW_ROUND - 1) // GROW_ROUND * GROW_ROUND)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def total_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def tier_full_message(root: Path, need: int, free: int, what: str) -> str:
    gib = 1 << 30
    return (
        f"not enough space in tier root {root} for {what}: need {need / gib:.3f} GiB more, "
        f"{free / gib:.3f} GiB free of {total_bytes(root) / gib:.3f} GiB. "
        "Fixes: give the container a larger /dev/shm (docker run --shm-size=<N>g, or a Kubernetes "
        "emptyDir with medium: Memory and a sizeLimit), point GEMINI_DCP_ROOT/root at a larger tmpfs, "
        "or keep fewer steps: keep=1 needs 2 slots per rank instead of 3, but then memory holds a single "
        "committed step, so a damaged copy of it (a corrupt slot, a node lost without a peer replica) leaves "
        "no older step to fall back to in memory; pair keep=1 with replicas>=2 or a persistent tier."
    )


def _as_tensor(buf: mmap.mmap | memoryview, length: int) -> torch.Tensor:
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8, count=length)


def _open_slot(path: Path) -> int:
    """An fd of the slot file at ``path``: never through a link, only a private regular file of ours.

    The rank directory is checked (ours, not a link, 0700) first. An existing slot must be a
    regular file we own with one link (its mode is tightened to 0600); a new one is created
    with ``O_CREAT|O_EXCL|O_NOFOLLOW``, so a file or link planted meanwhile is never opened.
    """
    ensure_private_dir(path.parent)
    while True:
        try:
            return open_private(path, os.O_RDWR, single_link=True)
        except FileNotFoundError:
            pass
        try:
            return open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, single_link=True)
        except FileExistsError:
            continue  # another thread or process created it between the two opens: check that one


class SlotFile:
    """One writable slot file mapped shared; ``tensor`` is a uint8 view of all of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        # Called with the mapping's tensor just before it is unmapped (a page-locked mapping is
        # unregistered there: save/device_copy), set by whoever registered it.
        self.before_unmap: Callable[[torch.Tensor], None] | None = None
        self._fd = _open_slot(path)
        self.capacity = os.fstat(self._fd).st_size
        if self.capacity:
            self._map()

    def _map(self) -> None:
        self._mm = mmap.mmap(self._fd, self.capacity, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        self.tensor = _as_tensor(self._mm, self.capacity)

    def _unmap(self) -> None:
        if self.before_unmap is not None and self.tensor.numel():
            self.before_unmap(self.tensor)
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # A tensor view handed out earlier is still alive; the mapping goes when it does.
                pass
            self._mm = None

    def ensure_capacity(self, nbytes: int, *, budget_check=None) -> None:
        """Grow the file to hold ``nbytes``, reserving the space first (TierFullError if it is not there)."""
        if nbytes <= self.capacity:
            return
        new_cap = round_capacity(nbytes)
        delta = new_cap - self.capacity
        if budget_check is not None:
            budget_check(delta)
        root = self.path.parent
        free = free_bytes(root)
        if delta > free:
            raise TierFullError(tier_full_message(root, delta, free, f"slot {self.path.name}"))
        try:
            os.posix_fallocate(self._fd, 0, new_cap)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(tier_full_message(root, delta, free_bytes(root), f"slot {self.path.name}")) from exc
            raise
        self._unmap()
        self.capacity = new_cap
        self._map()

    def view(self, offset: int, length: int) -> torch.Tensor:
        return self.tensor[offset : offset + length]

    def linked(self) -> bool:
        """Whether the mapped file is still the one ``path`` names (not unlinked, not replaced):
        bytes copied into an unlinked slot reach nobody who opens the path (a restore)."""
        try:
            st = os.fstat(self._fd)
            at = os.lstat(self.path)
        except OSError:
            return False
        return st.st_nlink >= 1 and (at.st_dev, at.st_ino) == (st.st_dev, st.st_ino)

    def close(self) -> None:
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except OSError:
            pass


class ReadOnlySlot:
    """A slot file mapped read-only (zero copy) for loading.

    Only the pages a caller views are populated: each :meth:`view` asks the kernel
    to map its range up front (``madvise(MADV_POPULATE_READ)``, Linux >= 5.14), so a
    rank that reads a few small items from another rank's slot (DCP's dedup may put
    replicated tensors in any rank's slot) does not pay for the page tables of the
    whole file (~0.05 s per GiB here, the same cost as ``MAP_POPULATE`` of all of it).
    On kernels without it the whole file is mapped with ``MAP_POPULATE`` as before.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = open_private(path, os.O_RDONLY)  # never through a link; a regular file we own
        try:
            self.size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if self.size else None
            self._lazy = self._mm is not None and _populate(self._mm, 0, 1)
            if self._mm is not None and not self._lazy:
                self._mm.close()
                self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.tensor = _as_tensor(self._mm, self.size) if self._mm is not None else torch.empty(0, dtype=torch.uint8)

    def view(self, offset: int, length: int) -> torch.Tensor:
        if offset + length > self.size:
            raise ValueError(f"{self.path}: range {offset}+{length} beyond file size {self.size}")
        if self._lazy and length:
            _populate(self._mm, offset, length)  # type: ignore[arg-type]
        return self.tensor[offset : offset + length]


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python exposes it from 3.13 only


def _populate(mm: mmap.mmap, offset: int, length: int) -> bool:
    """Map the pages of ``[offset, offset + length)`` now (read faults in one call); False if unsupported."""
    start = offset - offset % mmap.PAGESIZE
    try:
        mm.madvise(_MADV_POPULATE_READ, start, offset + length - start)
    except (OSError, ValueError, AttributeError):
        return False
    return True
