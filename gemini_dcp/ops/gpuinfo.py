"""GPU facts through NVML (``pynvml``, from the ``nvidia-ml-py`` package): names, memory, PCIe links.

Used by ``gemini-dcp doctor`` and to size device-to-host copy chunks
(:func:`suggest_chunk_bytes`). Everything degrades to "unknown": with no GPU,
no driver or no pynvml, :func:`gpu_info` returns ``[]``.

NVML numbers GPUs by their physical order, which ``CUDA_VISIBLE_DEVICES`` does
not change; each entry carries its ``pci_bus_id`` and ``uuid`` to match it with
a CUDA device.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

# Usable bandwidth per lane and direction in GB/s (after line encoding), by PCIe generation.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

DEFAULT_CHUNK_BYTES = 32 << 20
MIN_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 64 << 20
CHUNK_SECONDS = 0.002  # a chunk occupies the copy engine for about this long


def _text(v: Any) -> Any:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def gpu_info() -> list[dict[str, Any]]:
    """One dict per GPU NVML sees; ``[]`` when there is none (or no driver / no pynvml).

    Keys: ``index``, ``name``, ``uuid``, ``pci_bus_id``, ``memory_total_bytes``,
    ``memory_used_bytes``, ``memory_free_bytes``, ``pcie_gen`` / ``pcie_width``
    (current link; it may train down when idle), ``pcie_gen_max`` /
    ``pcie_width_max``, ``pcie_link_gbps`` (theoretical GB/s per direction at the
    max link), ``pcie_tx_bytes_per_s`` / ``pcie_rx_bytes_per_s`` (NVML's sampled
    throughput, when readable), ``driver_version``. A value NVML cannot read is None.
    """
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        log.debug("gpuinfo: pynvml not installed (pip install nvidia-ml-py)")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("gpuinfo: NVML unavailable: %s", exc)
        return []
    try:
        return _query(pynvml)
    except pynvml.NVMLError as exc:
        log.debug("gpuinfo: NVML query failed: %s", exc)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("gpuinfo: nvmlShutdown failed: %s", exc)


def _query(pynvml: Any) -> list[dict[str, Any]]:
    def q(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError:
            return None

    driver = _text(q(pynvml.nvmlSystemGetDriverVersion))
    out: list[dict[str, Any]] = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = q(pynvml.nvmlDeviceGetMemoryInfo, h)
        pci = q(pynvml.nvmlDeviceGetPciInfo, h)
        gen_max = q(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
        width_max = q(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h)
        tx = q(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = q(pynvml.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        out.append({
            "index": i,
            "name": _text(q(pynvml.nvmlDeviceGetName, h)),
            "uuid": _text(q(pynvml.nvmlDeviceGetUUID, h)),
            "pci_bus_id": _text(getattr(pci, "busId", None)) if pci is not None else None,
            "memory_total_bytes": int(mem.total) if mem is not None else None,
            "memory_used_bytes": int(mem.used) if mem is not None else None,
            "memory_free_bytes": int(mem.free) if mem is not None else None,
            "pcie_gen": q(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "pcie_width": q(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
            "pcie_gen_max": gen_max,
            "pcie_width_max": width_max,
            "pcie_link_gbps": pcie_link_gbps(gen_max, width_max),
            # NVML reports KB/s over a short sampling window.
            "pcie_tx_bytes_per_s": int(tx) * 1024 if tx is not None else None,
            "pcie_rx_bytes_per_s": int(rx) * 1024 if rx is not None else None,
            "driver_version": driver,
        })
    return out


def pcie_link_gbps(gen: int | None, width: int | None) -> float | None:
    """Theoretical GB/s per direction of a PCIe link, or None if unknown."""
    if not gen or not width or gen not in PCIE_LANE_GBPS:
        return None
    return round(PCIE_LANE_GBPS[gen] * width, 2)


def suggest_chunk_bytes(index: int = 0, info: list[dict[str, Any]] | None = None) -> int:
    """A device-to-host chunk size for :func:`gemini_dcp.ext.copy_d2h_chunked` on GPU ``index``.

    About :data:`CHUNK_SECONDS` of transfer at the GPU's maximum PCIe link rate,
    rounded down to a power of two and kept within 4–64 MiB (gen3 x16 → 16 MiB,
    gen4 x16 → 32 MiB, gen5 x16 → 64 MiB); :data:`DEFAULT_CHUNK_BYTES` (32 MiB)
    when the link is unknown (no GPU, no NVML, an SXM part NVML reports no link for).
    """
    gpus = gpu_info() if info is None else info
    g = next((x for x in gpus if x.get("index") == index), None)
    gbps = None
    if g is not None:
        gbps = g.get("pcie_link_gbps") or pcie_link_gbps(g.get("pcie_gen"), g.get("pcie_width"))
    if not gbps:
        return DEFAULT_CHUNK_BYTES
    want = int(gbps * 1e9 * CHUNK_SECONDS)
    chunk = MIN_CHUNK_BYTES
    while chunk * 2 <= want and chunk * 2 <= MAX_CHUNK_BYTES:
        chunk *= 2
    return chunk
