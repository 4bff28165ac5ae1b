"""Counting the non-finite values (NaN, +-Inf) of a save's items, in the save's own pass.

A save reads every byte of every item once, to copy and checksum it into the tier
(:mod:`gemini_dcp.save.local_write`). The count rides that pass:

- CPU with the C++ extension and ``crc32c``: ``copy_crc32c_count`` copies, checksums and counts
  in one pass (each 64 KiB block is counted from the source, then copied and checksummed while
  it is in cache): :func:`copy_checksum_count` for an item copied alone, the writer's grouped
  copy (``local_write.copy_group_counted``, ``copy_crc32c_count_many`` per group) for small items;
- otherwise (no extension, ``xxh3``, incremental saves, pickled layouts): the item's bytes in the
  slot are counted right after the copy, by the extension's ``count_nonfinite`` when it loads,
  else by a vectorized torch expression (``GEMINI_DCP_EXT=0``);
- CUDA items are counted on the device, before their device-to-host copy (one reduction per item).

A value is non-finite when its exponent bits are all ones; a ``kind`` names the float layout
(:data:`KINDS`). Integer and bool items are not counted (kind 0).

float8 items (``float8_e4m3fn``, ``float8_e5m2``, the ``fnuz`` kinds, ``float8_e8m0fnu``, where torch
has them) are counted by a bit test of their bytes (:data:`FLOAT8_NAN`), right after their copy
(a second pass over one byte per value; the extension's kernels count kinds 1-4 only,
:data:`EXT_KINDS`), on the device for CUDA items. Each kind's NaN (and, for ``e5m2``, ±Inf)
encodings are counted; a kind without an Inf (``e4m3fn`` saturates) has only NaN to count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.checksum import copy_and_checksum
from ..ext import loader as ext_loader

__all__ = ["EXT_KINDS", "FLOAT8_NAN", "KINDS", "count_bytes", "count_nonfinite", "copy_checksum_count", "kind_of",
           "kind_of_name", "kinds_of"]

#: dtype -> kind of the extension's counting ops: 1 float32, 2 float64, 3 float16, 4 bfloat16
#: (complex items count their real and imaginary parts); 5.. the float8 kinds (:data:`FLOAT8_NAN`).
KINDS: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4,
    torch.complex64: 1, torch.complex128: 2, torch.complex32: 3,
}
#: The kinds the extension's kernels count (1..EXT_KINDS); a higher kind is counted here, in torch.
EXT_KINDS = 4
#: float8 kind -> (mask, value): a byte ``b`` is NaN/Inf when ``b & mask == value``.
FLOAT8_NAN: dict[int, tuple[int, int]] = {}
for _kind, (_name, _mask, _value) in enumerate((
    ("float8_e4m3fn", 0x7F, 0x7F),  # S.1111.111 is NaN; no Inf
    ("float8_e5m2", 0x7C, 0x7C),  # exponent all ones: ±Inf, NaN
    ("float8_e4m3fnuz", 0xFF, 0x80),  # only "negative zero" is NaN; no Inf
    ("float8_e5m2fnuz", 0xFF, 0x80),
    ("float8_e8m0fnu", 0xFF, 0xFF),  # an exponent alone: all ones is NaN
), start=EXT_KINDS + 1):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        KINDS[_dt] = _kind
        FLOAT8_NAN[_kind] = (_mask, _value)
_DTYPE_OF_KIND = {1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16}
_ITEMSIZE = {1: 4, 2: 8, 3: 2, 4: 2}
_FLOAT8_PIECE = 16 << 20  # bytes bit-tested at once (bounds the temporaries)


def kind_of(dtype: torch.dtype) -> int:
    """The counting kind of ``dtype`` (0: not counted)."""
    return KINDS.get(dtype, 0)


_GROUP_KINDS: dict[int, tuple[list[torch.dtype], list[int]]] = {}


def kinds_of(dtypes: list[torch.dtype]) -> list[int]:
    """The kinds of a copy group's ``dtypes`` (the same list object save after save: computed once)."""
    hit = _GROUP_KINDS.get(id(dtypes))
    if hit is not None and hit[0] is dtypes:
        return hit[1]
    kinds = [KINDS.get(dt, 0) for dt in dtypes]
    if len(_GROUP_KINDS) >= 4096:
        _GROUP_KINDS.clear()
    _GROUP_KINDS[id(dtypes)] = (dtypes, kinds)  # holds the list: its id stays its own
    return kinds


