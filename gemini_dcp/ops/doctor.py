"""``doctor``: is this host ready to hold a job's in-memory tier? One pass / warn / fail per line.

Checks the tier root, that it is memory-backed (tmpfs) and whether it gives
huge pages, free space against the expected checkpoint size, ``/dev/shm`` in
containers, host memory, the GPUs (NVML), torch against the supported range (read from the
installed package's metadata), torchrec's known-good pairing, and the C++ extension.
Never raises for what it finds; each failing line says how to fix it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..core.config import resolve_root
from ..core.torch_support import installed_torch_version, torch_requirement, torchrec_pairing, torchrec_support
from ..errors import ConfigError
from ..options.local import DEFAULT_KEEP, ENV_ROOT, root_from_env

GIB = float(1 << 30)
MEMORY_FSTYPES = ("tmpfs", "ramfs", "hugetlbfs")


CheckStatus = Literal["pass", "warn", "fail", "info"]


@dataclass
class Check:
    name: str
    status: CheckStatus
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class DoctorReport:
    root: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}


def mount_entry(path: Path, mounts_file: str = "/proc/mounts") -> tuple[str, str, str] | None:
    """(mount point, fstype, options) of the filesystem holding ``path`` (longest
    mount-point prefix in ``mounts_file``); None if that file cannot be read."""
    target = str(path.resolve())
    best: tuple[str, str, str] | None = None
    try:
        with open(mounts_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if target == mnt or target.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if best is None or len(mnt) >= len(best[0]):
                best = (mnt, parts[2], parts[3] if len(parts) > 3 else "")
    return best


def mount_of(path: Path, mounts_file: str = "/proc/mounts") -> tuple[str, str] | None:
    """(mount point, fstype) of the filesystem holding ``path`` (longest mount-point prefix)."""
    entry = mount_entry(path, mounts_file)
    if entry is None:
        return _mount_via_psutil(str(path.resolve()))
    return entry[0], entry[1]


def mount_options(path: Path, mounts_file: str = "/proc/mounts") -> dict[str, str]:
    """Mount options of the filesystem holding ``path`` (``{"size": "8g", "huge": "within_size", "rw": ""}``)."""
    entry = mount_entry(path, mounts_file)
    opts = entry[2] if entry is not None else ""
    return {k: v for k, _, v in (o.partition("=") for o in opts.split(",") if o)}


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE_PAGE_MODES = ("always", "within_size", "force")


def tmpfs_huge_pages(path: Path, mounts_file: str = "/proc/mounts", shmem_enabled_file: str = SHMEM_ENABLED) -> str:
    """How the tmpfs holding ``path`` allocates the pages of a slot file.

    The slot files are sized with ``posix_fallocate`` before they are mapped, so
    only a mount option (``huge=always`` or ``huge=within_size``) or the
    system-wide ``force`` gives them 2 MiB pages; ``huge=advise`` (and
    ``shmem_enabled=advise``) applies to pages first touched through an
    ``madvise``d mapping, which fallocated pages never are. ``deny`` in sysfs
    overrides every mount. Returns the mode in effect: ``"force"``,
    ``"always"``, ``"within_size"``, or the mode that leaves 4 KiB pages
    (``"never"``, ``"advise"``, ``"deny"``).
    """
    system = ""
    try:
        with open(shmem_enabled_file, encoding="utf-8") as f:
            text = f.read()
        system = next((w.strip("[]") for w in text.split() if w.startswith("[")), "")
    except OSError:
        pass
    if system in ("force", "deny"):
        return system
    return mount_options(path, mounts_file).get("huge", "never")


def _mount_via_psutil(target: str) -> tuple[str, str] | None:
    try:
        import psutil  # noqa: PLC0415
    except ImportError:
        return None
    best = None
    for p in psutil.disk_partitions(all=True):
        mnt = p.mountpoint
        if target == mnt or target.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if best is None or len(mnt) >= len(best[0]):
                best = (mnt, p.fstype)
    return best


def in_container() -> str | None:
    """'kubernetes' / 'docker' / 'podman' / 'container' when this looks like a container, else None."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if os.path.exists("/.dockerenv"):
        return "docker"
    if os.path.exists("/run/.containerenv"):
        return "podman"
    try:
        with open("/proc/1/cgroup", encoding="utf-8") as f:
            text = f.read()
        for key, name in (("kubepods", "kubernetes"), ("docker", "docker"), ("containerd", "container"), ("libpod", "podman")):
            if key in text:
                return name
    except OSError:
        pass
    if os.environ.get("container"):
        return "container"
    return None


