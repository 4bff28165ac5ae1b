"""Finds the extension's C++/CUDA sources, builds them once per machine into a cache, loads them, says why not.

Sources (:func:`find_csrc`): the repository's top-level ``csrc/`` in a source checkout
(editable install, ``PYTHONPATH``), else the copy an installed wheel ships as package
data under ``gemini_dcp/ext/csrc``. They are JIT-built with
:func:`torch.utils.cpp_extension.load` on first use: the shared library is cached under
:attr:`ExtOptions.cache_dir <gemini_dcp.options.ext.ExtOptions>` in a folder named
``<torch version>-<hash>``, the hash covering the sources, flags, variant (CPU or
CPU+CUDA) and Python/torch versions, so the same sources found in either place share one
build. A file lock keeps concurrent processes (several ranks of one node) from building at
the same time: the first builds, the others wait and load it.

The ops register as ``torch.ops.gemini_dcp.*``; :mod:`.cpu` and :mod:`.cuda` wrap them.
``python -m gemini_dcp.ext.build`` builds ahead of time into the same cache.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import GeminiError
from ..options.ext import ExtOptions

__all__ = [
    "CPU_SOURCES",
    "CSRC_DIR",
    "CUDA_SOURCES",
    "LOADER",
    "ExtensionBuildError",
    "Loader",
    "cache_root",
    "csrc_candidates",
    "find_csrc",
    "find_nvcc",
    "has_cuda_ext",
    "info",
    "load",
    "status",
]

log = logging.getLogger("gemini_dcp.ext")

CPU_SOURCES = ("gemini_ops.cpp",)
CUDA_SOURCES = ("cuda/gemini_cuda.cu",)
CPU_CFLAGS = ("-O3",)
CUDA_CFLAGS = ("-O3",)

_PACKAGE_DIR = Path(__file__).resolve().parent  # gemini_dcp/ext


class ExtensionBuildError(GeminiError):
    """The C++/CUDA extension could not be built or loaded (raised only when required)."""


# ------------------------------------------------------------------------------------ sources


def csrc_candidates(package_dir: Path = _PACKAGE_DIR) -> list[Path]:
    """Where the sources may be, in the order searched, for the ``gemini_dcp/ext`` folder ``package_dir``.

    First the top-level ``csrc/`` of a source checkout (two levels up, beside a
    ``pyproject.toml``: an installed package's ``site-packages/csrc`` is not ours), then
    the package data of an installed wheel, ``gemini_dcp/ext/csrc``.
    """
    root = package_dir.parents[1]
    out = []
    if (root / "pyproject.toml").is_file():
        out.append(root / "csrc")
    out.append(package_dir / "csrc")
    return out


def find_csrc(package_dir: Path = _PACKAGE_DIR) -> Path | None:
    """The first of :func:`csrc_candidates` holding the CPU sources, or None."""
    for cand in csrc_candidates(package_dir):
        if all((cand / name).is_file() for name in CPU_SOURCES):
            return cand
    return None


# The folder this process builds from; without sources, the first candidate (named in messages).
CSRC_DIR: Path = find_csrc() or csrc_candidates()[0]


def cache_root(options: ExtOptions | None = None) -> Path:
    """Root of the build cache: ``$GEMINI_DCP_EXT_CACHE`` or ``~/.cache/gemini_dcp/ext``."""
    return (options or ExtOptions.from_env()).cache_dir


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) on ``path``; released by the kernel if the holder dies."""
    try:
        import fcntl  # noqa: PLC0415 - POSIX only
    except ImportError:  # not POSIX: torch's own baton file still serializes builds
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def find_nvcc() -> str | None:
    """The ``nvcc`` under torch's ``CUDA_HOME``, or None."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, only when needed

    home = cpp_extension.CUDA_HOME
    if home:
        nvcc = Path(home) / "bin" / "nvcc"
        if nvcc.exists():
            return str(nvcc)
    return None


# ------------------------------------------------------------------------------------- loader


class Loader:
    """Builds (once, under a file lock) and loads the extension from one source folder.

    ``options`` fixes the settings; None reads :meth:`ExtOptions.from_env` at the first
    :meth:`load`. Thread-safe; one load per instance (a required failure raises again on
    every later call).
    """

    def __init__(self, csrc: Path, options: ExtOptions | None = None) -> None:
        self.csrc = Path(csrc)
        self.options = options
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
        """Build if needed and load; True if the ops are usable (see the module :func:`load`)."""
        if self.done and not (self.required and self.error is not None):
            return self.has_ext
        with self._lock:
            if self.done:
                if self.required and self.error is not None:
                    raise self.error
                return self.has_ext
            opts = self._options()
            verbose = verbose or opts.verbose
            self.required = opts.required
            try:
                if opts.mode == "never":
                    self.how = "disabled by GEMINI_DCP_EXT=0"
                    log.debug("gemini_dcp.ext: %s; using the pure-torch fallbacks", self.how)
                else:
                    self._load(opts, verbose)
            except ExtensionBuildError as exc:
                self.error = exc
                self.how = f"build failed: {_first_line(str(exc))}"
                if self.required:
                    raise
                log.debug("gemini_dcp.ext: %s; using the pure-torch fallbacks", exc)
            finally:
                self.done = True
            return self.has_ext

    def build_dir(self, with_cuda: bool) -> Path:
        """The cache folder of this source folder's build (CPU, or CPU+CUDA)."""
        h = hashlib.sha256()
        for p in self._sources(with_cuda):
            h.update(str(p.relative_to(self.csrc)).encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
        flags: dict[str, Any] = {
            "cflags": CPU_CFLAGS,
            "cuda": with_cuda,
            "cuda_cflags": CUDA_CFLAGS if with_cuda else None,
            "torch_cuda": torch.version.cuda if with_cuda else None,
            "arch_list": _arch_list() if with_cuda else None,
            "python": sys.version_info[:2],
            "machine": platform.machine(),
            "abi": getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        }
        h.update(json.dumps(flags, sort_keys=True, default=str).encode())
        return self._options().cache_dir / f"{torch.__version__}-{h.hexdigest()[:16]}"

    # -- internals ---------------------------------------------------------------------------
    def _options(self) -> ExtOptions:
        return self.options if self.options is not None else ExtOptions.from_env()

    def _sources(self, with_cuda: bool) -> list[Path]:
        names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
        return [self.csrc / n for n in names]

    def _want_cuda(self, cuda_mode: str) -> bool:
        if cuda_mode == "never":
            return False
        reasons = cuda_unavailable_reasons(self.csrc)
        if not reasons:
            return True
        if cuda_mode == "required":
            raise ExtensionBuildError(
                "GEMINI_DCP_CUDA_EXT=1 but the CUDA ops cannot be built: " + "; ".join(reasons)
                + ". Set GEMINI_DCP_CUDA_EXT=auto to build the CPU ops only."
            )
        log.debug("gemini_dcp.ext: CPU ops only (%s)", "; ".join(reasons))
        return False

    def _load(self, opts: ExtOptions, verbose: bool) -> None:
        missing = [str(p) for p in self._sources(False) if not p.is_file()]
        if missing:
            raise ExtensionBuildError(
                f"extension sources not found ({', '.join(missing)}); looked in "
                f"{', '.join(map(str, csrc_candidates()))}. Reinstall gemini-dcp (its wheel ships them under "
                "gemini_dcp/ext/csrc) or install from a source checkout (pip install -e .), or set "
                "GEMINI_DCP_EXT=0 to use the pure-torch fallbacks."
            )
        if self._want_cuda(opts.cuda):
            try:
                self._build_and_load(True, verbose)
                return
            except ExtensionBuildError as exc:
                if opts.cuda == "required":
                    raise
                log.debug("gemini_dcp.ext: CUDA build failed, building the CPU ops only: %s", exc)
                if verbose:
                    print(f"gemini_dcp.ext: CUDA ops failed to build ({_first_line(str(exc))}); "
                          "building the CPU ops only", file=sys.stderr)
        self._build_and_load(False, verbose)

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
        _load_library(lib)
        self.library = lib
        self.has_ext = True
        self.has_cuda = with_cuda
        detail = build_info()
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
            from torch.utils import cpp_extension  # noqa: PLC0415 - slow import, only when building

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


def cuda_unavailable_reasons(csrc: Path) -> list[str]:
    """Why the CUDA ops cannot be built from ``csrc`` here (empty: they can)."""
    reasons = []
    missing = [str(csrc / n) for n in CPU_SOURCES + CUDA_SOURCES if not (csrc / n).is_file()]
    if missing:
        reasons.append(f"CUDA sources missing: {', '.join(missing)}")
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    elif not torch.cuda.is_available():
        reasons.append("torch.cuda.is_available() is False")
    elif find_nvcc() is None:
        reasons.append("nvcc not found (set CUDA_HOME)")
    return reasons


def _arch_list() -> str | None:
    """torch's own ``TORCH_CUDA_ARCH_LIST`` (it changes the CUDA build, so it is in the hash)."""
    return os.environ.get("TORCH_CUDA_ARCH_LIST")


def _load_library(lib: Path) -> None:
    if ops_loaded():
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


def ops_loaded() -> bool:
    """Whether ``torch.ops.gemini_dcp``'s CPU ops are registered in this process."""
    try:
        torch.ops.gemini_dcp.crc32c  # noqa: B018 - raises if the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def cuda_ops_loaded() -> bool:
    """Whether ``torch.ops.gemini_dcp``'s CUDA ops are registered in this process."""
    try:
        torch.ops.gemini_dcp.copy_d2h_chunked  # noqa: B018 - raises if the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def build_info() -> str:
    """The extension's own description of its build (CRC paths, CUDA), or ``?``."""
    try:
        return str(torch.ops.gemini_dcp.build_info())
    except (AttributeError, RuntimeError):
        return "?"


def _op_list(with_cuda: bool) -> str:
    ops = "copy_bytes, crc32c, copy_with_crc32c, xsum64"
    return ops + (" | CUDA: host_register, host_unregister, copy_d2h_chunked, xsum64" if with_cuda else "")


# ------------------------------------------------------------------------- the process's loader

LOADER = Loader(CSRC_DIR)


def load(verbose: bool = False) -> bool:
    """Build (first time on this machine) and load the extension; True if its ops are usable.

    Cheap after the first call. With ``GEMINI_DCP_EXT=1`` (or ``GEMINI_DCP_CUDA_EXT=1``) a
    failure raises :class:`ExtensionBuildError`; otherwise it is logged at debug level and
    the fallbacks are used. The ops wrappers call this through the module
    (``loader.load()``), so tests force the fallbacks by patching ``gemini_dcp.ext.loader.load``.
    """
    return LOADER.load(verbose)


def preload() -> None:
    """:func:`load` now, where a writer or reader is built: never inside a timed save or restore.

    Loading maps the library (``dlopen``), which waits for the process's memory-map lock; a
    restore pre-faults its receive buffers (:class:`gemini_dcp.peer.arena.ReceiveArena`) while
    gloo writes into them, and a first load behind that waited up to ~0.7 s. Called by the
    writer's and the reader's constructors; benchmarks replace it to measure the lazy load.
    """
    load()


def has_cuda_ext() -> bool:
    """Whether the CUDA ops are loaded (after :func:`load`; does not build)."""
    return LOADER.has_cuda and cuda_ops_loaded()


def status() -> str:
    """One line: what is loaded (or why not). Does not build."""
    if not LOADER.done:
        return "not loaded yet (load() builds or loads it on first use)"
    return LOADER.how


def info() -> dict[str, Any]:
    """What :func:`status` says, as a dict (after :func:`load`)."""
    opts = LOADER._options()
    return {
        "has_ext": LOADER.has_ext,
        "has_cuda_ext": has_cuda_ext(),
        "library": str(LOADER.library) if LOADER.library else None,
        "build_info": build_info() if LOADER.has_ext else None,
        "status": status(),
        "mode": opts.mode,
        "cuda_mode": opts.cuda,
        "cache_root": str(opts.cache_dir),
        "sources": str(LOADER.csrc),
    }
