"""Typed wrappers of the extension's CUDA ops, and the ``xsum64`` checksum, each with a pure-torch fallback.

::

    host_register(t) / host_unregister(t)    cudaHostRegister bookkeeping      fallback: torch.cuda.cudart()
    copy_d2h_chunked(dst, src, chunk)        chunked D2H on a low-priority stream  fallback: non_blocking copies
    gpu_checksum(t)                          xsum64 (CUDA and CPU kernels)     fallback: xsum64_reference (numpy)
    xsum64_accumulate(t, acc, i, kind)       xsum64's sum and the non-finite count into a device array, no readback
                                                                               fallback: reference + torch count

Importing this module touches no CUDA API: on a CPU machine every wrapper checks its
arguments and then does nothing (registration) or uses its fallback. Each call asks
:func:`gemini_dcp.ext.loader.load` (cheap after the first) whether the ops are there.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, GeminiError
from . import loader

__all__ = [
    "GPU_CHECKSUM_ALGO",
    "DeviceCopyError",
    "byte_view",
    "copy_d2h_chunked",
    "gpu_checksum",
    "has_accumulate",
    "host_register",
    "host_unregister",
    "xsum64_accumulate",
    "xsum64_finish",
    "xsum64_reference",
    "xsum64_sum_reference",
]

GPU_CHECKSUM_ALGO = "xsum64"
_MASK64 = (1 << 64) - 1
_XSUM_K = 0x9E3779B97F4A7C15
_XSUM_SEED = 0x6A09E667F3BCC909


class DeviceCopyError(GeminiError, RuntimeError):
    """A CUDA host registration or device-to-host copy failed."""


def _cuda_ops() -> bool:
    """Whether the extension's CUDA ops can be used (loads the extension on first use)."""
    return loader.load() and loader.has_cuda_ext()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (any device)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# Fallback bookkeeping of cudaHostRegister'ed ranges: data_ptr -> nbytes.
_FB_REGISTERED: dict[int, int] = {}
_FB_LOCK = threading.Lock()
_CUDA_ERROR_ALREADY_REGISTERED = 712
_CUDA_ERROR_NOT_REGISTERED = 713


def host_register(t: torch.Tensor) -> None:
    """Page-lock a contiguous CPU tensor's memory for the GPU (``cudaHostRegister``).

    Meant for the tier's buffers, e.g. an mmap of a tmpfs file, so that a
    device-to-host copy into them is a DMA with no staging buffer. Idempotent:
    registering the same tensor twice is a no-op, and memory that is already
    registered (or pinned by torch) is accepted. Without CUDA it does nothing.
    """
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ConfigError("host_register: expected a contiguous CPU tensor")
    if t.nbytes == 0:
        return
    if _cuda_ops():
        try:
            torch.ops.gemini_dcp.host_register(t)
        except RuntimeError as exc:
            raise DeviceCopyError(f"cudaHostRegister of {t.nbytes} bytes failed: {exc}") from exc
        return
    if not torch.cuda.is_available():
        return
    ptr, n = t.data_ptr(), t.nbytes
    with _FB_LOCK:
        if ptr in _FB_REGISTERED:
            return
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, n, 0))
        if rc == _CUDA_ERROR_ALREADY_REGISTERED:
            torch.cuda.cudart().cudaGetLastError()
            return  # someone else owns the registration; do not unregister it later
        if rc != 0:
            raise DeviceCopyError(f"cudaHostRegister of {n} bytes failed with CUDA error {rc}")
        _FB_REGISTERED[ptr] = n


