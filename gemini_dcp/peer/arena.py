"""ReceiveArena: the receive buffers of one restore round, in one pre-faulted anonymous mapping.

Used by the restore side of the peer tier (:mod:`gemini_dcp.peer.fetch`); no collectives here.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable, Sequence

import torch

__all__ = ["ReceiveArena"]

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python exposes it from 3.13 only
_HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) transparent huge page
#: Bytes pre-faulted per ``madvise`` call (a multiple of the huge page; 0: the whole arena in one call).
POPULATE_STEP = 32 << 20
_CHUNK_ALIGN = 4096  # each chunk starts on a page: aligned for every dtype, and madvise ranges need page starts


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes (which releases the GIL during the call), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


class ReceiveArena:
    """The receive buffers of one restore round: views into a single anonymous mapping.

    A chunk received from a peer is verified in a buffer of its own before any byte of it
    may reach the state dict (``GeminiStorageReader.read_data``). ``torch.empty`` per chunk
    gave fresh anonymous memory that page-faults 4 KiB at a time as gloo writes into it
    (1–2.4 GB/s on the 2-core VM this was measured on, slower than the loopback transfer
    itself). Here all the round's buffers share one mapping, 2 MiB-aligned and advised
    ``MADV_HUGEPAGE`` (faults 2 MiB at a time), and :meth:`start_populate` pre-faults it
    with ``MADV_POPULATE_WRITE`` on a worker thread (GIL released) while gloo already
    receives into it: a page the worker has not reached yet is faulted by gloo as before,
    one the worker did is written without a fault. On kernels without
    ``MADV_POPULATE_WRITE`` (< 5.14) or ``MADV_HUGEPAGE`` the mapping still works, with
    whatever faults the kernel takes.

    Lifetime: the views keep the mapping alive (``torch.frombuffer`` holds it); the reader
    keeps the arena until every staged chunk is applied and releases it with its slot
    mappings (``GeminiStorageReader._release_maps``), so nothing outlives the restore.
    Call :meth:`join` before dropping it on an error path.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        offsets: list[int] = []
        total = 0
        for n in lengths:
            offsets.append(total)
            total += -(-n // _CHUNK_ALIGN) * _CHUNK_ALIGN
        self.nbytes = total
        size = max(total, 1) + _HUGE_PAGE  # room to start the buffers on a huge-page boundary
        self._mm: mmap.mmap | None = mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        skip = (-whole.data_ptr()) % _HUGE_PAGE
        self._addr = whole.data_ptr() + skip
        try:
            self._mm.madvise(_MADV_HUGEPAGE)
        except (OSError, ValueError, AttributeError):  # no THP in this kernel: 4 KiB pages, still one mapping
            pass
        base = whole[skip : skip + total]
        self.views: list[torch.Tensor] = [base[o : o + n] for o, n in zip(offsets, lengths)]
        self._thread: threading.Thread | None = None
        self.populated: bool | None = None  # after join(): whether MADV_POPULATE_WRITE ran

    def start_populate(self) -> None:
        """Pre-fault the whole arena on a worker thread (in receive order: the buffers are laid out so)."""
        if self.nbytes == 0 or self._thread is not None:
            return
        try:
            self._thread = threading.Thread(target=self._populate, name="gemini-dcp-prefault", daemon=False)
            self._thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown": gloo faults the pages itself
            self._thread = None

    def _populate(self) -> None:
        if _madvise is not None:
            # In steps: each call holds the process's memory-map lock for its whole range, and a
            # thread that maps memory meanwhile (a dlopen, a large malloc) waits for the lock.
            step = POPULATE_STEP or self.nbytes
            ok = True
            for at in range(0, self.nbytes, step):
                ok = _madvise(self._addr + at, min(step, self.nbytes - at), _MADV_POPULATE_WRITE) == 0 and ok
                if not ok:
                    break
            self.populated = ok
            return
        mm = self._mm
        if mm is None:
            return
        try:  # without ctypes: the same call, holding the GIL
            mm.madvise(_MADV_POPULATE_WRITE, self._addr - _address(mm), self.nbytes)
            self.populated = True
        except (OSError, ValueError, AttributeError):
            self.populated = False

    def join(self) -> None:
        """Wait for the pre-fault worker (quick: it only maps zeroed pages)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def release(self) -> None:
        """Drop this arena's own references; the mapping goes when the last view goes too."""
        self.join()
        self.views = []
        self._mm = None


def _address(mm: mmap.mmap) -> int:
    return torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
