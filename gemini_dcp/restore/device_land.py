"""The landing of a restore onto CUDA tensors: host-to-device from page-locked tier mappings.

The restore side of the GPU save path (:mod:`gemini_dcp.save.device_copy`). By the time a
restore lands, every chunk it needs is verified where it lies (:mod:`gemini_dcp.restore.restore_stage`);
for a local-tier chunk that is a read-only mapping of the slot file. Copying such a chunk into a
CUDA tensor with a plain ``copy_`` is a *pageable* host-to-device copy: the driver bounces it
through its own small staging buffer, synchronously, at a fraction of the link's speed.

:class:`DeviceLander` instead page-locks (``cudaHostRegister`` with the read-only flag) each slot
mapping from which enough bytes go to CUDA tensors, once per restore, so that every chunk is one
asynchronous DMA (``copy_(non_blocking=True)``) straight from the tier's pages, with no staging copy;
after the last chunk, one synchronization (the caller's tensors hold the bytes when ``dcp.load``
returns), and the registrations are undone before the mappings go
(:meth:`RestoreStage.release`).

What is and is not registered (``GEMINI_DCP_H2D_REGISTER``): ``auto`` (default) registers a
mapping when at least :data:`MIN_REGISTER_BYTES` of its bytes land on CUDA tensors and they are
at least half of the mapping (page-locking pins every page of the range: a rank that takes a few
small items from another rank's slot must not pin that whole slot); ``1`` registers every mapping
with bytes bound for CUDA; ``0`` never registers (pageable copies, as before). A refused
registration (``RLIMIT_MEMLOCK``, a driver without read-only registration) logs one line and the
chunks go pageable: correct, slower. Bytes are never re-checked after the DMA: they were verified
in the mapping before any of them could land, which is the restore's rule for every tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..options.device import DeviceOptions, H2DRegister

__all__ = ["MIN_REGISTER_BYTES", "DeviceLander", "register_read_only", "unregister"]

log = logging.getLogger(__name__)

MIN_REGISTER_BYTES = 64 << 20
_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (CUDA >= 11.1)
_CUDA_ERROR_ALREADY_REGISTERED = 712

RegisterFn = Callable[[torch.Tensor], None]


class RegistrationRefused(RuntimeError):
    """cudaHostRegister refused a mapping (the caller falls back to pageable copies)."""


def register_read_only(t: torch.Tensor) -> None:
    """Page-lock a read-only CPU mapping for DMA (``cudaHostRegister(..., ReadOnly)``)."""
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, _CUDA_HOST_REGISTER_READ_ONLY))
    if rc == _CUDA_ERROR_ALREADY_REGISTERED:
        torch.cuda.cudart().cudaGetLastError()
        raise RegistrationRefused("the range is already registered by someone else")
    if rc != 0:
        torch.cuda.cudart().cudaGetLastError()  # clear the sticky-free error so later calls do not see it
        raise RegistrationRefused(f"cudaHostRegister(read-only) of {t.nbytes} bytes failed with CUDA error {rc}")


def unregister(t: torch.Tensor) -> None:
    """Undo :func:`register_read_only` (errors are logged: the mapping goes anyway)."""
    rc = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
    if rc != 0:
        torch.cuda.cudart().cudaGetLastError()
        log.warning("gemini_dcp: cudaHostUnregister of a slot mapping failed with CUDA error %d", rc)




class DeviceLander:
    """One restore's host-to-device landing (module docstring). Not thread-safe: one per
    :class:`~gemini_dcp.restore.restore_stage.RestoreStage`."""

    def __init__(self, *, register_fn: RegisterFn | None = None, unregister_fn: RegisterFn | None = None,
                 min_bytes: int = MIN_REGISTER_BYTES, mode: H2DRegister | None = None,
                 cuda_available: Callable[[], bool] = torch.cuda.is_available) -> None:
        self._cuda_available = cuda_available
        self._register = register_fn or register_read_only
        self._unregister = unregister_fn or unregister
        self.min_bytes = min_bytes
        self.mode = mode
        self._registered: list[torch.Tensor] = []
        self.register_failed: str | None = None  # why the last refused registration was refused
        self.devices: set[torch.device] = set()  # CUDA devices that got asynchronous copies
        self.bytes_to_device = 0
        self.bytes_on_device = 0  # landed device-to-device from staging buffers verified on the GPU
        self.bytes_registered = 0

    # ---- before the landing ------------------------------------------------------------------
    def prepare(self, mappings: Sequence[torch.Tensor], chunks: Iterable[tuple[Sequence[Any], Any]],
                dests: dict[int, torch.Tensor]) -> None:
        """Page-lock the ``mappings`` (whole uint8 CPU tensors of tier memory) that enough of the
        ``chunks`` (``(items, stored)`` pairs) bound for CUDA destinations lie in (module docstring)."""
        mode = self.mode or DeviceOptions.from_env().h2d_register
        if mode == "never" or not mappings or not self._cuda_available():
            return
        spans = sorted(((m.data_ptr(), m.data_ptr() + m.nbytes, i) for i, m in enumerate(mappings) if m.nbytes),
                       key=lambda s: s[0])
        to_device = [0] * len(mappings)
        for items, stored in chunks:
            if not isinstance(stored, torch.Tensor) or stored.device.type != "cpu" or not items:
                continue
            dest = dests.get(id(items[0]))
            if dest is None or not dest.is_cuda:
                continue
            ptr = stored.data_ptr()
            for lo, hi, i in spans:
                if lo <= ptr < hi:
                    to_device[i] += stored.nbytes
                    break
        held = {r.data_ptr() for r in self._registered}
        for i, n in enumerate(to_device):
            m = mappings[i]
            if not n or m.data_ptr() in held or (mode == "auto" and (n < self.min_bytes or 2 * n < m.nbytes)):
                continue
            try:
                self._register(m)
            except (RegistrationRefused, RuntimeError, OSError) as exc:
                if self.register_failed is None:
                    log.warning("gemini_dcp: page-locking a slot mapping for the restore failed (%s); the chunks go "
                                "to the GPU pageable (correct, slower). Raise the memlock limit (ulimit -l) or set "
                                "GEMINI_DCP_H2D_REGISTER=0 to skip the attempt.", exc)
                self.register_failed = str(exc)
                continue
            self._registered.append(m)
            self.bytes_registered += m.nbytes

    # ---- the landing -------------------------------------------------------------------------
    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """``dest.copy_(src)``: asynchronous when ``dest`` is a CUDA tensor (finished by :meth:`finish`);
        ``src`` on the host (a tier mapping) or on the device (a chunk verified there)."""
        if dest.is_cuda:
            dest.copy_(src, non_blocking=True)  # from the host: a DMA; from a GPU staging buffer: on the device
            self.devices.add(dest.device)
            if src.device.type == "cpu":
                self.bytes_to_device += src.nbytes
            else:
                self.bytes_on_device += src.nbytes
            return
        dest.copy_(src)

    def finish(self) -> None:
        """Wait until every asynchronous copy is done: the caller's tensors hold the bytes, and the
        source mappings may be unregistered and unmapped."""
        devices, self.devices = self.devices, set()
        for d in devices:
            torch.cuda.current_stream(d).synchronize()

    # ---- after the landing -------------------------------------------------------------------
    def release(self) -> None:
        """Undo every registration (before the mappings go); idempotent."""
        held, self._registered = self._registered, []
        for m in held:
            try:
                self._unregister(m)
            except (RuntimeError, OSError) as exc:
                log.warning("gemini_dcp: unregistering a slot mapping failed: %s", exc)
