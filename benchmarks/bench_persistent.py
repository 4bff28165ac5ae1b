"""Persistent tier benchmark: training-loop stall caused by background drains, and drain throughput
vs stock ``FsspecWriter`` writing the same state directly to the same store, in the same run.

    python benchmarks/bench_persistent.py                 # defaults: 256 MiB state, ~1 s steps, drain every 4th
    python benchmarks/bench_persistent.py --mib 512 --step-s 2 --store file:///mnt/ckpt

Stall: a simulated training loop (fixed CPU work per step on one thread, then a
per-step ``dcp.save`` into the memory tier, as GEMINI checkpoints every
iteration) runs with and without ``persistent=<store>, persist_every=K``;
baseline and drained passes are interleaved to cancel drift on a shared
machine. The stall is the relative increase of the mean step time.

Throughput: a warm drain of the state (request → ``.metadata`` committed)
vs ``dcp.save(state, storage_writer=FsspecWriter(url))`` of the same state to
the same store (which also blocks training for its whole duration).

Writes benchmarks/results/persistent.json and prints ratios.

Load (``--part load``): restoring the same state when every memory copy is gone, cold (the
files' pages dropped from the page cache) and warm, in one run: stock ``FileSystemReader`` on
a stock-written directory, ``GeminiStorageReader`` persistent-only on gemini's drained
directory (empty tier root), stock ``FileSystemReader`` on gemini's directory, and
``torch_checkpointing`` where it is importable (``--tc-path``). Passes are interleaved; every
load is checked bit-exact. Writes benchmarks/results/persistent-load.json.

    python benchmarks/bench_persistent.py --part load --load-mib 1024 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemini_dcp import GeminiStorageWriter  # noqa: E402
from gemini_dcp.local.tier import LocalTier  # noqa: E402
from gemini_dcp.persistent.drain import drain_status, wait_idle  # noqa: E402
from gemini_dcp.persistent.store import PersistentTier  # noqa: E402

GIB = float(1 << 30)


def make_state(mib: int, step: int) -> dict[str, Any]:
    """A model-like state: a few large tensors and many small ones (~``mib`` MiB)."""
    n_big = 8
    big = (mib << 20) * 15 // 16 // n_big // 4
    small = (mib << 20) // 16 // 256 // 4
    g = torch.Generator().manual_seed(step)
    sd: dict[str, Any] = {f"model.big{i}": torch.rand(big, generator=g) for i in range(n_big)}
    sd.update({f"model.small{i}": torch.rand(small, generator=g) for i in range(256)})
    sd["step"] = step
    return sd


def bump(sd: dict[str, Any], step: int) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            v.add_(1.0)
    sd["step"] = step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def calibrate(step_s: float, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    size = 4096 if device == "cuda" else 512
    a = torch.rand(size, size, device=device)
    b = torch.rand(size, size, device=device)
    for _ in range(5):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.5:
        for _ in range(10 if device == "cuda" else 1):
            a @ b
            n += 1
        _sync(device)
    per = (time.perf_counter() - t0) / n
    return a, b, max(1, int(step_s / per))


def train(
    sd: dict[str, Any], steps: range, mats: tuple[torch.Tensor, torch.Tensor, int], root: str, job: str,
    persistent: str | None, every: int, work: str, step_s: float, stock_async_dir: str | None = None,
    async_memory: bool = False,
) -> list[dict[str, float]]:
    """Training steps; each saves into the memory tier (with a drain every ``every`` when
    ``persistent``), or, with ``stock_async_dir``, the stock alternative: no memory tier and a
    ``dcp.async_save`` to disk every ``every`` steps (the previous one waited first, as torchtitan does)."""
    a, b, reps = mats
    out = []
    pending: Any = None
    ckpt: Any = None
    if async_memory and stock_async_dir is None:
        from gemini_dcp.snapshot import AsyncCheckpointer  # noqa: PLC0415

        kw0: dict[str, Any] = {"persistent": persistent, "persist_every": every, "persist_keep": 2} if persistent else {}
        ckpt = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id=job, **kw0), interleave=False)
    for step in steps:
        t0 = time.perf_counter()
        if work in ("cpu", "cuda"):
            for _ in range(reps):
                a @ b
            _sync(a.device.type)
        else:  # "gpu": the host thread waits for the device, as in cudaStreamSynchronize
            time.sleep(step_s)
        t1 = time.perf_counter()
        if ckpt is not None:
            ckpt.wait_copied()  # the optimizer-step guard: the last snapshot's bytes are in the tier
        bump(sd, step)
        if ckpt is not None:
            ckpt.save(sd, step)
        elif stock_async_dir is not None:
            if step % every == 0:
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(sd, checkpoint_id=os.path.join(stock_async_dir, f"step-{step % 3}"))
        else:
            kw: dict[str, Any] = {"persistent": persistent, "persist_every": every, "persist_keep": 2} if persistent else {}
            dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id=job, **kw), checkpoint_id=step)
        t2 = time.perf_counter()
        out.append({"step": step, "compute_s": t1 - t0, "save_s": t2 - t1, "total_s": t2 - t0})
    if pending is not None:
        pending.result()
    if ckpt is not None:
        ckpt.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB")
    ap.add_argument("--step-s", type=float, default=1.0, help="compute time of one training step")
    ap.add_argument("--every", type=int, default=4, help="persist_every")
    ap.add_argument("--steps", type=int, default=8, help="steps per pass")
    ap.add_argument("--passes", type=int, default=6, help="interleaved baseline/drain pass pairs (ABBA order)")
    ap.add_argument("--work", nargs="+", default=None, choices=["gpu", "cpu", "cuda"],
                    help="gpu: the step's host thread waits (device-bound training, simulated); cpu: one core "
                    "computes; cuda: real GPU matmuls with the state on the GPU (default: cuda if available, gpu, cpu)")
    ap.add_argument("--store", default=None, help="fsspec URL of the store (default: a temp dir on local disk)")
    ap.add_argument("--root", default=None, help="tier root (default: a temp dir in /dev/shm)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "persistent.json"))
    ap.add_argument("--async-memory", action="store_true",
                    help="the memory-tier saves through AsyncCheckpointer (the training path waits only for the "
                         "previous snapshot's copy before its optimizer step) instead of a blocking dcp.save")
    ap.add_argument("--part", choices=["save", "load"], default="save",
                    help="save: drain throughput and training stall (above); load: the persistent restore vs stock")
    ap.add_argument("--load-mib", type=int, default=1024, help="--part load: state size in MiB (12 x 64 MiB + 2 MiB tensors at 1024)")
    ap.add_argument("--reps", type=int, default=3, help="--part load: interleaved repetitions of every load")
    ap.add_argument("--drop-caches", action="store_true",
                    help="--part load: cold loads after writing 1 to /proc/sys/vm/drop_caches (default: fadvise the files read)")
    ap.add_argument("--tc-path", default=None, help="--part load: a directory holding the torch_checkpointing package")
    args = ap.parse_args()
    if args.part == "load":
        from bench_persistent_load import run_load_bench  # noqa: PLC0415 - the load part's own module

        run_load_bench(args)
        return
    torch.set_num_threads(1)  # the "GPU" training loop uses one core; the drain gets what is left
    if args.async_memory:
        import torch.distributed as dist  # noqa: PLC0415

        if not dist.is_initialized():  # AsyncCheckpointer's control group needs a (world-1) group
            import socket  # noqa: PLC0415

            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                port = sk.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    root = args.root or tempfile.mkdtemp(prefix="gemini-bench-", dir="/dev/shm")
    disk = None
    if args.store is None:
        disk = tempfile.mkdtemp(prefix="gemini-bench-store-", dir="/var/tmp")
        store = f"file://{disk}"
    else:
        store = args.store
    os.environ.setdefault("GEMINI_DCP_DRAIN_IDLE_S", "120")
    results: dict[str, Any] = {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "config": {"async_memory": args.async_memory, "mib": args.mib, "step_s": args.step_s, "nice": os.environ.get("GEMINI_DCP_DRAIN_NICE", "10"), "every": args.every, "steps": args.steps, "passes": args.passes,
                   "store": store, "root": root},
    }
    # time the part of a save the persistent tier adds to the training path (the drain request)
    import gemini_dcp.persistent.drain as drain_mod  # noqa: PLC0415

    request_s: list[float] = []
    orig_submit = drain_mod.Drainer.submit

    def timed_submit(self: Any, record: Any, rank: int) -> bool:
        t0 = time.perf_counter()
        try:
            return orig_submit(self, record, rank)
        finally:
            if self.due(record.step):
                request_s.append(time.perf_counter() - t0)

    drain_mod.Drainer.submit = timed_submit  # type: ignore[method-assign]
    results["machine"]["loadavg_start"] = os.getloadavg()
    try:
        sd = make_state(args.mib, 0)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
        mats = calibrate(args.step_s)
        if args.work is None:
            args.work = (["cuda"] if torch.cuda.is_available() else []) + ["gpu", "cpu"]
        results["config"]["work"] = args.work

        # ---- throughput: warm drain vs FsspecWriter, same state, same store ----------------------------
        job_t = "tput"
        pdir = LocalTier(root, job_t).layout.persist_dir
        pt = PersistentTier(store, job_t)
        # warm the drain process up (its first drain imports torch)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id=job_t, persistent=store, persist_every=1), checkpoint_id=1)
        assert wait_idle(pdir, 600) and pt.is_complete(1), drain_status(pdir)
        cold = time.perf_counter() - t0
        drains = []
        for step in (2, 3, 4):
            bump(sd, step)
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id=job_t, persistent=store, persist_every=1), checkpoint_id=step)
            blocked = time.perf_counter() - t0
            t_req = time.time()  # the drain request was written just before dcp.save returned
            assert wait_idle(pdir, 600) and pt.is_complete(step), drain_status(pdir)
            st = drain_status(pdir)["steps"][str(step)]
            # request -> .metadata committed, as timed by the drain process (no polling latency of this loop)
            drains.append({"blocked_s": blocked, "drain_s": st["committed_unix"] - t_req, "stage_s": st.get("stage_seconds"),
                           "write_s": st.get("write_seconds"), "upload_s": st.get("upload_seconds"), "files": st.get("files")})
        fsspec_runs = []
        from torch.distributed.checkpoint import FileSystemWriter  # noqa: PLC0415

        from gemini_dcp.core.compat import fsspec_writer_reader  # noqa: PLC0415

        FsspecWriter, _ = fsspec_writer_reader()  # public from torch 2.15 on

        for i in range(3):
            dest = f"{store.rstrip('/')}/fsspec-direct/run-{i}"
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=FsspecWriter(dest))
            fsspec_runs.append(time.perf_counter() - t0)
        fs_runs = []
        if store.startswith("file://"):
            for i in range(3):
                dest = store[len("file://"):] + f"/filesystem-direct/run-{i}"
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=FileSystemWriter(dest))
                fs_runs.append(time.perf_counter() - t0)
        drain_s = statistics.median(d["drain_s"] for d in drains)
        fsspec_s = statistics.median(fsspec_runs)
        results["throughput"] = {
            "state_bytes": nbytes,
            "drain_first_cold_s": cold,
            "drains": drains,
            "drain_GBps": nbytes / drain_s / 1e9,
            "drain_blocked_s_median": statistics.median(d["blocked_s"] for d in drains),
            "fsspec_writer_s": fsspec_runs,
            "fsspec_writer_GBps": nbytes / fsspec_s / 1e9,
            "filesystem_writer_s": fs_runs,
            "filesystem_writer_GBps": nbytes / statistics.median(fs_runs) / 1e9 if fs_runs else None,
            "drain_vs_fsspec_throughput": fsspec_s / drain_s,
            "training_blocked_fsspec_vs_gemini": fsspec_s / statistics.median(d["blocked_s"] for d in drains),
        }
        shutil.rmtree(LocalTier(root, job_t).layout.job_dir, ignore_errors=True)

        # ---- stall: interleaved baseline / drained passes ----------------------------------------------
        results["stall"] = {}
        step0 = 100
        for work in args.work:
            passes: dict[str, list[list[dict[str, float]]]] = {"baseline": [], "drain": [], "stock_async": []}
            if work == "cuda":  # the training state lives on the GPU; the memory tier copies it out
                wsd = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
                wmats = calibrate(args.step_s, "cuda")
            else:
                wsd, wmats = sd, mats
            for i in range(args.passes):
                modes = ["baseline", "drain"] + (["stock_async"] if disk and work != "cuda" else [])
                for mode in modes[i % len(modes):] + modes[: i % len(modes)]:  # rotating order: cancels drift
                    job = f"stall-{work}-{mode}"
                    url = store if mode == "drain" else None
                    sa_dir = os.path.join(disk, "stock-async", work) if mode == "stock_async" and disk else None
                    steps = range(step0, step0 + args.steps)
                    step0 += args.steps + 1
                    # one unmeasured warm-up step (slot files faulted in, drain process running)
                    train(wsd, range(steps.start - 1, steps.start), wmats, root, job, url, args.every, work, args.step_s, sa_dir,
                          args.async_memory)
                    wait_idle(LocalTier(root, job).layout.persist_dir, 600)
                    passes[mode].append(train(wsd, steps, wmats, root, job, url, args.every, work, args.step_s, sa_dir,
                                              args.async_memory))
                    wait_idle(LocalTier(root, job).layout.persist_dir, 600)

            def agg(mode: str, key: str, passes: dict[str, Any] = passes) -> float:
                return statistics.fmean(s[key] for run in passes[mode] for s in run)

            base, drained = agg("baseline", "total_s"), agg("drain", "total_s")
            pair = [
                statistics.fmean(x["total_s"] for x in d) / statistics.fmean(x["total_s"] for x in b) - 1
                for b, d in zip(passes["baseline"], passes["drain"])
            ]
            dstat = drain_status(LocalTier(root, f"stall-{work}-drain").layout.persist_dir)["steps"]
            uploads = [v["upload_seconds"] for v in dstat.values() if v.get("state") == "done" and v.get("upload_seconds")]
            results["stall"][work] = {
                "step_s_baseline": base,
                "step_s_with_drain": drained,
                "stall_fraction": (drained - base) / base,
                "stall_fraction_per_pass_pair": pair,
                "stall_fraction_median_of_pairs": statistics.median(pair),
                # the stock alternative: dcp.async_save to disk every K, no memory tier (issue 26's target: drain <= this)
                "step_s_stock_async": agg("stock_async", "total_s") if passes["stock_async"] else None,
                "drain_vs_stock_async": drained / agg("stock_async", "total_s") if passes["stock_async"] else None,
                "compute_s_baseline": agg("baseline", "compute_s"),
                "compute_s_with_drain": agg("drain", "compute_s"),
                "save_s_baseline": agg("baseline", "save_s"),
                "save_s_with_drain": agg("drain", "save_s"),
                "drain_upload_s_median": statistics.median(uploads) if uploads else None,
                "drains_done": sum(1 for v in dstat.values() if v.get("state") == "done"),
                "drains_abandoned": sum(1 for v in dstat.values() if v.get("state") == "abandoned"),
                "passes": passes,
            }
        results["drain_request"] = {
            "count": len(request_s),
            "median_ms": statistics.median(request_s) * 1e3 if request_s else None,
            "max_ms": max(request_s) * 1e3 if request_s else None,
        }
        results["machine"]["loadavg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if disk:
            shutil.rmtree(disk, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    t = results["throughput"]
    print(f"state {t['state_bytes'] / GIB:.3f} GiB -> {store}")
    print(f"drain (warm): {t['drain_GBps']:.3f} GB/s; FsspecWriter: {t['fsspec_writer_GBps']:.3f} GB/s; "
          f"ratio drain/FsspecWriter = {t['drain_vs_fsspec_throughput']:.2f}x"
          + (f"; FileSystemWriter {t['filesystem_writer_GBps']:.3f} GB/s" if t["filesystem_writer_GBps"] else ""))
    print(f"training blocked per checkpoint: FsspecWriter {statistics.median(t['fsspec_writer_s']):.3f} s vs "
          f"gemini save + drain request {t['drain_blocked_s_median'] * 1e3:.1f} ms "
          f"({t['training_blocked_fsspec_vs_gemini']:.0f}x less); first drain (cold drain process) {t['drain_first_cold_s']:.2f} s")
    for work, s in results["stall"].items():
        print(f"[{work} step] step time: baseline {s['step_s_baseline']:.4f} s, with a drain every {args.every} steps "
              f"{s['step_s_with_drain']:.4f} s -> stall {s['stall_fraction'] * 100:+.2f}% "
              f"(median of {len(s['stall_fraction_per_pass_pair'])} paired passes {s['stall_fraction_median_of_pairs'] * 100:+.2f}%; target <= 2%); "
              f"save call {s['save_s_baseline'] * 1e3:.1f} -> {s['save_s_with_drain'] * 1e3:.1f} ms; "
              f"drain upload {s['drain_upload_s_median']} s; drains done {s['drains_done']}, abandoned {s['drains_abandoned']}"
              + (f"; stock dcp.async_save every {args.every}: {s['step_s_stock_async']:.4f} s -> memory every step + drain "
                 f"÷ stock async = {s['drain_vs_stock_async']:.3f}x (target <= 1.0)" if s.get("step_s_stock_async") else ""))
    q = results["drain_request"]
    print(f"drain request in the training path: median {q['median_ms']:.2f} ms, max {q['max_ms']:.2f} ms over {q['count']} "
          f"(max includes starting the drain process); load average {results['machine']['loadavg_start'][0]:.2f} -> "
          f"{results['machine']['loadavg_end'][0]:.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