def host_unregister(t: torch.Tensor) -> None:
    """Undo :func:`host_register` (idempotent; unknown tensors are ignored)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ConfigError("host_unregister: expected a CPU tensor")
    if t.nbytes == 0:
        return
    if _cuda_ops():
        try:
            torch.ops.gemini_dcp.host_unregister(t)
        except RuntimeError as exc:
            raise DeviceCopyError(f"cudaHostUnregister failed: {exc}") from exc
        return
    with _FB_LOCK:
        if _FB_REGISTERED.pop(t.data_ptr(), None) is None:
            return
        rc = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
        if rc not in (0, _CUDA_ERROR_NOT_REGISTERED):
            raise DeviceCopyError(f"cudaHostUnregister failed with CUDA error {rc}")


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get(idx)
    if s is None:
        s = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=0)  # 0 = lowest priority
    return s


def copy_d2h_chunked(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int = 64 << 20) -> torch.cuda.Event:
    """Start copying CUDA tensor ``src`` into CPU tensor ``dst`` (equal byte sizes, any dtypes).

    The copy runs as ``chunk_bytes`` pieces of cudaMemcpyAsync on a dedicated
    lowest-priority stream, ordered after the work queued on the caller's current
    stream. Returns a ``torch.cuda.Event`` recorded after the last piece: call
    ``.synchronize()`` (or make a stream wait on it) before reading ``dst``. For
    a true DMA, ``dst`` must be pinned or :func:`host_register`'ed; a pageable
    ``dst`` is still copied correctly, through the driver's staging buffer.
    """
    if not isinstance(src, torch.Tensor) or not src.is_cuda:
        raise ConfigError("copy_d2h_chunked: src must be a CUDA tensor")
    if not isinstance(dst, torch.Tensor) or dst.device.type != "cpu":
        raise ConfigError("copy_d2h_chunked: dst must be a CPU tensor")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ConfigError("copy_d2h_chunked: tensors must be contiguous")
    if src.nbytes != dst.nbytes:
        raise ConfigError(f"copy_d2h_chunked: size mismatch, dst has {dst.nbytes} bytes and src {src.nbytes}")
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ConfigError(f"copy_d2h_chunked: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if _cuda_ops():
        try:
            handle = int(torch.ops.gemini_dcp.copy_d2h_chunked(dst, src, chunk_bytes))
        except RuntimeError as exc:
            raise DeviceCopyError(f"copy_d2h_chunked failed: {exc}") from exc
        event = torch.cuda.Event(blocking=True)  # a waiter sleeps instead of spinning a core for the whole copy
        event.record(torch.cuda.ExternalStream(handle, device=src.device))
        return event
    stream = _side_stream(src.device)
    stream.wait_stream(torch.cuda.current_stream(src.device))
    d, s = byte_view(dst), byte_view(src)
    n = s.numel()
    with torch.cuda.stream(stream):
        for off in range(0, n, chunk_bytes):
            d[off : off + chunk_bytes].copy_(s[off : off + chunk_bytes], non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
    if n:
        src.record_stream(stream)
    return event


def _mix64(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def xsum64_reference(t: torch.Tensor, block_words: int = 1 << 20) -> int:
    """The exact CPU reference of :func:`gpu_checksum` (``xsum64``), in numpy uint64 arithmetic.

    Over the tensor's bytes (contiguous, any dtype or device; copied to the CPU):
    ``w_i`` = little-endian 64-bit word ``i`` (the last one zero-padded),
    ``S = sum_i mix64(w_i ^ ((i + 1) * K)) mod 2**64`` and the result is
    ``mix64(S ^ nbytes ^ SEED)``, with ``mix64`` the splitmix64 finalizer,
    ``K = 0x9E3779B97F4A7C15`` and ``SEED = 0x6A09E667F3BCC909``.
    """
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ConfigError("xsum64_reference: expected a contiguous tensor")
    return xsum64_finish(xsum64_sum_reference(t, 0, block_words), t.nbytes)


def xsum64_sum_reference(t: torch.Tensor, word_offset: int = 0, block_words: int = 1 << 20) -> int:
    """``S`` of :func:`xsum64_reference` over a contiguous tensor's bytes taken as words
    ``word_offset``, ``word_offset + 1``, ... of a larger buffer (the numpy twin of the extension's
    ``xsum64_sum``): pieces of a buffer, each starting on a word boundary, sum to the whole's ``S``."""
    b = byte_view(t.detach()).cpu()
    n = b.numel()
    raw = b.numpy()
    full = n // 8
    words = raw[: full * 8].view("<u8")  # a zero-copy view (numpy handles unaligned data)
    total = np.uint64(0)
    k = np.uint64(_XSUM_K)
    with np.errstate(over="ignore"):
        for start in range(0, full, block_words):
            w = words[start : start + block_words].astype(np.uint64, copy=False)
            first = word_offset + start + 1
            idx = np.arange(first, first + w.size, dtype=np.uint64)
            total = total + _mix64(w ^ (idx * k)).sum(dtype=np.uint64)
        if n % 8:
            tail = np.zeros(8, dtype=np.uint8)
            tail[: n % 8] = raw[full * 8 :]
            w = tail.view("<u8").astype(np.uint64)
            total = total + _mix64(w ^ (np.uint64(word_offset + full + 1) * k))[0]
    return int(total)


