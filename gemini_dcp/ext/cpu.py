"""Typed wrappers of the extension's CPU ops, each with a pure-torch (or ``crc32c`` package) fallback.

::

    copy_bytes(dst, src, num_threads)        multi-threaded memcpy              fallback: dst.copy_(src)
    crc32c(buf, value)                       CRC-32C, SSE4.2, 3-way interleaved fallback: the crc32c package
    copy_with_crc32c(dst, src, n, value)     copy + CRC-32C in one pass         fallback: copy_ then crc32c

All take 1-D contiguous uint8 CPU tensors (``gemini_dcp.core.checksum.as_bytes(t)``
makes one), check their arguments the same way on both paths, and release the GIL in the
extension. Each call asks :func:`gemini_dcp.ext.loader.load` (cheap after the first) whether
the ops are there.
"""

from __future__ import annotations

import crc32c as _crc32c_pkg
import torch

from ..errors import ConfigError
from . import loader

__all__ = ["copy_bytes", "copy_with_crc32c", "crc32c"]


# ------------------------------------------------------------------------------------- checks


def _check_bytes(t: torch.Tensor, op: str, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ConfigError(
            f"{op}: {name} must be a 1-D contiguous uint8 CPU tensor, got {t.dtype} shape {tuple(t.shape)} "
            f"on {t.device}{'' if t.is_contiguous() else ' (non-contiguous)'}; use gemini_dcp.core.checksum.as_bytes(t)"
        )


def _check_crc_value(value: int, op: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0xFFFFFFFF:
        raise ConfigError(f"{op}: value must be a uint32 (a previous CRC-32C), got {value!r}")


def _check_pair(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    _check_bytes(dst, op, "dst")
    _check_bytes(src, op, "src")
    if dst.numel() != src.numel():
        raise ConfigError(f"{op}: size mismatch, dst has {dst.numel()} bytes and src {src.numel()}")
    n = dst.numel()
    if n:
        d, s = dst.data_ptr(), src.data_ptr()
        if d != s and d < s + n and s < d + n:
            raise ConfigError(f"{op}: dst and src overlap")


def _check_threads(num_threads: int) -> None:
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 0:
        raise ConfigError(f"num_threads must be an int >= 0 (0 = automatic), got {num_threads!r}")


def _pkg_crc32c(buf: torch.Tensor, value: int) -> int:
    """The fallback CRC: the ``crc32c`` package over a zero-copy view of ``buf``."""
    return int(_crc32c_pkg.crc32c(buf.numpy().data.cast("B"), value))


# ------------------------------------------------------------------------------------- CPU ops


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, num_threads: int = 0) -> None:
    """Copy ``src`` into ``dst`` (1-D contiguous uint8 CPU tensors of equal size).

    Extension: ``num_threads`` memcpy threads with the GIL released; 0 picks
    min(4, torch.get_num_threads(), size / 8 MiB), at least 1. Fallback: ``dst.copy_(src)``.
    """
    _check_pair(dst, src, "copy_bytes")
    _check_threads(num_threads)
    if loader.load():
        torch.ops.gemini_dcp.copy_bytes(dst, src, num_threads)
    else:
        dst.copy_(src)


def crc32c(buf: torch.Tensor, value: int = 0, num_threads: int = 1) -> int:
    """CRC-32C (Castagnoli) of ``buf`` (1-D contiguous uint8 CPU tensor), continuing from ``value``.

    Equal to ``crc32c.crc32c(bytes(buf), value)`` of the ``crc32c`` package (its fallback),
    so ``crc32c(b, crc32c(a)) == crc32c(a + b)``. ``num_threads`` other than 1 (0: the
    extension's default count) splits the buffer over threads and combines their CRCs
    (the fallback ignores it).
    """
    _check_bytes(buf, "crc32c", "buf")
    _check_crc_value(value, "crc32c")
    _check_threads(num_threads)
    if loader.load():
        if num_threads == 1:
            return int(torch.ops.gemini_dcp.crc32c(buf, value))
        return int(torch.ops.gemini_dcp.crc32c(buf, value, num_threads))
    return _pkg_crc32c(buf, value)


def copy_with_crc32c(dst: torch.Tensor, src: torch.Tensor, num_threads: int = 0, value: int = 0) -> int:
    """Copy ``src`` into ``dst`` and return the CRC-32C of the bytes, in one pass.

    Used both for save (src = live tensor bytes, dst = tier) and load (src = tier,
    dst = live tensor). The extension copies 96 KiB blocks and checksums each while
    it is in cache; with several threads each takes a piece and the CRCs are
    combined. ``value`` continues a running CRC as in :func:`crc32c`, so a copy
    made block by block (the paced snapshot copy) stays one pass:
    ``copy_with_crc32c(d2, s2, value=copy_with_crc32c(d1, s1)) == crc32c(s1 + s2)``.
    Fallback: ``dst.copy_(src)`` then the ``crc32c`` package.
    """
    _check_pair(dst, src, "copy_with_crc32c")
    _check_threads(num_threads)
    _check_crc_value(value, "copy_with_crc32c")
    if loader.load():
        return int(torch.ops.gemini_dcp.copy_with_crc32c(dst, src, num_threads, value))
    dst.copy_(src)
    return _pkg_crc32c(dst, value)
