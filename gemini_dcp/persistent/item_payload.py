"""A stored tensor item's raw bytes, read straight from its torch.save zip into a tensor.

Each tensor item of a stock DCP checkpoint is ``torch.save(tensor)`` bytes at some offset of a
data file: a zip whose records are stored uncompressed — ``data.pkl`` (the tensor's dtype,
shape, strides and storage offset), ``byteorder``, and ``data/0`` (the storage's raw bytes),
each record's payload aligned by torch's zip writer. When the tensor owns exactly its storage
(contiguous, no storage offset, storage size equal to the tensor's bytes, one storage, the
host's byte order), the ``data/0`` payload *is* the tensor's bytes: :func:`payload_layout`
finds where it sits (torch's own loader parses ``data.pkl`` onto the meta device, reading no
payload, and reports the record's offset), and :func:`read_hashing` reads it into a fresh
tensor block by block, hashing each block while it is still in cache — one pass over the
bytes where ``torch.load`` + a checksum pass + a copy made three.

Anything else (a view saved with its larger storage, a non-contiguous tensor, a big-endian
file, a zip this reader does not understand) gives ``None`` from :func:`payload_layout`: the
caller falls back to ``torch.load`` of the whole item, which handles every case.
"""

from __future__ import annotations

import io
import mmap
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.checksum import new_hasher
from ..core.regular_file import open_regular

__all__ = [
    "BLOCK_BYTES",
    "ItemWindow",
    "MappedFile",
    "PayloadLayout",
    "ReadAt",
    "flat_bytes",
    "payload_layout",
    "read_exact",
    "read_hashing",
]

BLOCK_BYTES = 1 << 20  # read then hash 1 MiB at a time: the block is hashed while still in cache
_HEAD = 4096           # the zip's local headers and data.pkl sit in the item's first bytes...
_TAIL = 8192           # ...its central directory in the last ones: each read once, served from memory

ReadAt = Callable[[memoryview, int], int]
"""``read_at(buf, offset)``: read up to ``len(buf)`` bytes of the data file at ``offset`` into
``buf``; the count read (0 at the end of the file)."""


