"""Checksums of shard bytes, fused with the copy into / out of a tier where possible.

Two algorithms: ``xxh3`` (xxh3-64 via the ``xxhash`` package) and ``crc32c`` (C++ extension when built, else the ``crc32c``
package). ``"auto"`` (the writer's default, :func:`resolve_algo`) picks
``crc32c`` when the extension loads — its copy+CRC runs in one multi-threaded
pass with the GIL released, faster than the block-by-block copy+xxh3 of
Python (figures: docs/benchmarks.md) — and ``xxh3`` otherwise. The
record stores which one was used, so a checkpoint written with either can be
verified anywhere.

Copies run block by block and each block is hashed while it is still in cache,
so checksumming costs far less than a second pass over memory. That fusion is for
saving (and replicas) only: a load verifies a chunk's stored bytes *before* any of
them may reach the live tensors (``GeminiStorageReader.read_data``), so it hashes
with :func:`checksum` and copies afterwards; there is no copy-then-verify into a
destination here on purpose.

The extension's ops are called here as ``torch.ops.gemini_dcp.*`` on the views this module's
callers made (each op checks its tensors in C++): :mod:`gemini_dcp.ext.cpu` is their typed face,
with Python argument checks, for code outside the copy path.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import crc32c as _crc32c_pkg
import torch
import xxhash

from ..ext import loader as ext_loader
from ..ext.cuda import xsum64_finish, xsum64_sum_reference

# 1 MiB: with 4 MiB blocks two ranks' blocks (8 MiB) fill this machine's 8 MiB L3 and the
# hash re-reads each block from DRAM (copy+xxh3 costs copy + hash: no fusion gain). Two
# back-to-back passes of benchmarks/bench_local.py (2 ranks x 1 GiB, 1 thread each, quiet
# machine): xxh3 save 4.67 -> 5.37 GB/s, load 3.72 -> 3.93 GB/s. A 2-process copy+xxh3
# microbenchmark: 4 MiB 2.8, 2 MiB 3.0, 1 MiB 3.4, 512 KiB 3.4, 256 KiB 3.1 GB/s per process.
BLOCK_BYTES = 1 << 20


def _u8_buffer(t: torch.Tensor) -> memoryview:
    """A zero-copy memoryview of a contiguous 1-D uint8 CPU tensor."""
    return t.numpy().data.cast("B")


def _crc32c_update(value: int, buf: torch.Tensor, threads: int = 1) -> int:
    if ext_loader.load():
        if threads == 1:
            return int(torch.ops.gemini_dcp.crc32c(buf, value))
        return int(torch.ops.gemini_dcp.crc32c(buf, value, threads))
    return _crc32c_pkg.crc32c(_u8_buffer(buf), value)


_M64 = (1 << 64) - 1


def _xsum64_sum(buf: torch.Tensor, word_offset: int, threads: int) -> int:
    """The sum term of ``xsum64`` over ``buf``'s words keyed from ``word_offset`` (mod 2**64)."""
    if ext_loader.load():
        return int(torch.ops.gemini_dcp.xsum64_sum(buf, word_offset, threads)) & _M64
    return xsum64_sum_reference(buf, word_offset) & _M64


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


