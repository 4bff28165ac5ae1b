"""One pass per item: the drain checksums the bytes it writes into the store while it writes them.

``torch.save`` hands a tensor's storage to its file in one ``write`` of exactly the storage's
bytes. :class:`FusedDest` stands in for the step directory given to
:func:`gemini_dcp.persistent.stock_format.write_rank_file` and returns files that catch that
write and hash each 1 MiB block right before writing it, while it is in cache. From a source
that cannot change unseen (a staged copy; held slots, whose holds are checked after each item:
``gemini_dcp.local.slot_holds``) the blocks are hashed and written in place; from any other
source each block is first copied into a private buffer (copy and checksum in one pass,
:func:`gemini_dcp.core.checksum.new_hasher`) and written from there. Either way what reaches the store is what was
checksummed. The checksum is compared with the saved one
once the item is written (:meth:`FusedFile.check`); a mismatch raises
:class:`~gemini_dcp.errors.ChecksumMismatchError` before any part marker or ``.metadata``
names the file, so the step's drain is abandoned and nothing torn is ever committed.

On a local store the file also starts the disk's writeback as it goes (``sync_file_range``),
so writing and flushing overlap instead of the final ``fsync`` doing all the flushing.

Items too small to be worth it, and any item whose storage ``torch.save`` did not write in
one piece, are copied out and verified before they are written instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ...core.checksum import new_hasher
from ...errors import ChecksumMismatchError
from ..stock_format import exact_view, typed, verify

__all__ = ["BLOCK", "MIN_FUSED", "FusedDest", "FusedFile", "fused_reader"]

BLOCK = 1 << 20  # a block stays in cache between its copy+checksum and its write
MIN_FUSED = 1 << 16  # smaller items are copied out and verified whole (cheap)
WRITEBACK_BYTES = 8 << 20  # start the disk's writeback of every this many bytes written


def slot_taken(item: Any, what: str) -> ChecksumMismatchError:
    """The error for an item read from a held slot whose hold was dropped: a newer save took it."""
    return ChecksumMismatchError(
        f"{item.name} of {what}: a newer save took the memory slot the drain was reading (its hold was "
        "dropped); this step's drain is abandoned, a newer one is not."
    )


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)``: start writeback of a range, not waiting."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    def start(fd: int, offset: int, n: int) -> None:
        fn(fd, offset, n, 2)  # SYNC_FILE_RANGE_WRITE; a failure only means the final fsync does it all

    return start


_START_WRITEBACK = _sync_file_range() if sys.platform.startswith("linux") else None


class FusedFile:
    """A store file that checksums, in the pass that writes it, the storage of the item it expects.

    On a local filesystem it also starts the writeback of every :data:`WRITEBACK_BYTES` written
    (``sync_file_range``), so the disk works while the next bytes are written and the final
    ``fsync`` finds little left to do (a stock writer leaves it all to its ``fsync``).
    """

    def __init__(self, f: Any, bounce: torch.Tensor, *, local: bool = False,
                 intact: Callable[[], bool] | None = None) -> None:
        self.f = f
        self._intact = intact  # given: the source cannot change unseen (see FusedDest); hash it in place
        self._bounce = bounce
        self._bounce_mv = memoryview(bounce.numpy()).cast("B")  # type: ignore[arg-type]
        self._expect: Any = None  # the item whose storage write is awaited
        self._got: int | None = None
        self._fd = f.fileno() if local and _START_WRITEBACK is not None else None
        self._synced = 0  # writeback started up to here

    def expect(self, item: Any) -> None:
        self._expect, self._got = item, None

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        item = self._expect
        if item is None or mv.nbytes != item.length:
            return self.f.write(mv)
        self._expect = None
        h = new_hasher(item.algo)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer is only read here
            src = torch.frombuffer(mv, dtype=torch.uint8)
        n = mv.nbytes
        for start in range(0, n, BLOCK):
            m = min(BLOCK, n - start)
            if self._intact is not None:  # hash the block, then write it while it is in cache
                h.update(src[start : start + m])
                self.f.write(mv[start : start + m])
            else:  # a private copy of the block is hashed and written: race-safe on any source
                h.copy(self._bounce[:m], src[start : start + m])
                self.f.write(self._bounce_mv[:m])
            if self._fd is not None:
                self._start_writeback()
        self._got = h.value()
        return n

    def _start_writeback(self) -> None:
        pos = self.f.tell()
        if pos - self._synced >= WRITEBACK_BYTES and _START_WRITEBACK is not None and self._fd is not None:
            self.f.flush()
            _START_WRITEBACK(self._fd, self._synced, pos - self._synced)
            self._synced = pos

    def check(self, item: Any, what: str, fallback: Callable[[], None]) -> None:
        """After ``item`` was written: its bytes must match the saved checksum (ChecksumMismatchError)."""
        if self._intact is not None and not self._intact():
            raise slot_taken(item, what)
        if self._expect is item:  # torch.save did not write the storage in one piece: check the source
            self._expect = None
            fallback()
            return
        if self._got is not None and self._got != item.checksum:
            raise ChecksumMismatchError(
                f"{item.name} of {what}: its bytes changed before the drain wrote them (the memory slot was reused "
                "by a newer save, or the memory is damaged); this step's drain is abandoned, a newer one is not."
            )
        self._got = None

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()


class FusedDest:
    """The step directory as ``write_rank_file`` sees it, with :class:`FusedFile` files.

    ``intact``: None when the source may change under the drain without notice (a slot read
    without a hold): each block is then copied aside and the copy hashed and written.
    Otherwise a check that the source did not change (a staged private copy: always; held
    slots: their holds are intact, as a writer drops a hold before it overwrites the slot),
    called after each item: blocks are hashed and written in place, with no copy.
    """

    def __init__(self, sd: Any, intact: Callable[[], bool] | None = None) -> None:
        self.sd = sd
        self.intact = intact
        self.is_local = sd.is_local
        self.file: FusedFile | None = None
        self._bounce = torch.empty(BLOCK, dtype=torch.uint8)

    def open_write(self, rel: str) -> FusedFile:
        self.file = FusedFile(self.sd.open_write(rel), self._bounce, local=self.is_local, intact=self.intact)
        return self.file


def fused_reader(dest: FusedDest, buf: Any, what: str) -> tuple[Callable[[Any], torch.Tensor], Callable[[int], None]]:
    """``(read, progress)`` for ``write_rank_file`` over the mapped bytes ``buf``: ``read(item)`` arms
    the file for the item's storage write and returns a zero-copy view; ``progress`` (called once
    the item is written) checks what was written against the item's saved checksum."""
    last: list[Any] = [None]

    def fused(it: Any) -> bool:
        return it.algo is not None and it.checksum is not None and it.length >= MIN_FUSED

    def checked(raw: torch.Tensor, it: Any) -> None:
        try:
            verify(raw, it, what)
        except ChecksumMismatchError:
            if dest.intact is not None and not dest.intact():  # not damage: the slot's new owner wrote it
                raise slot_taken(it, what) from None
            raise

    def read(it: Any) -> torch.Tensor:
        last[0] = it
        if not fused(it):
            raw = exact_view(buf, it.offset, it.length).clone()  # private: what is verified is what is written
            checked(raw, it)
            return typed(raw, it)
        assert dest.file is not None
        dest.file.expect(it)
        return typed(exact_view(buf, it.offset, it.length), it)

    def progress(_n: int) -> None:
        it = last[0]
        if it is None or not fused(it) or dest.file is None:
            return
        dest.file.check(it, what, lambda: checked(exact_view(buf, it.offset, it.length), it))

    return read, progress