def read_exact(read_at: ReadAt, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from the data file at ``offset`` (looping over short reads); the count read."""
    done = 0
    while done < len(buf):
        n = read_at(buf[done:], offset + done)
        if n <= 0:
            break
        done += n
    return done


class ItemWindow(io.RawIOBase):
    """A read-only, seekable file of the ``length`` bytes at ``start`` of a data file.

    What ``torch.load`` / torch's zip reader is given to parse one item: its reads of the
    item's head and tail (headers, ``data.pkl``, the central directory) are served from two
    reads made once.
    """

    def __init__(self, read_at: ReadAt, start: int, length: int) -> None:
        super().__init__()
        self._read_at = read_at
        self._start = start
        self._length = length
        self._pos = 0
        self._cache: list[tuple[int, bytes]] = []
        for off, n in ((0, min(_HEAD, length)), (max(0, length - _TAIL), min(_TAIL, length))):
            buf = bytearray(n)
            got = read_exact(read_at, memoryview(buf), start + off)
            self._cache.append((off, bytes(buf[:got])))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self._length - self._pos)
        if n <= 0:
            return 0
        out = memoryview(b).cast("B")[:n]
        for off, data in self._cache:
            if off <= self._pos and self._pos + n <= off + len(data):
                out[:] = data[self._pos - off : self._pos - off + n]
                self._pos += n
                return n
        got = read_exact(self._read_at, out, self._start + self._pos)
        self._pos += got
        return got


@dataclass(frozen=True, kw_only=True, slots=True)
class PayloadLayout:
    """Where a tensor item's raw bytes sit: ``nbytes`` at ``offset`` of the item (its torch.save bytes)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def payload_layout(window: ItemWindow) -> PayloadLayout | None:
    """The layout of the torch.save item in ``window`` when its payload is the tensor's bytes, else None.

    None means "read it with torch.load": not a zip torch reads, not one tensor owning exactly
    one storage, not contiguous, another byte order, or a payload outside the item.
    """
    try:
        zf = torch._C.PyTorchFileReader(window)  # type: ignore[call-overload]
        records = [r for r in zf.get_all_records() if r.startswith("data/")]
        order = bytes(zf.get_record("byteorder")) if zf.has_record("byteorder") else b"little"
        window.seek(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = torch.load(window, map_location="meta", weights_only=True)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - anything torch's reader refuses goes to the full torch.load
        return None
    if order != sys.byteorder.encode() or len(records) != 1 or not isinstance(meta, torch.Tensor):
        return None
    if meta.layout != torch.strided or meta.is_quantized or not meta.is_contiguous() or meta.storage_offset() != 0:
        return None
    nbytes = meta.numel() * meta.element_size()
    storage = meta.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    if storage.nbytes() != nbytes or not isinstance(offset, int) or offset < 0 or offset + nbytes > window.seek(0, io.SEEK_END):
        return None
    return PayloadLayout(dtype=meta.dtype, shape=tuple(meta.shape), offset=offset, nbytes=nbytes)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a fresh contiguous tensor's bytes (empty for no elements)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.view(-1).view(torch.uint8)


def read_hashing(read_at: ReadAt, dest: torch.Tensor, offset: int, algo: str | None) -> tuple[int, int | None]:
    """Read ``dest.numel()`` bytes of the data file at ``offset`` into ``dest`` (flat uint8),
    hashing each block right after it is read; ``(bytes read, checksum or None without algo)``.

    Fewer bytes read than asked means the file is truncated (the caller says so).
    """
    h = new_hasher(algo) if algo is not None else None
    n = dest.numel()
    if n == 0:
        return 0, (h.value() if h is not None else None)
    view = memoryview(dest.numpy()).cast("B")  # type: ignore[arg-type]
    done = 0
    while done < n:
        m = min(BLOCK_BYTES, n - done)
        got = read_exact(read_at, view[done : done + m], offset + done)
        if got and h is not None:
            h.update(dest[done : done + got])
        done += got
        if got < m:
            break
    return done, (h.value() if h is not None else None)


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python exposes it from 3.13 only


class MappedFile:
    """A local data file mapped read-only: items viewed in place, the page cache as the staging buffer.

    A view (:meth:`bytes_view`, :meth:`typed_view`) keeps the mapping alive (its buffer export
    holds it) until the view is gone; the mapping is undone when the last reference to this
    object or a view goes. Views are read-only memory: only ever read them. Only committed
    steps are read this way, whose files are never rewritten in place (retention unlinks
    them, which leaves a mapping valid); a file truncated under a live mapping would fault
    (SIGBUS) when read.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd = open_regular(path)
        try:
            self.size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if self.size else None
        finally:
            os.close(fd)

    def prefetch(self, offset: int, length: int) -> None:
        """Ask the kernel to start reading ``[offset, offset + length)`` from the disk (no wait)."""
        if self._mm is None or not length:
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            self._mm.madvise(mmap.MADV_WILLNEED, start, min(self.size, offset + length) - start)
        except (OSError, ValueError, AttributeError):
            pass

    def read_at(self, buf: memoryview, offset: int) -> int:
        """:data:`ReadAt` over the mapping (a copy of the bytes asked for)."""
        if self._mm is None or offset >= self.size:
            return 0
        n = min(len(buf), self.size - offset)
        buf[:n] = self._mm[offset : offset + n]
        return n

    def populate(self, offset: int, length: int) -> None:
        """Fault ``[offset, offset + length)`` in now, in one call (reads it from the disk if it is not cached)."""
        if self._mm is None or not length:
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            self._mm.madvise(_MADV_POPULATE_READ, start, min(self.size, offset + length) - start)
        except (OSError, ValueError, AttributeError):
            pass  # older kernels: the pages fault in as they are read

    def typed_view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes at ``offset`` viewed as a tensor of ``dtype`` and ``shape`` (zero copy; an
        unaligned start is read with unaligned loads, as x86 and arm64 allow)."""
        numel = 1
        for d in shape:
            numel *= d
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if self._mm is None or offset < 0 or offset + numel * dtype.itemsize > self.size:
            raise ValueError(f"{self.path}: {numel} x {dtype} at {offset} is beyond the file's {self.size} bytes")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only mapping: only read here
            return torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=offset).view(shape)