def kind_of_name(name: str | None) -> int:
    """The counting kind of a recorded dtype name (``ShardRef.dtype``: ``"float32"``; 0: not counted)."""
    dtype = getattr(torch, name, None) if name else None
    return KINDS.get(dtype, 0) if isinstance(dtype, torch.dtype) else 0


def _torch_count(t: torch.Tensor) -> int:
    if t.is_complex():
        t = torch.view_as_real(t)
    return int(t.numel() - int(torch.isfinite(t).sum()))


def _float8_count(buf: torch.Tensor, kind: int) -> int:
    """NaN/Inf values of float8 ``kind`` in ``buf`` (flat uint8 bytes, any device), by a bit test per piece."""
    mask, value = FLOAT8_NAN[kind]
    total = 0
    for start in range(0, buf.numel(), _FLOAT8_PIECE):
        piece = buf[start : start + _FLOAT8_PIECE]
        total += int(((piece & mask) if mask != 0xFF else piece).eq(value).sum())
    return total


def count_bytes(buf: torch.Tensor, kind: int) -> int:
    """Non-finite values of ``kind`` in ``buf`` (flat uint8 CPU bytes, whole values)."""
    n = buf.numel()
    if not kind or not n:
        return 0
    if kind > EXT_KINDS:
        return _float8_count(buf, kind)
    if ext_loader.load():
        return int(torch.ops.gemini_dcp.count_nonfinite(buf, kind, 1))
    size = _ITEMSIZE[kind]
    return _torch_count(buf[: n - n % size].view(_DTYPE_OF_KIND[kind]))


def count_nonfinite(t: torch.Tensor) -> int:
    """Non-finite values of any tensor (CPU or CUDA, any layout); 0 for a non-float dtype."""
    kind = kind_of(t.dtype)
    if not kind or not t.numel():
        return 0
    if t.device.type == "cpu" and t.is_contiguous() and not t.is_quantized and t.layout is torch.strided:
        return count_bytes(t.reshape(-1).view(torch.uint8), kind)
    if kind > EXT_KINDS:  # float8 on the device, or not contiguous: the same bit test
        return _float8_count(t.detach().contiguous().reshape(-1).view(torch.uint8), kind)
    return _torch_count(t.detach())


def copy_checksum_count(
    dst: torch.Tensor, src: torch.Tensor, algo: str, kind: int, block: int, pace: Callable[[int], None] | None
) -> tuple[int, int]:
    """:func:`gemini_dcp.core.checksum.copy_and_checksum` of ``src`` (flat uint8) into ``dst``, plus the
    count of ``src``'s non-finite values of ``kind``: (checksum, count), in one pass where it can."""
    if kind and kind <= EXT_KINDS and algo == "crc32c" and ext_loader.load():
        op = torch.ops.gemini_dcp.copy_crc32c_count
        if pace is None:
            crc, cnt = op(dst, src, kind, 0, 0)
            return int(crc), int(cnt)
        n, value, total = src.numel(), 0, 0
        for start in range(0, n, block):
            m = min(block, n - start)
            pace(m)
            value, cnt = op(dst[start : start + m], src[start : start + m], kind, 1, value)
            total += int(cnt)
        return int(value), total
    value = copy_and_checksum(dst, src, algo, block, pace=pace)
    return value, count_bytes(dst, kind)