class _Xsum64:
    """A running ``xsum64`` (the GPU checksum of :func:`gemini_dcp.ext.gpu_checksum`): the sum of
    every word's term, keyed by its index in the whole buffer, then one final mix with the length.
    Pieces may have any length: a word split between two pieces is completed from the next one."""

    __slots__ = ("_sum", "_n", "_tail")

    def __init__(self) -> None:
        self._sum = 0
        self._n = 0  # bytes hashed (whole words) so far
        self._tail = b""  # bytes of an incomplete word waiting for the next piece

    def update(self, buf: torch.Tensor, threads: int = 1) -> None:
        if self._tail:
            k = min(8 - len(self._tail), buf.numel())
            self._tail += buf[:k].numpy().tobytes()
            buf = buf[k:]
            if len(self._tail) < 8:
                return
            self._sum = (self._sum + _xsum64_sum(_bytes_tensor(self._tail), self._n // 8, 1)) & _M64
            self._n += 8
            self._tail = b""
        m = buf.numel() - buf.numel() % 8
        if m:
            self._sum = (self._sum + _xsum64_sum(buf[:m], self._n // 8, threads)) & _M64
            self._n += m
        if m < buf.numel():
            self._tail = buf[m:].numpy().tobytes()

    def value(self) -> int:
        s = self._sum
        if self._tail:  # the last word, zero-padded
            s = (s + _xsum64_sum(_bytes_tensor(self._tail), self._n // 8, 1)) & _M64
        return xsum64_finish(s, self._n + len(self._tail))


class _Hasher:
    def __init__(self, algo: str) -> None:
        self.algo = algo
        if algo == "xxh3":
            self._h = xxhash.xxh3_64()
        elif algo == "crc32c":
            self._v = 0
        elif algo == "xsum64":
            self._x = _Xsum64()
        else:
            raise ValueError(f"unknown checksum algorithm {algo!r}")

    def update(self, buf: torch.Tensor, threads: int = 1) -> None:
        """Hash ``buf`` (flat uint8) next; ``threads`` > 1 splits a crc32c over threads (extension only)."""
        if self.algo == "xxh3":
            self._h.update(_u8_buffer(buf))
        elif self.algo == "crc32c":
            self._v = _crc32c_update(self._v, buf, threads)
        else:
            self._x.update(buf, threads)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (flat uint8, same length) and hash the bytes copied: one fused
        pass for crc32c with the extension, else the copy and then the hash of ``dst``."""
        if self.algo == "crc32c" and ext_loader.load():
            self._v = int(torch.ops.gemini_dcp.copy_with_crc32c(dst, src, 1, self._v))
            return
        dst.copy_(src)
        self.update(dst)

    def value(self) -> int:
        if self.algo == "xsum64":
            return self._x.value()
        return self._h.intdigest() if self.algo == "xxh3" else self._v


def new_hasher(algo: str) -> _Hasher:
    """A running checksum: ``update(flat uint8 tensor)`` or ``copy(dst, src)`` block by block, then ``value()``."""
    return _Hasher(algo)


def buffer_checksum(algo: str) -> Callable[[Any], int]:
    """The one-shot checksum of a byte buffer (memoryview, bytes) for ``algo``: the same value as
    :func:`checksum` of those bytes, without a tensor around them (many small items)."""
    if algo == "crc32c":
        return _crc32c_pkg.crc32c
    if algo == "xxh3":
        return xxhash.xxh3_64_intdigest
    if algo == "xsum64":
        return _xsum64_of_buffer
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def _xsum64_of_buffer(buf: Any) -> int:
    mv = memoryview(buf).cast("B")
    if not len(mv):
        return checksum(torch.empty(0, dtype=torch.uint8), "xsum64")
    with warnings.catch_warnings():  # a read-only mapping (a slot being verified): only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(mv, dtype=torch.uint8)
    return checksum(t, "xsum64")


def resolve_algo(algo: str) -> str:
    """The algorithm ``"auto"`` stands for on this machine (builds/loads the extension once)."""
    if algo != "auto":
        return algo
    return "crc32c" if ext_loader.load() else "xxh3"


# One-shot checksums of large buffers (a restore verifying a slot's chunk) are split over threads:
# one core reads DRAM at a fraction of the machine's bandwidth. Half the cores, at most 4, so that
# ranks sharing a host do not oversubscribe it; 1 on the 2-core test machine.
_ONE_SHOT_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
_ONE_SHOT_SPLIT_BYTES = 32 << 20


def checksum(buf: torch.Tensor, algo: str) -> int:
    """Checksum of a contiguous 1-D uint8 CPU tensor."""
    h = _Hasher(algo)
    if buf.numel():
        h.update(buf, _ONE_SHOT_THREADS if buf.numel() >= _ONE_SHOT_SPLIT_BYTES else 1)
    return h.value()


def as_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A flat uint8 view of a contiguous CPU tensor's bytes, or None if there is none."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_quantized or t.is_sparse:
        return None
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    try:
        return flat.view(torch.uint8)
    except RuntimeError:
        return None


def copy_and_checksum(
    dst: torch.Tensor,
    src: torch.Tensor,
    algo: str,
    block: int = BLOCK_BYTES,
    pace: Callable[[int], None] | None = None,
) -> int:
    """Copy ``src`` bytes into ``dst`` (both flat uint8, same size) and return the checksum of the bytes.

    ``pace``, if given, is called with each block's size before the block is
    copied (the async snapshot's interleaving scheduler; it may sleep).
    """
    n = src.numel()
    if n != dst.numel():
        raise ValueError(f"copy_and_checksum: size mismatch {src.numel()} vs {dst.numel()}")
    fused = algo == "crc32c" and ext_loader.load()
    if fused and pace is None:
        return int(torch.ops.gemini_dcp.copy_with_crc32c(dst, src, 0, 0))
    h = None if fused else _Hasher(algo)
    value = 0  # the running CRC of the fused path (the extension carries it across blocks)
    for start in range(0, n, block):
        m = min(block, n - start)
        # --- paced copy (gemini_dcp.snapshot.interleave): one scheduler call per block ---
        if pace is not None:
            pace(m)
        d, s = dst[start : start + m], src[start : start + m]
        if h is None:
            value = int(torch.ops.gemini_dcp.copy_with_crc32c(d, s, 1, value))
        else:
            d.copy_(s)
            h.update(d)
    return value if h is None else h.value()


Checksummer = Callable[[torch.Tensor], int]
