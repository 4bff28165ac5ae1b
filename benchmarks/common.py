"""Shared pieces of the local-tier and peer-tier benchmarks.

* :func:`spawn` starts ``world`` fresh processes with a gloo process group on
  127.0.0.1 and one intra-op thread each (what ``torchrun`` does: it exports
  ``OMP_NUM_THREADS=1``), runs ``fn(rank, world, **kw)`` in each and returns
  their return values.
* :func:`shm_dir` makes a private scratch directory under ``/dev/shm`` that is
  removed on exit (also on Ctrl-C / SIGTERM).
* :func:`make_state` builds the benchmark state: a few large float32 DTensors
  sharded ``Shard(0)`` over all ranks plus a few small tensors and plain values.
* :func:`timed` times a collective operation barrier to barrier, so a figure
  is the wall time of the slowest rank; :func:`gbps` turns bytes and seconds
  into GB/s (1 GB = 10**9 bytes throughout).
* :func:`machine_info`, :func:`write_json`, :func:`bar_chart` for reporting.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
IMG = REPO / "docs" / "img"
GB = 1e9
GIB = 1 << 30
MIB = 1 << 20

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ---- numbers -------------------------------------------------------------------------------
def gbps(nbytes: float, seconds: float | None) -> float | None:
    if not seconds or seconds <= 0:
        return None
    return nbytes / seconds / GB


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs: Iterable[float]) -> list[float] | None:
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


# ---- scratch space in /dev/shm -------------------------------------------------------------
_SCRATCH: list[Path] = []


def _cleanup_scratch(*_: Any) -> None:
    while _SCRATCH:
        shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)


def _on_signal(signum: int, _frame: Any) -> None:
    _cleanup_scratch()
    raise SystemExit(128 + signum)


def shm_dir(prefix: str, base: str | os.PathLike[str] | None = None) -> Path:
    """A private directory under ``base`` (default /dev/shm, or $TMPDIR when absent), removed at interpreter exit."""
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    if not _SCRATCH:
        atexit.register(_cleanup_scratch)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal)
    _SCRATCH.append(path)
    return path


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path in _SCRATCH:
        _SCRATCH.remove(path)


def mount_options(path: str | os.PathLike[str]) -> str | None:
    """``fstype options`` of the mount that holds ``path`` (from /proc/mounts), or None."""
    from gemini_dcp.ops.doctor import mount_entry

    entry = mount_entry(Path(path))
    return None if entry is None else f"{entry[1]} {entry[2]}"


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def require_memory(need: int, what: str, tier_dir: str = "/dev/shm") -> None:
    """Refuse to start when the run would push the (shared) machine into the OOM killer."""
    have = mem_available()
    shm = shutil.disk_usage(tier_dir).free if os.path.isdir(tier_dir) else have
    if need > 0.9 * min(have, shm):
        raise SystemExit(
            f"{what} needs ~{need / GIB:.1f} GiB of memory at its peak but only {have / GIB:.1f} GiB "
            f"are available ({shm / GIB:.1f} GiB free in {tier_dir}): lower --gib or --keep."
        )


# ---- processes -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, threads: int, out_dir: str, kw: dict[str, Any]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            result = ("ok", fn(rank, world, **kw))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def spawn(fn: Callable[..., Any], world: int, *, threads: int = 1, timeout: float = 1800, **kw: Any) -> list[Any]:
    """Run ``fn(rank, world, **kw)`` in ``world`` fresh gloo ranks; returns their results by rank."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited before the children import torch
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(fn, world, free_port(), threads, out_dir, kw), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"benchmark ranks did not finish in {timeout:.0f}s")
        except BaseException:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise
        results = []
        for r in range(world):
            f = Path(out_dir, f"{r}.pkl")
            if not f.exists():
                raise RuntimeError(f"rank {r} exited without a result (killed? out of memory?)")
            status, value = pickle.loads(f.read_bytes())
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of a collective ``fn`` measured barrier to barrier (the slowest rank's time)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


# ---- the state -----------------------------------------------------------------------------
N_BIG = 4
N_SMALL = 8
SMALL_NUMEL = 64 << 10  # 256 KiB float32 each


def make_state(total_bytes: int, rank: int, world: int, seed: int = 0) -> dict[str, Any]:
    """~``total_bytes`` over all ranks: ``N_BIG`` float32 DTensors Shard(0) + small tensors + plain values.

    Each big tensor is (rows, 1024) float32 with rows divisible by ``world``;
    rank r creates only its own shard (``DTensor.from_local``), as FSDP2 does.
    Half the small tensors are sharded too, half are replicated plain tensors
    (DCP saves those once, from rank 0), and ``step``/``meta`` are bytes items.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    cols = 1024
    rows = max(world, total_bytes // N_BIG // (cols * 4) // world * world)
    local_rows = rows // world
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    sd: dict[str, Any] = {}
    for i in range(N_BIG):
        local = torch.empty(local_rows, cols, dtype=torch.float32)
        # cheap non-constant fill (torch.rand of 1 GiB costs seconds on one thread)
        local.view(-1)[: min(local.numel(), 1 << 20)].uniform_(generator=g)
        if local.numel() > (1 << 20):
            flat = local.view(-1)
            done = 1 << 20
            while done < flat.numel():
                n = min(done, flat.numel() - done)
                torch.add(flat[:n], float(i + 1 + done), out=flat[done : done + n])
                done += n
        sd[f"model.layer{i}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, cols)), stride=(cols, 1)
        )
    for i in range(N_SMALL):
        if i % 2 == 0:
            local = torch.empty(SMALL_NUMEL // world, dtype=torch.float32).uniform_(generator=g)
            sd[f"model.norm{i}.weight"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size((SMALL_NUMEL // world * world,)), stride=(1,)
            )
        else:
            sd[f"model.bias{i}"] = torch.full((SMALL_NUMEL,), float(i) + seed, dtype=torch.float32)
    sd["step"] = seed
    sd["meta"] = {"lr": 1e-4, "name": "bench"}
    return sd


def local_tensors(sd: dict[str, Any]) -> dict[str, Any]:
    import torch

    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to_local() if hasattr(v, "to_local") else v
    return out


def state_bytes(sd: dict[str, Any], rank: int) -> int:
    """Bytes this rank writes in a DCP save of ``sd`` (replicated plain tensors count on rank 0 only)."""
    total = 0
    for k, v in sd.items():
        if not hasattr(v, "numel"):
            continue
        is_dt = hasattr(v, "to_local")
        if not is_dt and rank != 0:
            continue
        t = v.to_local() if is_dt else v
        total += t.numel() * t.element_size()
    return total


def fingerprint(sd: dict[str, Any]) -> dict[str, int]:
    import xxhash

    out = {}
    for k, t in local_tensors(sd).items():
        out[k] = xxhash.xxh3_64_intdigest(memoryview(t.contiguous().view(-1).view(__import__("torch").uint8).numpy()))
    return out


def scramble(sd: dict[str, Any]) -> None:
    """Overwrite every local tensor in place (outside timings), so a load must really write the bytes."""
    for t in local_tensors(sd).values():
        t.fill_(-1.0)


# ---- phase timers (wrap attributes; nothing in gemini_dcp is modified) -----------------------
class PhaseClock:
    """Accumulates wall seconds per phase name while wrapped callables run, and each phase's
    span (first start, last end) in seconds after the last :meth:`reset` — a per-rank timeline
    (``time.perf_counter`` is CLOCK_MONOTONIC, so spans of ranks on one host line up)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.acc: dict[str, float] = {}
        self.spans: dict[str, list[float]] = {}
        self.t0 = time.perf_counter()

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None or not callable(fn):
            return
        clock = self

        def timed_call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                clock.acc[name] = clock.acc.get(name, 0.0) + t1 - t0
                span = clock.spans.setdefault(name, [t0 - clock.t0, t1 - clock.t0])
                span[1] = t1 - clock.t0

        setattr(obj, attr, timed_call)


# ---- reporting -----------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem / GIB, 1),
        "dev_shm_gib": round(shm / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_1_5_15": loadavg(),
        "cpu_pressure_some_avg60": cpu_pressure(),
    }


def cpu_pressure() -> float | None:
    """``some avg60`` of /proc/pressure/cpu: % of the last minute in which a runnable task waited for a core."""
    try:
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                return float(dict(kv.split("=") for kv in line.split()[1:])["avg60"])
    except (OSError, ValueError, KeyError):
        pass
    return None


def cpu_pressure_total() -> float | None:
    """``some total`` of /proc/pressure/cpu: cumulative µs in which a runnable task waited for a core."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in line.split()[1:])["total"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def pressure_during(total_before: float | None, wall_s: float) -> float | None:
    """% of the run's wall time in which some runnable task on the machine waited for a core."""
    after = cpu_pressure_total()
    if total_before is None or after is None or wall_s <= 0:
        return None
    return round((after - total_before) / 1e6 / wall_s * 100, 1)


def wait_quiet(max_s: float, threshold: float = 10.0) -> float | None:
    """Wait (up to ``max_s``) until CPU pressure ``some avg10`` drops below ``threshold`` %; returns it."""
    deadline = time.monotonic() + max_s
    while True:
        try:
            line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
            avg10 = float(dict(kv.split("=") for kv in line.split()[1:])["avg10"])
        except (OSError, ValueError, KeyError, IndexError):
            return None
        if avg10 < threshold or time.monotonic() >= deadline:
            return avg10
        time.sleep(5)


def loadavg() -> list[float] | None:
    """The machine is shared: the load average says how much else ran during a pass."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def bar_chart(
    path: Path,
    labels: list[str],
    values: list[float | None],
    *,
    title: str,
    ylabel: str = "GB/s",
    colors: list[str] | None = None,
    errors: list[list[float] | None] | None = None,
    hlines: list[tuple[float, str]] = (),
    annotate: list[str] | None = None,
) -> None:
    """A labelled bar chart (matplotlib, Agg backend); ``errors`` are [min, max] ranges per bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vals = [v or 0.0 for v in values]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.25 * len(labels) + 2), 4.6))
    x = list(range(len(labels)))
    bars = ax.bar(x, vals, color=colors or "#4C72B0", edgecolor="black", linewidth=0.5)
    if errors:
        lo = [max(0.0, v - e[0]) if e else 0.0 for v, e in zip(vals, errors)]
        hi = [max(0.0, e[1] - v) if e else 0.0 for v, e in zip(vals, errors)]
        ax.errorbar(x, vals, yerr=[lo, hi], fmt="none", ecolor="black", capsize=3, linewidth=0.8)
    for i, b in enumerate(bars):
        text = annotate[i] if annotate else f"{vals[i]:.2f}"
        top = max(vals[i], errors[i][1]) if errors and errors[i] else vals[i]
        ax.annotate(text, (b.get_x() + b.get_width() / 2, top), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    for y, name in hlines:
        ax.axhline(y, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(name, (-0.5, y), xytext=(2, 2), textcoords="offset points", ha="left", fontsize=7, color="gray")
    ax.set_ylim(0, max([v for v in vals] + [e[1] for e in (errors or []) if e] + [y for y, _ in hlines]) * 1.15)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
