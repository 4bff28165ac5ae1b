"""The C++/CUDA extension of gemini_dcp: loader, typed wrappers and pure-torch fallbacks.

The sources live in the repository's ``csrc/`` (``gemini_ops.cpp``: CPU ops;
``cuda/gemini_cuda.cu``: CUDA ops) and are JIT-built with
:func:`torch.utils.cpp_extension.load` on first use, once per machine: the
shared library is cached under ``$GEMINI_DCP_EXT_CACHE`` (default
``~/.cache/gemini_dcp/ext``) in a folder named ``<torch version>-<hash>``, the
hash covering the sources, flags, variant (CPU or CPU+CUDA) and Python/torch
versions. A file lock keeps concurrent processes (several ranks of one node)
from building at the same time: the first builds, the others wait and load it.

Ops (``torch.ops.gemini_dcp.*``; all release the GIL)::

    copy_bytes(dst, src, num_threads)   multi-threaded memcpy
    crc32c(buf, value)                   CRC-32C, SSE4.2, 3-way interleaved
    copy_with_crc32c(dst, src, n, value) copy + CRC-32C in one pass over cache-sized blocks
    xsum64(t)                            the checksum of gpu_checksum (CPU and CUDA kernels)
    host_register / host_unregister      cudaHostRegister bookkeeping        (CUDA build only)
    copy_d2h_chunked(dst, src, chunk)    chunked D2H on a low-priority stream (CUDA build only)

Environment:

``GEMINI_DCP_EXT``
    ``auto`` (default): try to build/load, fall back to pure torch with a debug
    log on failure; ``0``: never build, always fall back; ``1``: the build must
    succeed, else :class:`ExtensionBuildError`.
``GEMINI_DCP_CUDA_EXT``
    ``auto`` (default): add the CUDA sources when ``torch.cuda.is_available()``
    and nvcc/CUDA_HOME are found (a failed CUDA build falls back to the CPU-only
    build); ``0``: CPU ops only; ``1``: the CUDA ops must build.
``GEMINI_DCP_EXT_CACHE``
    root folder of the build cache.
``GEMINI_DCP_EXT_VERBOSE=1``
    print what was built or loaded (as ``load(verbose=True)`` does).

When the sources are missing (a non-editable install without ``csrc/``) every
wrapper uses its fallback: ``dst.copy_(src)``, the ``crc32c`` package, torch's
non-blocking copies on a side stream, and :func:`xsum64_reference`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import ConfigError, GeminiError

__all__ = [
    "HAS_EXT",
    "HAS_CUDA_EXT",
    "ExtensionBuildError",
    "DeviceCopyError",
    "load",
    "status",
    "info",
    "copy_bytes",
    "crc32c",
    "copy_with_crc32c",
    "host_register",
    "host_unregister",
    "copy_d2h_chunked",
    "gpu_checksum",
    "xsum64_reference",
    "GPU_CHECKSUM_ALGO",
]

log = logging.getLogger(__name__)

# Set by load(); read before that through the module __getattr__ below, which loads.
HAS_EXT: bool
HAS_CUDA_EXT: bool

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
CPU_SOURCES = ("gemini_ops.cpp",)
CUDA_SOURCES = ("cuda/gemini_cuda.cu",)
CPU_CFLAGS = ("-O3",)
CUDA_CFLAGS = ("-O3",)

GPU_CHECKSUM_ALGO = "xsum64"
_MASK64 = (1 << 64) - 1
_XSUM_K = 0x9E3779B97F4A7C15
_XSUM_SEED = 0x6A09E667F3BCC909


class ExtensionBuildError(GeminiError):
    """The C++/CUDA extension could not be built or loaded (raised only when required)."""


class DeviceCopyError(GeminiError, RuntimeError):
    """A CUDA host registration or device-to-host copy failed."""


# ------------------------------------------------------------------------------------- loader


def _mode(var: str) -> str:
    raw = os.environ.get(var, "auto").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("0", "off", "false", "no", "never"):
        return "0"
    if raw in ("1", "on", "true", "yes", "force", "require", "required"):
        return "1"
    raise ConfigError(f"{var}={raw!r} is not a valid setting: use auto, 0 (never build) or 1 (must build).")


def _env_verbose() -> bool:
    return os.environ.get("GEMINI_DCP_EXT_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_root() -> Path:
    """Root of the build cache: ``$GEMINI_DCP_EXT_CACHE`` or ``~/.cache/gemini_dcp/ext``."""
    env = os.environ.get("GEMINI_DCP_EXT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gemini_dcp" / "ext"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) on ``path``; released by the kernel if the holder dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own baton file still serializes builds
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _find_nvcc() -> str | None:
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, only when needed

    home = cpp_extension.CUDA_HOME
    if home:
        nvcc = Path(home) / "bin" / "nvcc"
        if nvcc.exists():
            return str(nvcc)
    return None


class _Loader:
    """Builds (once, under a file lock) and loads the extension; one per source folder."""

    def __init__(self, csrc: Path) -> None:
        self.csrc = Path(csrc)
        self._lock = threading.RLock()
        self.done = False
        self.has_ext = False
        self.has_cuda = False
        self.error: ExtensionBuildError | None = None
        self.required = False
        self.library: Path | None = None
        self.how = "not loaded"

    # -- public ------------------------------------------------------------------------------
    def load(self, verbose: bool = False) -> bool:
        if self.done and not (self.required and self.error is not None):
            return self.has_ext
        with self._lock:
            if self.done:
                if self.required and self.error is not None:
                    raise self.error
                return self.has_ext
            mode = _mode("GEMINI_DCP_EXT")
            cuda_mode = _mode("GEMINI_DCP_CUDA_EXT")
            verbose = verbose or _env_verbose()
            self.required = mode == "1" or (mode != "0" and cuda_mode == "1")
            try:
                if mode == "0":
                    self.how = "disabled by GEMINI_DCP_EXT=0"
                    log.debug("gemini_dcp.ext: %s; using the pure-torch fallbacks", self.how)
                else:
                    self._load(cuda_mode, verbose)
            except ExtensionBuildError as exc:
                self.error = exc
                self.how = f"build failed: {_first_line(str(exc))}"
                if self.required:
                    raise
                log.debug("gemini_dcp.ext: %s; using the pure-torch fallbacks", exc)
            finally:
                self.done = True
            return self.has_ext

    # -- internals ---------------------------------------------------------------------------
    def _sources(self, with_cuda: bool) -> list[Path]:
        names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
        return [self.csrc / n for n in names]

    def _want_cuda(self, cuda_mode: str) -> bool:
        if cuda_mode == "0":
            return False
        missing = [str(p) for p in self._sources(True) if not p.is_file()]
        reasons = []
        if missing:
            reasons.append(f"CUDA sources missing: {', '.join(missing)}")
        if torch.version.cuda is None:
            reasons.append(f"torch {torch.__version__} is a CPU-only build")
        elif not torch.cuda.is_available():
            reasons.append("torch.cuda.is_available() is False")
        elif _find_nvcc() is None:
            reasons.append("nvcc not found (set CUDA_HOME)")
        if not reasons:
            return True
        if cuda_mode == "1":
            raise ExtensionBuildError(
                "GEMINI_DCP_CUDA_EXT=1 but the CUDA ops cannot be built: " + "; ".join(reasons)
                + ". Set GEMINI_DCP_CUDA_EXT=auto to build the CPU ops only."
            )
        log.debug("gemini_dcp.ext: CPU ops only (%s)", "; ".join(reasons))
        return False

    def _load(self, cuda_mode: str, verbose: bool) -> None:
        missing = [str(p) for p in self._sources(False) if not p.is_file()]
        if missing:
            raise ExtensionBuildError(
                f"extension sources not found ({', '.join(missing)}): this install has no csrc/ folder. "
                "Install from a source checkout (pip install -e .) to build the extension, or set "
                "GEMINI_DCP_EXT=0 to use the pure-torch fallbacks."
            )
        with_cuda = self._want_cuda(cuda_mode)
        if with_cuda:
            try:
                self._build_and_load(True, verbose)
                return
            except ExtensionBuildError as exc:
                if cuda_mode == "1":
                    raise
                log.debug("gemini_dcp.ext: CUDA build failed, building the CPU ops only: %s", exc)
                if verbose:
                    print(f"gemini_dcp.ext: CUDA ops failed to build ({_first_line(str(exc))}); "
                          "building the CPU ops only", file=sys.stderr)
        self._build_and_load(False, verbose)

    def build_dir(self, with_cuda: bool) -> Path:
        h = hashlib.sha256()
        for p in self._sources(with_cuda):
            h.update(str(p.relative_to(self.csrc)).encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
        flags: dict[str, Any] = {
            "cflags": CPU_CFLAGS,
            "cuda": with_cuda,
            "cuda_cflags": CUDA_CFLAGS if with_cuda else None,
            "torch_cuda": torch.version.cuda if with_cuda else None,
            "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None,
            "python": sys.version_info[:2],
            "machine": platform.machine(),
            "abi": getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        }
        h.update(json.dumps(flags, sort_keys=True, default=str).encode())
        return cache_root() / f"{torch.__version__}-{h.hexdigest()[:16]}"

    def _build_and_load(self, with_cuda: bool, verbose: bool) -> None:
        name = "gemini_dcp_ops_cuda" if with_cuda else "gemini_dcp_ops"
        what = "CPU ops + CUDA ops" if with_cuda else "CPU ops"
        try:
            bdir = self.build_dir(with_cuda)
        except OSError as exc:
            raise ExtensionBuildError(f"cannot read the extension sources in {self.csrc}: {exc}") from exc
        suffix = ".pyd" if sys.platform == "win32" else ".so"
        lib = bdir / f"{name}{suffix}"
        marker = bdir / "BUILD_OK.json"
        t0 = time.perf_counter()
        built = False
        if not (marker.is_file() and lib.is_file()):
            try:
                bdir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ExtensionBuildError(
                    f"cannot create the build folder {bdir}: {exc}. Set GEMINI_DCP_EXT_CACHE to a writable folder."
                ) from exc
            with _file_lock(bdir / ".gemini_build.lock"):
                if not (marker.is_file() and lib.is_file()):
                    self._compile(name, with_cuda, bdir, verbose)
                    marker.write_text(json.dumps({
                        "library": lib.name,
                        "variant": "cuda" if with_cuda else "cpu",
                        "torch": torch.__version__,
                        "python": platform.python_version(),
                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "seconds": round(time.perf_counter() - t0, 1),
                    }, indent=1))
                    built = True
        self._load_library(lib)
        self.library = lib
        self.has_ext = True
        self.has_cuda = with_cuda
        detail = _build_info()
        self.how = f"{'built' if built else 'loaded'} {what} ({detail}) from {lib}"
        msg = (f"gemini_dcp.ext: {'built' if built else 'loaded cached'} {what} in "
               f"{time.perf_counter() - t0:.1f} s: {_op_list(with_cuda)}; {detail}; {lib}")
        log.debug(msg)
        if verbose:
            print(msg, file=sys.stderr)

    def _compile(self, name: str, with_cuda: bool, bdir: Path, verbose: bool) -> None:
        # Only builders holding our lock get here, so torch's own baton file, if left
        # behind by a builder that was killed, is stale: remove it or load() waits forever.
        with contextlib.suppress(FileNotFoundError):
            (bdir / "lock").unlink()
        try:
            from torch.utils import cpp_extension  # noqa: PLC0415

            cpp_extension.load(
                name=name,
                sources=[str(p) for p in self._sources(with_cuda)],
                extra_cflags=list(CPU_CFLAGS),
                extra_cuda_cflags=list(CUDA_CFLAGS) if with_cuda else None,
                build_directory=str(bdir),
                with_cuda=with_cuda,
                is_python_module=False,
                verbose=verbose,
            )
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError, ValueError) as exc:
            raise ExtensionBuildError(
                f"building the gemini_dcp extension ({'CPU+CUDA' if with_cuda else 'CPU'}) in {bdir} failed: "
                f"{type(exc).__name__}: {_tail(str(exc))}\nSet GEMINI_DCP_EXT=0 to use the pure-torch fallbacks."
            ) from exc

    @staticmethod
    def _load_library(lib: Path) -> None:
        if _ops_loaded():
            # Another build of this namespace is already in the process (TORCH_LIBRARY can
            # register a namespace once); keep it.
            if str(lib) not in getattr(torch.ops, "loaded_libraries", set()):
                log.debug("gemini_dcp.ext: torch.ops.gemini_dcp already registered; not loading %s", lib)
            return
        try:
            torch.ops.load_library(str(lib))
        except OSError as exc:
            raise ExtensionBuildError(
                f"loading {lib} failed: {exc}. Delete that folder to rebuild, or set GEMINI_DCP_EXT=0."
            ) from exc


def _first_line(s: str) -> str:
    return s.strip().splitlines()[0] if s.strip() else s


def _tail(s: str, lines: int = 25) -> str:
    parts = s.strip().splitlines()
    return "\n".join(parts[-lines:])


def _ops_loaded() -> bool:
    try:
        torch.ops.gemini_dcp.crc32c  # noqa: B018 - raises if the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def _cuda_ops_loaded() -> bool:
    try:
        torch.ops.gemini_dcp.copy_d2h_chunked  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _build_info() -> str:
    try:
        return str(torch.ops.gemini_dcp.build_info())
    except (AttributeError, RuntimeError):
        return "?"


def _op_list(with_cuda: bool) -> str:
    ops = "copy_bytes, crc32c, copy_with_crc32c, xsum64"
    return ops + (" | CUDA: host_register, host_unregister, copy_d2h_chunked, xsum64" if with_cuda else "")


_LOADER = _Loader(CSRC_DIR)


def load(verbose: bool = False) -> bool:
    """Build (first time on this machine) and load the extension; True if its ops are usable.

    Cheap after the first call. Sets :data:`HAS_EXT` and :data:`HAS_CUDA_EXT`. With
    ``GEMINI_DCP_EXT=1`` (or ``GEMINI_DCP_CUDA_EXT=1``) a failure raises
    :class:`ExtensionBuildError`; otherwise it is logged at debug level and the
    fallbacks are used.
    """
    try:
        return _LOADER.load(verbose)
    finally:
        if _LOADER.done:
            globals()["HAS_EXT"] = _LOADER.has_ext
            globals()["HAS_CUDA_EXT"] = _LOADER.has_cuda and _cuda_ops_loaded()


def status() -> str:
    """One line: what is loaded (or why not). Does not build."""
    if not _LOADER.done:
        return "not loaded yet (load() builds or loads it on first use)"
    return _LOADER.how


def info() -> dict[str, Any]:
    """What :func:`status` says, as a dict (after :func:`load`)."""
    return {
        "has_ext": _LOADER.has_ext,
        "has_cuda_ext": bool(_LOADER.has_cuda and _cuda_ops_loaded()),
        "library": str(_LOADER.library) if _LOADER.library else None,
        "build_info": _build_info() if _LOADER.has_ext else None,
        "status": status(),
        "mode": os.environ.get("GEMINI_DCP_EXT", "auto"),
        "cuda_mode": os.environ.get("GEMINI_DCP_CUDA_EXT", "auto"),
        "cache_root": str(cache_root()),
        "sources": str(CSRC_DIR),
    }


def __getattr__(name: str) -> Any:
    if name in ("HAS_EXT", "HAS_CUDA_EXT"):
        load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _np_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _pkg_crc32c(buf: torch.Tensor, value: int) -> int:
    import crc32c as _crc32c_pkg  # noqa: PLC0415 - the fallback; a declared dependency

    return int(_crc32c_pkg.crc32c(_np_bytes(buf), value))


# ------------------------------------------------------------------------------------- CPU ops


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, num_threads: int = 0) -> None:
    """Copy ``src`` into ``dst`` (1-D contiguous uint8 CPU tensors of equal size).

    Extension: ``num_threads`` memcpy threads with the GIL released; 0 picks
    min(4, torch.get_num_threads(), size / 8 MiB), at least 1. Fallback: ``dst.copy_(src)``.
    """
    _check_pair(dst, src, "copy_bytes")
    _check_threads(num_threads)
    if load():
        torch.ops.gemini_dcp.copy_bytes(dst, src, num_threads)
    else:
        dst.copy_(src)


def crc32c(buf: torch.Tensor, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``buf`` (1-D contiguous uint8 CPU tensor), continuing from ``value``.

    Equal to ``crc32c.crc32c(bytes(buf), value)`` of the ``crc32c`` package (its fallback),
    so ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
    """
    _check_bytes(buf, "crc32c", "buf")
    _check_crc_value(value, "crc32c")
    if load():
        return int(torch.ops.gemini_dcp.crc32c(buf, value))
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
    if load():
        return int(torch.ops.gemini_dcp.copy_with_crc32c(dst, src, num_threads, value))
    dst.copy_(src)
    return _pkg_crc32c(dst, value)


