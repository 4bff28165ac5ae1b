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

__all__ = ["DeviceCopier", "DeviceSums", "Pending", "copy_path"]

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


class Pending:
    """A number of the current write that is still on the device: row ``row`` of its
    :class:`DeviceSums` (the checksum, or with ``count`` the non-finite count); :meth:`DeviceCopier.resolve`
    replaces it after :meth:`DeviceCopier.wait`."""

    __slots__ = ("count", "row")

    def __init__(self, row: int, count: bool = False) -> None:
        self.row = row
        self.count = count

    def __repr__(self) -> str:
        return f"Pending({self.row}{', count' if self.count else ''})"


class DeviceSums:
    """One write's ``xsum64`` sums and non-finite counts, accumulated on the device by one kernel per
    tensor (:func:`gemini_dcp.ext.cuda.xsum64_accumulate`) and read back in one copy per device.

    Rows are numbered across devices in the order of :meth:`add`; each device has an int64 ``[k, 2]``
    array (kept from write to write, zeroed on its first use in a write, doubled when full), written
    on the current stream, so the readback is ordered after every kernel.
    """

    def __init__(self) -> None:
        self._arrays: dict[torch.device, torch.Tensor] = {}
        self._used: dict[torch.device, int] = {}  # rows used this write, per device
        self._rows: list[tuple[torch.device, int, int]] = []  # (device, row in its array, nbytes)

    def add(self, t: torch.Tensor, nbytes: int, kind: int = 0) -> Pending:
        """Queue the kernel over ``t`` (flat bytes on a CUDA device); its :class:`Pending` checksum."""
        from ..ext.cuda import xsum64_accumulate

        dev = t.device
        used = self._used.get(dev, 0)
        acc = self._arrays.get(dev)
        if acc is None or used >= acc.shape[0]:
            grown = torch.zeros((max(64, 2 * used), 2), dtype=torch.int64, device=dev)
            if acc is not None and used:
                grown[:used].copy_(acc[:used])
            acc = self._arrays[dev] = grown
        elif used == 0:
            acc.zero_()
        xsum64_accumulate(t, acc, used, kind)
        self._used[dev] = used + 1
        self._rows.append((dev, used, nbytes))
        return Pending(len(self._rows) - 1)

    @property
    def pending(self) -> int:
        """Rows added since the last :meth:`read`."""
        return len(self._rows)

    def read(self) -> list[tuple[int, int]]:
        """Every row's (``xsum64``, count) of this write, in :meth:`add` order, with one host copy per
        device (it waits for the kernels); the next :meth:`add` starts a new write."""
        from ..ext.cuda import xsum64_finish

        rows, used = self._rows, self._used
        self._rows, self._used = [], {}
        if not rows:
            return []
        host = {dev: self._arrays[dev][:k].cpu().tolist() for dev, k in used.items()}
        out = []
        for dev, row, nbytes in rows:
            s, count = host[dev][row]
            out.append((xsum64_finish(s & ((1 << 64) - 1), nbytes), int(count)))
        return out


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
        self._sums = DeviceSums()  # this write's xsum64 sums and non-finite counts, on the device
        self._values: list[tuple[int, int]] = []  # the last write's, read back by wait()

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
    def copy(self, dst: torch.Tensor, src: torch.Tensor, algo: str, pace: Pacer | None = None) -> int | Pending:
        """Copy CUDA tensor ``src`` into ``dst`` (a flat uint8 CPU view of the slot, ``src``'s byte
        size) piece by piece, and return the checksum (``algo``) of the bytes as they landed.

        With the slot's own algorithm this returns the checksum once every piece is in ``dst``; with
        ``xsum64`` (the GPU checksum) a :class:`Pending` once every piece and the checksum kernel are
        queued: call :meth:`wait` before ``dst`` is read or the save is called done (``LocalWriter``
        does, once per write), then :meth:`resolve` for the numbers.
        """
        t0 = time.perf_counter()
        try:
            return self._copy_all(dst, src, algo, pace)
        finally:
            self.seconds += time.perf_counter() - t0

    @staticmethod
    def _check_dst(dst: torch.Tensor, n: int) -> None:
        if dst.numel() != n or dst.dtype != torch.uint8 or dst.device.type != "cpu":
            raise GeminiError(f"device copy: destination of {dst.numel()} {dst.dtype} on {dst.device} does not take "
                              f"{n} bytes (an internal error: report it)")

    def counts_on_device(self, algo: str) -> bool:
        """Whether :meth:`copy_counted` counts in the checksum's kernel (no readback of its own)."""
        return algo == GPU_ALGO

    def _copy_all(self, dst: torch.Tensor, src: torch.Tensor, algo: str, pace: Pacer | None) -> int | Pending:
        s = _flat_bytes(src.detach())
        n = s.numel()
        self._check_dst(dst, n)
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

    def _copy_gpu_checksummed(self, dst: torch.Tensor, s: torch.Tensor, n: int, chunk: int, pace: Pacer | None,
                              kind: int = 0) -> Pending:
        """The pieces on the copy stream, the ``xsum64`` kernel on the current stream meanwhile; no CPU pass,
        no readback: the kernel adds into this write's device array, read back once by :meth:`wait`."""
        last: _Waitable | None = None
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            if pace is not None:
                pace(m)
            last = self._copy(dst[start : start + m], s[start : start + m], m)
            self.chunks_copied += 1
        # Of the device bytes the copies read (same stream order: nothing wrote them since).
        pending = self._sums.add(s, n, kind)
        if last is not None:
            # No wait here: the next tensor's pieces queue behind these on the same stream, so the copy
            # engine never idles between tensors; wait() (once per local write) waits for the last one.
            self._in_flight = last
        self.bytes_copied += n
        return pending

    def copy_counted(self, dst: torch.Tensor, src: torch.Tensor, algo: str, kind: int,
                     pace: Pacer | None = None) -> tuple[int | Pending, int | Pending]:
        """:meth:`copy` plus the count of ``src``'s non-finite values of ``kind`` (``health.count.KINDS``).

        With ``xsum64`` both come from one kernel pass over the device bytes and are read back with
        every other tensor's at :meth:`wait` (two :class:`Pending` values); otherwise the count is
        taken on the device now (one readback)."""
        if algo != GPU_ALGO:
            from ..health.count import count_nonfinite

            return self.copy(dst, src, algo, pace), count_nonfinite(src) if kind else 0
        t0 = time.perf_counter()
        try:
            s = _flat_bytes(src.detach())
            self._check_dst(dst, s.numel())
            pending = self._copy_gpu_checksummed(dst, s, s.numel(), self.chunk_bytes or DEFAULT_CHUNK_BYTES, pace, kind)
            return pending, Pending(pending.row, count=True)
        finally:
            self.seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Wait until every piece queued by :meth:`copy` is in the slot and read this write's device
        checksums back (one copy per device), for :meth:`resolve`. The local write calls this before
        it returns, also on an error: no DMA may outlive the write."""
        last, self._in_flight = self._in_flight, None
        t0 = time.perf_counter()
        try:
            if last is not None:
                last.synchronize()
        finally:
            if self._sums.pending:
                self._values = self._sums.read()
            self.seconds += time.perf_counter() - t0

    def resolve(self, values: list[Any]) -> list[int]:
        """``values`` with every :class:`Pending` of the last write replaced by its number (after :meth:`wait`)."""
        got = self._values
        return [(got[v.row][1] if v.count else got[v.row][0]) if type(v) is Pending else v for v in values]

    def _land(self, h: Any, dst: torch.Tensor, ev: _Waitable, start: int, m: int) -> None:
        ev.synchronize()
        h.update(dst[start : start + m], self.crc_threads)  # the piece is in the CPU's cache: read once, now
        self.chunks_copied += 1
