"""Step 2 for CUDA tensors: device-to-host copies into the slot, chunk by chunk, paced, checksummed warm.

GEMINI's save path for GPU training. A CUDA tensor of a save reaches its slot as
``chunk_bytes`` pieces copied by :func:`gemini_dcp.ext.copy_d2h_chunked` (the extension's
cudaMemcpyAsync on a lowest-priority stream, ordered after the work already queued on the
caller's stream; a pure-torch fallback of the same contract without the extension). Each piece
is released by the interleaving pacer first (``pace(n)``: the async path's scheduler, which puts
the pieces into the idle gaps the profiler found), exactly as the CPU path's blocks are.

The checksum (``GEMINI_DCP_D2H_CHECKSUM``): ``gpu`` (the default where the extension's CUDA ops
are loaded) computes ``xsum64`` of the tensor on the GPU (one kernel over HBM and one 8-byte
readback), so the CPU never touches the bytes; the item's record says
``xsum64`` and every reader verifies it with the CPU kernel of the same function
(:mod:`gemini_dcp.core.checksum`), piece by piece. ``cpu`` keeps the slot's own algorithm
(``crc32c``/``xxh3``), computed on the CPU over each piece right after it landed while the next
piece is in flight, split over ``crc_threads`` threads. The CPU checksum, not the DMA, bounds
such a save (figures: docs/async.md "GPU"), hence ``gpu``.

Slot mappings are page-locked (``host_register``) once per mapping, the first time a CUDA tensor
is copied into them, so each piece is a DMA with no staging buffer; the registration is undone
before the mapping goes (:attr:`SlotFile.before_unmap`) and on :meth:`DeviceCopier.close`. A
registration that fails (no permission, ``RLIMIT_MEMLOCK``) logs one line saying why and the
copies go on, pageable (correct, through the driver's staging buffer).

The guard semantics of the async path stay exact: :meth:`DeviceCopier.copy` returns only once
the last piece of the tensor is in the slot (its event waited on), so a save's local write ends
when every byte of this rank is in the tier.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..core.checksum import new_hasher
from ..errors import GeminiError
from ..options.device import DeviceOptions

__all__ = ["DeviceCopier", "copy_path"]

log = logging.getLogger(__name__)
Pacer = Callable[[int], None]
DEFAULT_CHUNK_BYTES = 16 << 20  # large enough for full-speed DMA, small enough to fit communication gaps
DEFAULT_CRC_THREADS = 4  # the checksum_on="cpu" path: a piece's CRC split over 4 threads
GPU_ALGO = "xsum64"


class _Waitable(Protocol):
    def synchronize(self) -> None: ...


CopyFn = Callable[[torch.Tensor, torch.Tensor, int], _Waitable]


class _Slot(Protocol):
    tensor: torch.Tensor
    before_unmap: Callable[[torch.Tensor], None] | None


def copy_path() -> str:
    """Which path a CUDA tensor of a save takes here: ``"extension"`` (the extension's CUDA ops),
    ``"torch-fallback"`` (CUDA without the extension's ops: non-blocking copies on a side stream)
    or ``"none"`` (no CUDA)."""
    if not torch.cuda.is_available():
        return "none"
    from ..ext import loader

    return "extension" if loader.load() and loader.has_cuda_ext() else "torch-fallback"


def _default_copy(dst: torch.Tensor, src: torch.Tensor, chunk: int) -> _Waitable:
    from ..ext.cuda import copy_d2h_chunked

    return copy_d2h_chunked(dst, src, chunk)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t if t.is_contiguous() else t.contiguous()  # a temporary on the device for strided sources
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class DeviceCopier:
    """One writer's device-to-host copies (module docstring). Not thread-safe: one save at a time
    per writer, as the slot lock already ensures."""

    def __init__(self, chunk_bytes: int | None = None, *, copy_fn: CopyFn | None = None,
                 register_fn: Callable[[torch.Tensor], None] | None = None,
                 unregister_fn: Callable[[torch.Tensor], None] | None = None,
                 crc_threads: int | None = None, checksum_on: str | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.crc_threads = crc_threads or max(1, min(DEFAULT_CRC_THREADS, os.cpu_count() or 1))
        # the options validate an explicit value too (ConfigError saying what to choose)
        opts = DeviceOptions.from_env() if checksum_on is None else DeviceOptions(d2h_checksum=checksum_on)  # type: ignore[arg-type]
        self.checksum_on: str = opts.d2h_checksum
        self._gpu_checksum: bool | None = None
        self._copy = copy_fn or _default_copy
        self._register = register_fn
        self._unregister = unregister_fn
        self._registered: dict[int, torch.Tensor] = {}  # data_ptr -> the registered slot mapping
        self.register_failed: str | None = None  # why registration is off for this writer
        self.bytes_copied = 0
        self.chunks_copied = 0
        self.seconds = 0.0  # wall time inside copy() and wait(): bytes_copied / seconds is the GPU -> tier rate
        self._in_flight: _Waitable | None = None  # the last queued piece of the GPU-checksummed path

    # ---- page-locking the slot mappings -----------------------------------------------------------
    def ensure_registered(self, slot: _Slot) -> None:
        """Page-lock ``slot``'s current mapping (once per mapping); a failure logs why, once."""
        t = slot.tensor
        if self.register_failed is not None or t.numel() == 0 or t.data_ptr() in self._registered:
            return
        register = self._register
        unregister = self._unregister
        if register is None or unregister is None:
            from ..ext.cuda import host_register, host_unregister

            register, unregister = register or host_register, unregister or host_unregister
            self._register, self._unregister = register, unregister
        try:
            register(t)
        except (GeminiError, RuntimeError, OSError) as exc:
            self.register_failed = f"{type(exc).__name__}: {exc}"
            log.warning(
                "gemini_dcp: page-locking the tier's slot mappings failed (%s); device-to-host copies "
                "go on pageable (correct, slower). Raise the memlock limit (ulimit -l) to enable DMA.",
                self.register_failed,
            )
            return
        self._registered[t.data_ptr()] = t
        slot.before_unmap = self._forget

    def _forget(self, t: torch.Tensor) -> None:
        """Undo the registration of a mapping about to go (a slot grows or closes)."""
        held = self._registered.pop(t.data_ptr(), None) if t.numel() else None
        if held is not None and self._unregister is not None:
            try:
                self._unregister(held)
            except (GeminiError, RuntimeError, OSError) as exc:  # the mapping goes anyway
                log.warning("gemini_dcp: unregistering a slot mapping failed: %s", exc)

    def close(self) -> None:
        """Unregister every mapping still registered (idempotent)."""
        for t in list(self._registered.values()):
            self._forget(t)

    # ---- the checksum ---------------------------------------------------------------------------
    def item_algo(self, slot_algo: str) -> str:
        """The checksum algorithm of a CUDA item in a slot of ``slot_algo``: ``xsum64`` when it is
        computed on the GPU (module docstring), else the slot's."""
        if self._gpu_checksum is None:
            on = self.checksum_on != "cpu"
            if on:
                from ..ext import loader

                on = bool(loader.load() and loader.has_cuda_ext())
                if not on and self.checksum_on == "gpu":
                    log.warning("gemini_dcp: GEMINI_DCP_D2H_CHECKSUM=gpu but the extension's CUDA ops are not loaded; CUDA "
                                "tensors are checksummed on the CPU (gemini-dcp doctor says why the ops are missing).")
            self._gpu_checksum = on
        return GPU_ALGO if self._gpu_checksum else slot_algo

    # ---- the copy ---------------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, algo: str, pace: Pacer | None = None) -> int:
        """Copy CUDA tensor ``src`` into ``dst`` (a flat uint8 CPU view of the slot, ``src``'s byte
        size) piece by piece, and return the checksum (``algo``) of the bytes as they landed.

        With the slot's own algorithm this returns once every piece is in ``dst``; with ``xsum64``
        (the GPU checksum) once every piece is queued: call :meth:`wait` before ``dst`` is read or
        the save is called done (``LocalWriter`` does, once per write).
        """
        t0 = time.perf_counter()
        try:
            return self._copy_all(dst, src, algo, pace)
        finally:
            self.seconds += time.perf_counter() - t0

    def _copy_all(self, dst: torch.Tensor, src: torch.Tensor, algo: str, pace: Pacer | None) -> int:
        s = _flat_bytes(src.detach())
        n = s.numel()
        if dst.numel() != n or dst.dtype != torch.uint8 or dst.device.type != "cpu":
            raise GeminiError(f"device copy: destination of {dst.numel()} {dst.dtype} on {dst.device} does not take "
                              f"{n} bytes (an internal error: report it)")
        chunk = self.chunk_bytes or DEFAULT_CHUNK_BYTES
        if algo == GPU_ALGO:
            return self._copy_gpu_checksummed(dst, s, n, chunk, pace)
        h = new_hasher(algo)
        pending: tuple[Any, int, int] | None = None  # (event, start, length) of the piece in flight
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            if pace is not None:
                pace(m)
            ev = self._copy(dst[start : start + m], s[start : start + m], m)
            if pending is not None:
                self._land(h, dst, *pending)
            pending = (ev, start, m)
        if pending is not None:
            self._land(h, dst, *pending)
        self.bytes_copied += n
        return h.value()

    def _copy_gpu_checksummed(self, dst: torch.Tensor, s: torch.Tensor, n: int, chunk: int, pace: Pacer | None) -> int:
        """The pieces on the copy stream, the ``xsum64`` kernel on the current stream meanwhile; no CPU pass."""
        from ..ext.cuda import gpu_checksum

        last: _Waitable | None = None
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            if pace is not None:
                pace(m)
            last = self._copy(dst[start : start + m], s[start : start + m], m)
            self.chunks_copied += 1
        value = gpu_checksum(s)  # of the device bytes the copies read (same stream order: nothing wrote them since)
        if last is not None:
            # No wait here: the next tensor's pieces queue behind these on the same stream, so the copy
            # engine never idles between tensors; wait() (once per local write) waits for the last one.
            self._in_flight = last
        self.bytes_copied += n
        return value

    def wait(self) -> None:
        """Wait until every piece queued by :meth:`copy` is in the slot (the local write calls this
        before it returns, also on an error: no DMA may outlive the write)."""
        last, self._in_flight = self._in_flight, None
        if last is not None:
            t0 = time.perf_counter()
            last.synchronize()
            self.seconds += time.perf_counter() - t0

    def _land(self, h: Any, dst: torch.Tensor, ev: _Waitable, start: int, m: int) -> None:
        ev.synchronize()
        h.update(dst[start : start + m], self.crc_threads)  # the piece is in the CPU's cache: read once, now
        self.chunks_copied += 1