def _gb(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def shm_fix(need_bytes: float) -> str:
    gib = max(1, int(-(-need_bytes // GIB)))
    return (f"docker run --shm-size={gib}g ...; Kubernetes: mount an emptyDir with medium: Memory and "
            f"sizeLimit: {gib}Gi at /dev/shm; or set {ENV_ROOT} to a larger tmpfs")


def doctor(
    root: str | os.PathLike[str] | None = None,
    *,
    expected_gb: float | None = None,
    keep: int = DEFAULT_KEEP,
    replicas: int = 1,
    mounts_file: str = "/proc/mounts",
    shm_path: str = "/dev/shm",
    build_ext: bool = False,
) -> DoctorReport:
    """Check the environment a job will run in; one :class:`Check` per line, never raising for what it finds.

    ``expected_gb``: checkpoint bytes per node (GiB) the job will save; the
    memory it needs here is ``expected_gb × (keep + 1) slots × replicas``.
    ``build_ext``: build the C++ extension if this machine has no cached build
    (otherwise it is only loaded from the cache, which is fast).
    """
    if not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep={keep!r}: give an int >= 1 (the job's keep, default {DEFAULT_KEEP}).")
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"replicas={replicas!r}: give an int >= 1 (copies of each node's checkpoint, its own included).")
    if expected_gb is not None and not expected_gb > 0:
        raise ConfigError(f"expected_gb={expected_gb!r}: give the checkpoint size per node in GiB (> 0).")
    path = resolve_root(root)
    explicit = (root is not None and str(root) != "") or root_from_env() is not None
    need = None if expected_gb is None else expected_gb * GIB * (keep + 1) * replicas
    checks: list[Check] = []

    # 1. the root
    probe = path
    if path.is_dir():
        if os.access(path, os.W_OK | os.X_OK):
            checks.append(Check("tier root", "pass", f"{path} exists and is writable"))
        else:
            checks.append(Check("tier root", "fail", f"{path} is not writable by uid {os.getuid()}",
                                f"chown/chmod it, or set {ENV_ROOT} to a writable tmpfs directory"))
    elif path.exists():
        checks.append(Check("tier root", "fail", f"{path} exists but is not a directory", f"point {ENV_ROOT} at a directory"))
        probe = path.parent
    elif not explicit and path.parent.is_dir() and os.access(path.parent, os.W_OK):
        checks.append(Check("tier root", "pass", f"{path} does not exist yet; the first save creates it (default root)"))
        probe = path.parent
    else:
        checks.append(Check("tier root", "fail", f"{path} does not exist",
                            f"mkdir -p {path} on a tmpfs (e.g. under /dev/shm), or set {ENV_ROOT} to an existing one"))
        probe = path.parent if path.parent.is_dir() else Path("/")

    # 2. memory-backed filesystem
    mnt = mount_of(probe, mounts_file)
    if mnt is None:
        checks.append(Check("tmpfs", "warn", f"cannot tell which filesystem holds {probe}"))
    elif mnt[1] in MEMORY_FSTYPES:
        checks.append(Check("tmpfs", "pass", f"{probe} is on {mnt[1]} mounted at {mnt[0]}"))
    else:
        checks.append(Check("tmpfs", "fail", f"{probe} is on {mnt[1]} (mount {mnt[0]}), not memory-backed: every save "
                            "would go through the page cache to disk at disk speed instead of staying in CPU memory",
                            f"set {ENV_ROOT} to a directory under /dev/shm or another tmpfs"))

    # 2b. page size of the tier's tmpfs
    if mnt is not None and mnt[1] == "tmpfs":
        huge = tmpfs_huge_pages(probe, mounts_file)
        if huge in HUGE_PAGE_MODES:
            checks.append(Check("huge pages", "pass", f"{mnt[0]} gives slot files 2 MiB pages (huge={huge})"))
        else:
            checks.append(Check(
                "huge pages", "info",
                f"{mnt[0]} gives slot files 4 KiB pages (huge={huge}): every restore maps ~0.1 s of page "
                "tables per GiB; 2 MiB pages restored a lost node ~1.5x faster (docs/architecture.md)",
                f"mount -t tmpfs -o size=<N>g,huge=within_size tmpfs /mnt/gemini_dcp and set {ENV_ROOT}=/mnt/gemini_dcp "
                "(Docker: --tmpfs /mnt/gemini_dcp:size=<N>g,huge=within_size)"))

    # 3. free space vs expected checkpoint
    try:
        st = os.statvfs(probe)
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        free = size = None
    if free is None:
        checks.append(Check("free space", "warn", f"cannot statvfs {probe}"))
    elif need is None:
        checks.append(Check("free space", "info", f"{_gb(free)} free of {_gb(size)}; pass --expected-gb to check it "
                            "against the checkpoint size"))
    elif free >= need:
        checks.append(Check("free space", "pass", f"{_gb(free)} free >= {_gb(need)} needed "
                            f"({expected_gb:g} GiB x {keep + 1} slots x {replicas} replicas)"))
    else:
        on_shm = str(probe.resolve()).startswith(str(Path(shm_path).resolve()))
        fix = shm_fix(need) if on_shm else (
            f"free space on {mnt[0] if mnt else probe}, or set {ENV_ROOT} to a tmpfs with {_gb(need)} free")
        checks.append(Check("free space", "fail", f"{_gb(free)} free < {_gb(need)} needed "
                            f"({expected_gb:g} GiB x {keep + 1} slots x {replicas} replicas)", fix))

    # 4. /dev/shm in a container
    where = in_container()
    try:
        st = os.statvfs(shm_path)
        shm_size = st.f_blocks * st.f_frsize
    except OSError:
        shm_size = None
    if shm_size is None:
        checks.append(Check("/dev/shm", "warn", f"{shm_path} is absent", shm_fix(need or GIB)))
    else:
        ctx = f"in a {where} container" if where else "not in a container"
        small = shm_size <= 64 << 20  # Docker's default of 64 MiB
        uses_shm = str(path).startswith(shm_path.rstrip("/") + "/") or str(path) == shm_path
        if need is not None and uses_shm and shm_size < need:
            checks.append(Check("/dev/shm", "fail", f"{shm_path} is {_gb(shm_size)} ({ctx}), < {_gb(need)} needed",
                                shm_fix(need)))
        elif small and uses_shm:
            checks.append(Check("/dev/shm", "fail", f"{shm_path} is only {shm_size >> 20} MiB ({ctx}; Docker's default)",
                                shm_fix(need or 8 * GIB)))
        else:
            checks.append(Check("/dev/shm", "pass", f"{shm_path} is {_gb(shm_size)} ({ctx})"))

    # 5. memory budget
    try:
        import psutil  # noqa: PLC0415

        vm = psutil.virtual_memory()
        detail = f"{_gb(vm.available)} available of {_gb(vm.total)}"
        if need is None:
            checks.append(Check("memory", "info", detail + "; pass --expected-gb to check the budget"))
        elif need > vm.available:
            checks.append(Check("memory", "fail", f"{detail} < {_gb(need)} the tier needs",
                                "lower keep or replicas, shard the checkpoint over more nodes, or use larger machines"))
        elif need > 0.5 * vm.total:
            checks.append(Check("memory", "warn", f"{detail}; the tier needs {_gb(need)}, over half of it, which "
                                "leaves little for the trainer and the dataloader", "lower keep (keep=1 needs 2 slots)"))
        else:
            checks.append(Check("memory", "pass", f"{detail}; the tier needs {_gb(need)}"))
    except ImportError:
        checks.append(Check("memory", "warn", "psutil is not installed", "pip install psutil"))

    # 6. GPUs
    checks.append(_gpu_check())

    # 7. versions
    checks.append(_torch_check())
    checks.append(_torchrec_check())
    checks.append(_ext_check(build_ext))
    checks.append(_nixl_check())
    return DoctorReport(root=str(path), checks=checks)


def _optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _field(obj: Any, *names: str) -> Any:
    for n in names:
        if isinstance(obj, dict) and n in obj:
            return obj[n]
        if hasattr(obj, n):
            return getattr(obj, n)
    return None


def _gpu_check() -> Check:
    mod = _optional("gemini_dcp.ops.gpuinfo")
    if mod is None or not hasattr(mod, "gpu_info"):
        return Check("GPUs", "warn", "gemini_dcp.ops.gpuinfo is not available in this build; GPU details skipped")
    try:
        gpus = list(mod.gpu_info())
    except Exception as exc:  # noqa: BLE001 - a driver problem is reported, not raised
        return Check("GPUs", "warn", f"GPU query failed: {type(exc).__name__}: {exc}")
    if not gpus:
        return Check("GPUs", "info", "no GPU visible through NVML (CPU-only host, no driver, or no nvidia-ml-py): "
                     "checkpoints travel over gloo from CPU memory")
    parts = []
    for g in gpus:
        name = _field(g, "name") or "GPU"
        mem = _field(g, "memory_total_bytes")
        mem_s = f", {_gb(mem)}" if isinstance(mem, (int, float)) else ""
        gen = _field(g, "pcie_gen_max", "pcie_gen")
        width = _field(g, "pcie_width_max", "pcie_width")
        gbps = _field(g, "pcie_link_gbps")
        pcie = f", PCIe gen{gen} x{width}" if gen and width else ""
        pcie += f" (~{gbps:g} GB/s per direction)" if isinstance(gbps, (int, float)) else ""
        parts.append(f"[{_field(g, 'index')}] {name}{mem_s}{pcie}")
    driver = _field(gpus[0], "driver_version")
    return Check("GPUs", "pass", f"{len(gpus)} GPU(s): " + "; ".join(parts) + (f"; driver {driver}" if driver else ""))


def _torch_check() -> Check:
    """torch against the supported range of the installed gemini-dcp's metadata (pyproject.toml's requirement)."""
    try:
        req = torch_requirement()
    except ConfigError as exc:
        return Check("torch", "warn", f"cannot read gemini-dcp's torch requirement: {exc}",
                     "reinstall gemini-dcp: pip install -e . in its source tree")
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return Check("torch", "fail", f"torch is not installed (gemini-dcp needs {req})", f"pip install '{req.pip_spec()}'")
    v = torch.__version__
    cuda = getattr(torch.version, "cuda", None)
    extra = f" (CUDA {cuda})" if cuda else " (CPU build)"
    if req.admits(v):
        return Check("torch", "pass", f"torch {v}{extra}, Python {sys.version.split()[0]}; supported: {req}")
    return Check("torch", "fail", f"torch {v}{extra} is outside the supported range {req} ({req.source})",
                 f"install a torch that satisfies it (pip install '{req.pip_spec()}'), or give gemini-dcp its own venv")


def _torchrec_check() -> Check:
    """Whether this torch has a known-good torchrec (scripts/install.sh's pairing), and the one installed.

    Read from distribution metadata only: importing torchrec loads fbgemm's native ops (seconds,
    and an OSError on a torch it was not built for)."""
    support = torchrec_support()
    tv = installed_torch_version()
    pairing = torchrec_pairing(tv) if tv else None
    try:
        have = importlib.metadata.version("torchrec")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if pairing is None:
        detail = (f"no known-good torchrec for torch {tv} (the torchrec tests skip); known-good pairings exist for torch {support} (scripts/install.sh)")
        if have:
            detail += f"; torchrec {have} is installed but untested here"
        return Check("torchrec", "info", detail)
    fbgemm, trec, _ = pairing
    if have is None:
        return Check("torchrec", "info", f"torchrec is not installed; torch {tv} pairs with torchrec {trec} + "
                     f"fbgemm-gpu-cpu {fbgemm} (pairings for torch {support})", "bash scripts/install.sh installs them")
    if have.split("+")[0] == trec:
        return Check("torchrec", "pass", f"torchrec {have}, the known-good pairing for torch {tv}")
    return Check("torchrec", "warn", f"torchrec {have} is installed; the known-good pairing for torch {tv} is torchrec "
                 f"{trec} + fbgemm-gpu-cpu {fbgemm}", f"pip install --no-deps torchrec=={trec} fbgemm-gpu-cpu=={fbgemm}")


def _ext_cached(mod: Any) -> bool | None:
    """Whether a build of the extension for this machine is already in its cache (None: cannot tell)."""
    loader = getattr(mod, "_LOADER", None)
    if loader is None or not hasattr(loader, "build_dir"):
        return None
    try:
        import torch  # noqa: PLC0415

        variants = [True, False] if torch.cuda.is_available() else [False]
        return any((loader.build_dir(cuda) / "BUILD_OK.json").is_file() for cuda in variants)
    except Exception:  # noqa: BLE001 - sources missing, unreadable cache: cannot tell
        return None


def _ext_info(mod: Any) -> dict[str, Any]:
    """The extension's own account of itself (its mode from ``gemini_dcp.options.ext``), {} if it has none."""
    try:
        info = mod.info()
    except Exception:  # noqa: BLE001 - an older or partial extension module: nothing to read
        return {}
    return info if isinstance(info, dict) else {}


def _ext_check(build: bool = False) -> Check:
    """The C++/CUDA extension: loaded / loadable from the cache; built only when ``build`` (it takes a while)."""
    mod = _optional("gemini_dcp.ext")
    if mod is None:
        return Check("extension", "warn", "gemini_dcp.ext is not in this build; pure-Python fallbacks are used "
                     "(crc32c via the crc32c package)")
    loader = getattr(mod, "_LOADER", None)
    already = bool(getattr(loader, "done", False))
    disabled = str(_ext_info(mod).get("mode") or "").strip().lower() in ("0", "off", "false", "no", "never")
    if not (already or build or disabled) and _ext_cached(mod) is False:
        cache = getattr(mod, "cache_root", lambda: "its cache")()
        return Check("extension", "warn", f"gemini_dcp.ext is not built on this machine yet (cache {cache}); the first "
                     "save that needs it builds it once (about 15 s on 2 cores)",
                     "gemini-dcp doctor --build-ext builds and checks it now")
    try:
        loaded = bool(mod.load())
    except Exception as exc:  # noqa: BLE001 - GEMINI_DCP_EXT=1 and the build failed, or similar
        return Check("extension", "fail" if build else "warn", f"gemini_dcp.ext failed to load: {type(exc).__name__}: {exc}",
                     "install a C++ compiler (g++), or set GEMINI_DCP_EXT=0 to use the fallbacks")
    status = mod.status() if callable(getattr(mod, "status", None)) else ""
    if loaded:
        return Check("extension", "pass", f"gemini_dcp.ext: {status}")
    return Check("extension", "warn", f"gemini_dcp.ext not loaded ({status}); pure-Python fallbacks are used")




_NIXL_INSTALL = "pip install --no-deps 'nixl-cu12>=1.5.1,<2' numpy (keeps your torch; docs/deploying.md)"


def _nixl_check() -> Check:
    """NIXL for ``peer_transport="nixl"``: installed?, its UCX transports, and what ``"auto"`` would pick.

    The agent is started in a child process (``python -m gemini_dcp.transport.nixl``), so a UCX
    failure cannot take doctor down; nothing is started where NIXL is not installed."""
    from ..transport.nixl import NIXL_MODULES  # noqa: PLC0415

    if not any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES):
        return Check("nixl", "info", "NIXL is not installed: peer_transport='auto' would pick gloo (the default)",
                     f"for peer traffic over RDMA / shared memory: {_NIXL_INSTALL}")
    try:
        run = subprocess.run([sys.executable, "-m", "gemini_dcp.transport.nixl"], capture_output=True, text=True,
                             timeout=120, check=False)
        info = json.loads(run.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError, OSError) as exc:
        return Check("nixl", "warn", f"NIXL is installed but its probe failed ({type(exc).__name__}); "
                     "peer_transport='auto' would pick gloo", "run python -m gemini_dcp.transport.nixl to see why")
    where = (f"{info['module']} {info['version'] or ''}; UCX transports shipped: {', '.join(info['ucx_modules'])}; "
             f"UCX_TLS={info['ucx_tls']}; UCX_NET_DEVICES={info['ucx_net_devices']}; RDMA devices: "
             f"{', '.join(info['rdma_devices']) or 'none'}")
    if info["auto"] != "nixl":
        return Check("nixl", "warn", f"{where}; the UCX backend does not start ({info['backend']}): "
                     "peer_transport='auto' would pick gloo", "set UCX_TLS to transports this host has (e.g. sm,tcp)")
    return Check("nixl", "pass", f"{where}; peer_transport='auto' would pick nixl")
