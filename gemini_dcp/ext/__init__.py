"""The C++/CUDA extension of gemini_dcp: one face over its loader, CPU ops and CUDA ops.

==================  ==========================================================================
:mod:`.loader`      finds ``csrc/`` (source checkout, else the installed package data), builds
                    it once per machine into a cache, loads it, says why not (``status()``)
:mod:`.cpu`         ``copy_bytes``, ``crc32c``, ``copy_with_crc32c`` with their fallbacks
:mod:`.cuda`        ``host_register``/``host_unregister``, ``copy_d2h_chunked``, ``gpu_checksum``
                    (``xsum64``) with their fallbacks; imports nothing CUDA-specific
:mod:`.build`       ``python -m gemini_dcp.ext.build``: build ahead of time into the same cache
==================  ==========================================================================

Settings come from :class:`gemini_dcp.options.ext.ExtOptions` (``GEMINI_DCP_EXT``,
``GEMINI_DCP_CUDA_EXT``, ``GEMINI_DCP_EXT_CACHE``, ``GEMINI_DCP_EXT_VERBOSE``). Every
wrapper works without the extension (a failed or disabled build means the fallbacks);
``HAS_EXT`` / ``HAS_CUDA_EXT`` load it on first access. To force the fallbacks in a test,
patch ``gemini_dcp.ext.loader.load`` (the wrappers call it through that module).
"""

from __future__ import annotations

from typing import Any

from . import cpu, cuda, loader
from .cpu import copy_bytes, copy_with_crc32c, crc32c
from .cuda import (
    GPU_CHECKSUM_ALGO,
    DeviceCopyError,
    copy_d2h_chunked,
    gpu_checksum,
    host_register,
    host_unregister,
    xsum64_reference,
)
from .loader import CSRC_DIR, ExtensionBuildError, cache_root, info, load, status

__all__ = [
    "CSRC_DIR",
    "GPU_CHECKSUM_ALGO",
    "HAS_CUDA_EXT",
    "HAS_EXT",
    "DeviceCopyError",
    "ExtensionBuildError",
    "cache_root",
    "copy_bytes",
    "copy_d2h_chunked",
    "copy_with_crc32c",
    "cpu",
    "crc32c",
    "cuda",
    "gpu_checksum",
    "host_register",
    "host_unregister",
    "info",
    "load",
    "loader",
    "status",
    "xsum64_reference",
]

_LOADER = loader.LOADER  # the process's loader (gemini_dcp.ops.doctor reads it)
HAS_EXT: bool  # whether the CPU ops are loaded (loads on first access)
HAS_CUDA_EXT: bool  # whether the CUDA ops are loaded (loads on first access)


def __getattr__(name: str) -> Any:
    if name == "HAS_EXT":
        return loader.load()
    if name == "HAS_CUDA_EXT":
        return loader.load() and loader.has_cuda_ext()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
