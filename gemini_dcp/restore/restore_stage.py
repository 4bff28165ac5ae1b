"""The stage of one restore: a rank's chunks between their tier and the state dict.

``GeminiStorageReader.read_data`` restores in two phases. *Stage*: every chunk this rank
needs is verified (:mod:`gemini_dcp.core.chunk_sink`) where it lies — a local chunk in its
mmap'd slot file (zero copy), a peer chunk in its receive buffer, a persistent chunk in its
mapped data file (zero copy; read into a tensor from a remote store) — and held here, outside the state dict. *Land*: only once every rank holds a
verified copy of every chunk it needs are they copied into the live tensors.

A chunk bound for a CUDA tensor and checksummed on the GPU when it was saved (``xsum64``) is verified
on the GPU (``GEMINI_DCP_H2D_VERIFY``, :class:`~gemini_dcp.options.device.DeviceOptions`): copied
host-to-device into a staging buffer of its own on the destination's device, checksummed there, and
held there; the landing is then a device-to-device copy. The CPU never reads its bytes, so such a
restore is bounded by the host-to-device DMA, not by a CPU checksum. The staging buffers of one
restore take at most half the device's free memory (measured at the first one); a chunk that does not
fit is verified on the CPU as before. The rule stays: nothing lands before every chunk is verified. A
:class:`RestoreStage` owns what the first phase leaves behind (slot mappings, receive
buffers, verified chunks, the destinations the key/shape check resolved) and lets it go:
after the landing off the critical path, after a failure at once.

Which step and which copy are restored is decided elsewhere (:mod:`gemini_dcp.core.restore_order`,
pure); the peer transfers live in :mod:`gemini_dcp.peer`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from ..core.chunk_sink import StagedChunks, describe_item, stored_view, verify_chunk
from ..core.faults import fault_point
from ..errors import GeminiError, IncompatibleCheckpointError
from ..local.record_types import ShardRef
from ..local.slots import ReadOnlySlot
from ..options.device import DeviceOptions
from .device_land import DeviceLander

if TYPE_CHECKING:
    from ..peer.arena import ReceiveArena
    from ..persistent.item_payload import MappedFile
    from ..persistent.store import PersistentTier

__all__ = ["RestoreStage"]

log = logging.getLogger(__name__)
GPU_ALGO = "xsum64"  # the checksum of chunks saved from CUDA tensors (gemini_dcp.save.device_copy)


class RestoreStage:
    """One load's verified chunks and the tier memory they are viewed through.

    Not thread-safe; one per reader. :meth:`begin` starts a load; :meth:`stage` /
    :meth:`stage_persistent` verify and hold chunks; :meth:`land` copies them into the
    state dict; :meth:`release` (after a landing) or :meth:`abandon` (after a failure)
    lets the memory go.
    """

    def __init__(self) -> None:
        self.maps: dict[Path, ReadOnlySlot] = {}
        self.arenas: list[ReceiveArena] = []  # this restore's peer receive buffers (gemini_dcp.peer.fetch)
        self.files: list[MappedFile] = []  # persistent data files whose pages the staged chunks view
        self.chunks = StagedChunks()
        self.dests: dict[int, torch.Tensor] = {}  # id(read item) -> its resolved destination
        self.rank_ok = True  # False: this rank will raise; it tells the others in the first agreement round
        self.error: GeminiError | None = None  # raised after the agreement round
        self.lander: DeviceLander | None = None  # the landing's CUDA copies and page-locked mappings, until released
        self.last_lander: DeviceLander | None = None  # the last released one (its byte counts: benchmarks, tests)
        self._gpu_verify: bool | None = None  # this load's GEMINI_DCP_H2D_VERIFY, decided at its first CUDA chunk
        self._device_room: dict[torch.device, int] = {}  # staging bytes this load may still take per device
        self.device_verified = 0  # bytes of this load verified on a GPU (statistics: benchmarks, tests)
        self.device_verify_seconds = 0.0  # wall time of those host-to-device copies and checksums
        self.register_seconds = 0.0  # wall time of page-locking the slot mappings for the GPU

    def begin(self) -> None:
        """Start a load: nothing staged, no destination resolved, no error yet."""
        self.chunks.clear()
        self.dests = {}
        self.error = None
        self._drop_lander()  # a landing's registrations, if a load ended without release()
        self._gpu_verify = None
        self._device_room = {}
        self.device_verified = 0
        self.device_verify_seconds = 0.0
        self.register_seconds = 0.0

    def prepare_device(self, chunks: list[tuple[list[ReadItem], torch.Tensor]]) -> None:
        """Before the chunks (``(items, stored bytes)``) are verified: page-lock the slot mappings
        enough of them lie in that go to CUDA tensors (:meth:`DeviceLander.prepare`'s rule), so the
        verification's host-to-device copies and the landing are DMA from the tier's pages."""
        if not chunks or not any(d.is_cuda for d in self.dests.values()):
            return
        t0 = time.perf_counter()
        if self.lander is None:
            self.lander = DeviceLander()
        self.lander.prepare([m.tensor for m in self.maps.values()], chunks, self.dests)
        self.register_seconds += time.perf_counter() - t0

    # ---- staging -------------------------------------------------------------------------------
    def local_bytes(self, path: Path | None, ref: ShardRef) -> torch.Tensor | None:
        """The stored bytes of ``ref`` in the slot file ``path`` (mapped once per load), or None."""
        if path is None:
            return None
        m = self.maps.get(path)
        if m is None:
            try:
                m = ReadOnlySlot(path)
            except FileNotFoundError:
                return None
            self.maps[path] = m
        if ref.offset + ref.length > m.size:
            return None
        return m.view(ref.offset, ref.length)

    def stage(self, items: list[ReadItem], ref: ShardRef, buf: torch.Tensor, step: int, metadata: Metadata | None) -> bool:
        """Verify ``buf`` (the stored bytes of one chunk) against ``ref``; if it matches, hold it
        for :meth:`land`, with nothing copied yet. False on a checksum mismatch.

        ``metadata`` (the step's DCP metadata) supplies dtype/shape for records predating those
        fields. A record that cannot say what the chunk is becomes this rank's error (raised
        after the agreement round) and counts as staged: no other copy can fix the record.
        """
        on_device = self._verify_on_device(items, ref, buf)
        if on_device is False:
            return False
        if isinstance(on_device, torch.Tensor):
            buf = on_device  # verified on the GPU: held there, landed device-to-device
        elif not verify_chunk(buf, ref):
            return False
        if items[0].type == LoadItemType.BYTE_IO:
            self.chunks.add(items, buf)
            return True
        try:
            stored = _typed_view(buf, ref, items[0], step, metadata)
        except GeminiError as exc:  # raised after the agreement round (this rank is still in the protocol)
            self.error = self.error or exc
            self.rank_ok = False
            return True
        self.chunks.add(items, stored)
        return True

    def _verify_on_device(self, items: list[ReadItem], ref: ShardRef, buf: torch.Tensor) -> torch.Tensor | bool | None:
        """A GPU-checksummed chunk bound for a CUDA tensor (module docstring): its bytes in a staging
        buffer on that device once they match (False: they do not); None where it is verified on the CPU."""
        if ref.algo != GPU_ALGO or items[0].type == LoadItemType.BYTE_IO or buf.device.type != "cpu":
            return None
        dest = self.dests.get(id(items[0]))
        if dest is None or not dest.is_cuda or not self._verify_on_gpu():
            return None
        n = buf.numel()
        device = dest.device
        room = self._device_room.get(device)
        if room is None:
            free, _total = torch.cuda.mem_get_info(device)
            room = free // 2
        if n > room:
            return None
        self._device_room[device] = room - n
        from ..ext.cuda import gpu_checksum

        t0 = time.perf_counter()
        staging = torch.empty(n, dtype=torch.uint8, device=device)
        with torch.cuda.device(device):
            staging.copy_(buf.reshape(-1), non_blocking=True)  # DMA from a page-locked mapping (prepare_device)
            ok = gpu_checksum(staging) == ref.checksum  # the kernel runs after the copy (same stream); one readback
        self.device_verify_seconds += time.perf_counter() - t0
        if not ok:
            self._device_room[device] += n
            return False
        self.device_verified += n
        return staging

    def _verify_on_gpu(self) -> bool:
        if self._gpu_verify is None:
            mode = DeviceOptions.from_env().h2d_verify
            on = mode != "cpu"
            if on:
                from ..ext import loader

                on = bool(loader.load() and loader.has_cuda_ext())
                if not on and mode == "gpu":
                    log.warning("gemini_dcp: GEMINI_DCP_H2D_VERIFY=gpu but the extension's CUDA ops are not loaded; "
                                "chunks are verified on the CPU (gemini-dcp doctor says why the ops are missing).")
            self._gpu_verify = on
        return self._gpu_verify

    def stage_persistent(self, persistent: PersistentTier, step: int, plan: LoadPlan, planner: LoadPlanner) -> int:
        """Read and verify ``plan``'s items of ``step`` from the persistent tier into the stage; bytes read.

        Raises (PersistentTierError, ChecksumMismatchError) with nothing of ``plan`` staged.
        """
        got = StagedChunks()
        nbytes = persistent.read_items(step, plan, planner, stage=got, keep=self.files.append)
        self.chunks.extend(got)
        return nbytes

    # ---- landing and letting go ----------------------------------------------------------------
    def land(self, planner: LoadPlanner) -> None:
        """Copy every staged chunk into the state dict (dtype-converted as stock DCP converts).

        Chunks bound for CUDA tensors go host-to-device asynchronously, from page-locked slot
        mappings where enough of a mapping goes to the GPU (:mod:`gemini_dcp.restore.device_land`);
        this returns once every copy is done.
        """
        lander = self.lander
        if lander is None:
            lander = self.lander = DeviceLander()
        try:
            t0 = time.perf_counter()
            lander.prepare([m.tensor for m in self.maps.values()], self.chunks, self.dests)  # those not yet locked
            self.register_seconds += time.perf_counter() - t0
            self.chunks.land_all(planner, self.dests, after_first=lambda: fault_point("load.mid_copy"),
                                 copy=lander.copy)
        finally:
            self.dests = {}
            lander.finish()  # no DMA may outlive this call: the mappings are unregistered and unmapped next

    def _drop_lander(self) -> None:
        """Wait for the last landing's copies and undo its registrations (before any unmap)."""
        lander, self.lander = self.lander, None
        if lander is not None:
            lander.finish()
            lander.release()
            self.last_lander = lander

    def abandon(self) -> None:
        """A failed restore: drop the staged chunks, the slot mappings and the receive buffers now.

        The error (kept by DCP and the caller) must not keep zero-copy views of tier memory alive
        through its traceback's frames: a process that kept them until interpreter exit could
        abort while tearing down.
        """
        self.chunks.clear()
        self.dests = {}
        self._drop_lander()
        self.maps.clear()
        self.files.clear()
        arenas, self.arenas = self.arenas, []
        for arena in arenas:
            arena.release()  # after their pre-fault workers end

    def release(self) -> None:
        """Unmap the slot files off the restore's critical path.

        Nothing references the mappings once every chunk is copied into the live
        tensors, but tearing down the page tables of a populated mapping costs
        ~15 ms per GiB (a serving rank maps its own slots and the replicas it
        serves; a persistent restore maps the step's data files): a worker thread
        drops them while training resumes. The thread is
        *not* a daemon: the interpreter joins it before it finalizes, so a process
        that exits right after ``dcp.load`` never tears the runtime down under a
        thread still inside the unmap (a daemon thread there aborted the process
        with SIGABRT in about half of such exits). Once the interpreter is
        finalizing (no new threads), the unmap runs inline.
        """
        self._drop_lander()  # page-locked mappings are unregistered here, on the caller's thread (CUDA calls)
        maps, self.maps = self.maps, {}
        files, self.files = self.files, []
        arenas, self.arenas = self.arenas, []
        if not maps and not arenas and not files:
            return

        def unmap() -> None:
            maps.clear()
            files.clear()
            for arena in arenas:
                arena.release()  # the staged views are gone: the receive buffers' mapping goes with it
            arenas.clear()

        if sys.is_finalizing():
            unmap()
            return
        try:
            threading.Thread(target=unmap, name="gemini-dcp-unmap", daemon=False).start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            unmap()


def _typed_view(buf: torch.Tensor, ref: ShardRef, item: ReadItem, step: int, metadata: Metadata | None) -> torch.Tensor:
    """The chunk's verified bytes viewed as what was saved: its dtype and shape (``ref``), no copy."""
    dtype, shape = ref.dtype, ref.shape
    md = None
    if dtype is None or shape is None:  # records predating the fields: the DCP metadata has them
        md = None if metadata is None else metadata.state_dict_metadata.get(item.storage_index.fqn)
    tdtype = getattr(torch, dtype, None) if dtype is not None else getattr(getattr(md, "properties", None), "dtype", None)
    if shape is None:
        shape = _chunk_size(md, item.storage_index)
    if not isinstance(tdtype, torch.dtype) or shape is None:
        raise IncompatibleCheckpointError(
            f"{describe_item(item, ref, step)}: the record does not say what dtype/shape the chunk was saved "
            f"with (dtype {dtype!r}, shape {shape!r}); it cannot be restored by this gemini_dcp. Load it with "
            "the release that saved it, or load another step."
        )
    return stored_view(buf, tdtype, tuple(shape), describe_item(item, ref, step))


def _chunk_size(md: Any, index: MetadataIndex) -> tuple[int, ...] | None:
    """The size of the saved chunk at ``index.offset`` (from the DCP metadata), if known."""
    for chunk in getattr(md, "chunks", ()) or ():
        if tuple(chunk.offsets) == tuple(index.offset or ()):
            return tuple(chunk.sizes)
    return None