# ------------------------------------------------------------------------------------- CUDA ops


def _byte_view(t: torch.Tensor) -> torch.Tensor:
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
    if load() and HAS_CUDA_EXT:
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
    if load() and HAS_CUDA_EXT:
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


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get(idx)
    if s is None:
        s = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=0)  # 0 = lowest priority
    return s


def copy_d2h_chunked(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int = 64 << 20) -> "torch.cuda.Event":
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
    if load() and HAS_CUDA_EXT:
        try:
            handle = int(torch.ops.gemini_dcp.copy_d2h_chunked(dst, src, chunk_bytes))
        except RuntimeError as exc:
            raise DeviceCopyError(f"copy_d2h_chunked failed: {exc}") from exc
        stream = torch.cuda.ExternalStream(handle, device=src.device)
        event = torch.cuda.Event()
        event.record(stream)
        return event
    stream = _side_stream(src.device)
    stream.wait_stream(torch.cuda.current_stream(src.device))
    d, s = _byte_view(dst), _byte_view(src)
    n = s.numel()
    with torch.cuda.stream(stream):
        for off in range(0, n, chunk_bytes):
            d[off : off + chunk_bytes].copy_(s[off : off + chunk_bytes], non_blocking=True)
        event = torch.cuda.Event()
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
    b = _byte_view(t.detach()).cpu()
    n = b.numel()
    raw = b.numpy()
    full = n // 8
    words = raw[: full * 8].view("<u8")  # a zero-copy view (numpy handles unaligned data)
    total = np.uint64(0)
    k = np.uint64(_XSUM_K)
    with np.errstate(over="ignore"):
        for start in range(0, full, block_words):
            w = words[start : start + block_words].astype(np.uint64, copy=False)
            idx = np.arange(start + 1, start + 1 + w.size, dtype=np.uint64)
            total = total + _mix64(w ^ (idx * k)).sum(dtype=np.uint64)
        if n % 8:
            tail = np.zeros(8, dtype=np.uint8)
            tail[: n % 8] = raw[full * 8 :]
            w = tail.view("<u8").astype(np.uint64)
            total = total + _mix64(w ^ (np.uint64(full + 1) * k))[0]
        return int(_mix64(np.array([total ^ np.uint64(n) ^ np.uint64(_XSUM_SEED)], dtype=np.uint64))[0])


def gpu_checksum(t: torch.Tensor) -> int:
    """``xsum64`` checksum (see :func:`xsum64_reference`) of a contiguous tensor's bytes, as an unsigned int.

    On a CUDA tensor with the CUDA extension it runs as a GPU kernel (one pass,
    one 8-byte readback; synchronizes with the current stream). CPU tensors use
    the extension's CPU kernel; without the extension, the numpy reference
    (a CUDA tensor is copied to the CPU first).
    """
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ConfigError("gpu_checksum: expected a contiguous tensor")
    if load() and ((t.is_cuda and HAS_CUDA_EXT) or t.device.type == "cpu"):
        return int(torch.ops.gemini_dcp.xsum64(t)) & _MASK64
    return xsum64_reference(t)