def xsum64_finish(total: int, nbytes: int) -> int:
    """``xsum64`` from ``S`` (:func:`xsum64_sum_reference`, mod 2**64) and the buffer's length."""
    with np.errstate(over="ignore"):
        z = np.array([np.uint64(total & _MASK64) ^ np.uint64(nbytes) ^ np.uint64(_XSUM_SEED)], dtype=np.uint64)
        return int(_mix64(z)[0])


def gpu_checksum(t: torch.Tensor) -> int:
    """``xsum64`` checksum (see :func:`xsum64_reference`) of a contiguous tensor's bytes, as an unsigned int.

    On a CUDA tensor with the CUDA extension it runs as a GPU kernel (one pass,
    one 8-byte readback; synchronizes with the current stream). CPU tensors use
    the extension's CPU kernel; without the extension, the numpy reference
    (a CUDA tensor is copied to the CPU first).
    """
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ConfigError("gpu_checksum: expected a contiguous tensor")
    if loader.load() and ((t.is_cuda and loader.has_cuda_ext()) or t.device.type == "cpu"):
        return int(torch.ops.gemini_dcp.xsum64(t)) & _MASK64
    return xsum64_reference(t)


_KIND_DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16}  # health.count.KINDS


def has_accumulate() -> bool:
    """Whether the extension's ``xsum64_accumulate`` CUDA op is loaded (an extension built from older
    sources has ``xsum64`` only)."""
    return _cuda_ops() and hasattr(torch.ops.gemini_dcp, "xsum64_accumulate")


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def xsum64_accumulate(t: torch.Tensor, acc: torch.Tensor, index: int, kind: int = 0) -> None:
    """Add ``S`` of ``t``'s bytes (:func:`xsum64_sum_reference`; ``xsum64`` is
    ``xsum64_finish(S, t.nbytes)``) into ``acc[index, 0]`` and the count of its non-finite values of
    ``kind`` (1 float32, 2 float64, 3 float16, 4 bfloat16; 0 none) into ``acc[index, 1]``.

    ``acc`` is an int64 ``[k, 2]`` tensor on ``t``'s device (S mod 2**64, as a signed value). On a
    CUDA tensor with the extension this queues one kernel on the current stream and reads nothing
    back: many tensors are summed into one array that is copied to the host once. Elsewhere (CPU
    tensors, no extension) the reference computes both and adds them in place.
    """
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ConfigError("xsum64_accumulate: expected a contiguous tensor")
    if not isinstance(kind, int) or not 0 <= kind <= 4:
        raise ConfigError(f"xsum64_accumulate: kind must be 0..4, got {kind!r}")
    if t.is_cuda and has_accumulate():
        torch.ops.gemini_dcp.xsum64_accumulate(t, acc, index, kind)
        return
    s = xsum64_sum_reference(t)
    count = 0
    if kind and t.nbytes:
        b = byte_view(t.detach())
        size = _KIND_DTYPES[kind].itemsize
        vals = b[: b.numel() - b.numel() % size].view(_KIND_DTYPES[kind])
        count = int(torch.isfinite(vals).logical_not().sum())
    cur = int(acc[index, 0])
    acc[index, 0] = _signed64(cur + s)
    acc[index, 1] += count
