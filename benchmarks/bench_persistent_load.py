"""The persistent-tier restore vs stock DCP: ``python benchmarks/bench_persistent.py --part load``.

When every memory copy is gone, gemini_dcp restores from its persistent tier. This measures,
in one process and one run, the same state (float32: 12 x 64 MiB + 2 MiB tensors at 1 GiB)
loaded into a preallocated state dict, each load checked bit-exact:

* ``stock``: ``dcp.load`` + ``FileSystemReader`` on a directory written by ``FileSystemWriter``;
* ``gemini``: ``dcp.load`` + ``GeminiStorageReader(persistent=...)`` on the drained step
  directory, from an empty tier root (nothing in memory: the persistent tier alone);
* ``stock_on_gemini``: ``FileSystemReader`` on gemini's drained directory (the layout is stock);
* ``torch_checkpointing`` (``--tc-path``, when importable): its own save/load of the same state.

Cold: every file of the directory read is dropped from the page cache first
(``posix_fadvise(DONTNEED)`` after an ``fsync``; ``--drop-caches`` writes 1 to
/proc/sys/vm/drop_caches instead). Warm: the same load right after another. Modes run
interleaved, ``--reps`` times each; the ratios (gemini / stock, same run) are what count on a
shared machine, reported with the load average. Writes benchmarks/results/persistent-load.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_pressure_total, loadavg, machine_info, pressure_during, write_json  # noqa: E402

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter  # noqa: E402
from gemini_dcp.local.tier import LocalTier  # noqa: E402
from gemini_dcp.persistent.drain import drain_status, wait_idle  # noqa: E402
from gemini_dcp.persistent.store import PersistentTier  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def load_state(mib: int, seed: int = 0) -> dict[str, Any]:
    """~``mib`` MiB of float32: 12 tensors of 64 MiB per GiB and the rest in 2 MiB ones."""
    g = torch.Generator().manual_seed(seed)
    total = mib << 20
    big = (total * 3 // 4) // 12
    n_small = max(1, (total - 12 * big) // (2 << 20))
    sd: dict[str, Any] = {f"big{i}": torch.rand(big // 4, generator=g) for i in range(12)}
    sd.update({f"small{i}": torch.rand((2 << 20) // 4, generator=g) for i in range(n_small)})
    sd["step"] = 1
    return sd


def blank_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items())


def zero(sd: dict[str, Any]) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            v.zero_()
        else:
            sd[k] = 0


def drop_cached(path: Path, use_drop_caches: bool) -> None:
    """Make the next read of every file under ``path`` come from the disk."""
    if use_drop_caches:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_load_bench(args: argparse.Namespace) -> None:
    """Entry point of ``bench_persistent.py --part load``."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    disk = Path(tempfile.mkdtemp(prefix="gemini-bench-pload-", dir="/var/tmp"))
    root = Path(tempfile.mkdtemp(prefix="gemini-bench-pload-", dir="/dev/shm"))
    empty_root = Path(tempfile.mkdtemp(prefix="gemini-bench-pload-empty-", dir="/dev/shm"))
    use_drop = bool(getattr(args, "drop_caches", False))
    os.environ.setdefault("GEMINI_DCP_DRAIN_IDLE_S", "30")
    results: dict[str, Any] = {"machine": machine_info(), "config": {
        "mib": args.load_mib, "reps": args.reps, "disk": str(disk), "cold": "drop_caches" if use_drop else "posix_fadvise(DONTNEED)",
        "torch_threads": torch.get_num_threads()}}
    t_wall, p0 = time.perf_counter(), cpu_pressure_total()
    try:
        sd = load_state(args.load_mib)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
        stock_dir = disk / "stock"
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(stock_dir)))
        store, job = f"file://{disk / 'store'}", "pload"
        dcp.save(sd, storage_writer=GeminiStorageWriter(root=str(root), job_id=job, persistent=store, persist_every=1), checkpoint_id=1)
        pdir = LocalTier(str(root), job).layout.persist_dir
        pt = PersistentTier(store, job)
        assert wait_idle(pdir, 600) and pt.is_complete(1), drain_status(pdir)
        gemini_dir = Path(pt.step_path(1))
        shutil.rmtree(root, ignore_errors=True)  # every memory copy gone

        dest = blank_like(sd)
        loaders: dict[str, tuple[Path, Callable[[], None]]] = {
            "stock": (stock_dir, lambda: dcp.load(dest, storage_reader=dcp.FileSystemReader(str(stock_dir)))),
            "gemini": (gemini_dir, lambda: dcp.load(dest, storage_reader=GeminiStorageReader(
                root=str(empty_root), job_id=job, persistent=store), checkpoint_id=1)),
            "stock_on_gemini": (gemini_dir, lambda: dcp.load(dest, storage_reader=dcp.FileSystemReader(str(gemini_dir)))),
        }
        tc = _torch_checkpointing(args, sd, disk / "tc", dest)
        results["torch_checkpointing"] = tc["status"]
        if tc.get("load") is not None:
            loaders["torch_checkpointing"] = (disk / "tc", tc["load"])
        times: dict[str, dict[str, list[float]]] = {m: {"cold": [], "warm": []} for m in loaders}
        order = list(loaders)
        for rep in range(args.reps):
            for mode in order if rep % 2 == 0 else order[::-1]:
                path, fn = loaders[mode]
                for kind in ("cold", "warm"):
                    zero(dest)
                    if kind == "cold":
                        drop_cached(path, use_drop)
                    t0 = time.perf_counter()
                    fn()
                    times[mode][kind].append(time.perf_counter() - t0)
                    assert same(dest, sd), f"{mode} {kind}: not bit-exact"
        med = {m: {k: statistics.median(v) for k, v in kinds.items()} for m, kinds in times.items()}
        results["state_bytes"] = nbytes
        results["seconds"] = times
        results["median_s"] = med
        results["ratio_vs_stock"] = {m: {k: med[m][k] / med["stock"][k] for k in ("cold", "warm")} for m in med}
    finally:
        for d in (disk, root, empty_root):
            shutil.rmtree(d, ignore_errors=True)
    wall = time.perf_counter() - t_wall
    results["machine"]["loadavg_end"] = loadavg()
    results["machine"]["cpu_pressure_during_pct"] = pressure_during(p0, wall)
    out = RESULTS / "persistent-load.json"
    write_json(out, results)
    print(f"state {nbytes / (1 << 30):.3f} GiB; load average {results['machine']['loadavg_1_5_15']} -> {results['machine']['loadavg_end']}; "
          f"cpu pressure {results['machine']['cpu_pressure_during_pct']}%")
    for m, r in results["ratio_vs_stock"].items():
        print(f"{m:20s} cold {med[m]['cold']:.3f} s ({r['cold']:.2f}x stock)   warm {med[m]['warm']:.3f} s ({r['warm']:.2f}x stock)")
    print(f"torch_checkpointing: {results['torch_checkpointing']}")
    print(f"wrote {out}")


def _torch_checkpointing(args: argparse.Namespace, sd: dict[str, Any], path: Path, dest: dict[str, Any]) -> dict[str, Any]:
    """``sd`` saved with torch_checkpointing's synchronous saver, and a loader into ``dest``, if importable.

    Its local-filesystem storage opens files with O_DIRECT by default, which fails on this
    disk at close (EINVAL); buffered I/O is used, as stock DCP does.
    """
    if args.tc_path:
        sys.path.insert(0, args.tc_path)
    try:
        import torch_checkpointing  # noqa: PLC0415 - optional baseline
        from torch_checkpointing import CheckpointManager  # noqa: PLC0415
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        return {"status": f"not importable: {type(exc).__name__}: {exc}"}
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    mgr = CheckpointManager(cfg)
    path.mkdir(parents=True, exist_ok=True)
    ckpt = str(path / "c1")
    mgr.save(ckpt, {"model": sd})

    def load() -> None:
        got = mgr.load(ckpt, into={"model": dest})["model"]
        for k, v in got.items():  # loaded in place into the templates; plain values come back
            if not isinstance(v, torch.Tensor):
                dest[k] = v

    return {"status": f"torch_checkpointing {torch_checkpointing.__version__} (sync saver, buffered I/O)", "load": load}
