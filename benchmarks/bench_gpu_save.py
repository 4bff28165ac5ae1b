"""GPU save path (issue 20): GPU -> tier throughput inside ``dcp.save``, and the restore onto the GPU.

    python benchmarks/bench_gpu_save.py                        # 4 GiB of DTensors on cuda:0, 5 rounds
    python benchmarks/bench_gpu_save.py --gib 2 --rounds 3 --json out.json --png out.png

One process (world 1, ``cpu:gloo,cuda:nccl``), a sharded model's state on the GPU: ``--big``
large float32 DTensors ``Shard(0)`` on a one-GPU ``DeviceMesh`` plus ``--small`` 1 MiB bf16
DTensors (``--gib`` in all). In the same process, rounds in rotating order (medians reported):

* ``pinned_d2h``  the baseline: ``copy_(non_blocking=True)`` of every local tensor into a
  preallocated ``pin_memory()`` buffer, then one synchronize — plain cudaMemcpyAsync D2H;
* ``gemini_save`` ``dcp.save`` + one ``GeminiStorageWriter`` reused across steps (steady state:
  its slots exist and are page-locked), whole call timed: DCP planning, the chunked D2H into the
  registered slot (``ext.copy_d2h_chunked``, the extension's low-priority stream), CRC of every
  piece while cache-warm, the record, the commit;
* ``gemini_save_no_count`` the same with ``nonfinite="ignore"`` (the non-finite count's cost is
  the difference); ``gemini_save_plan_cache`` with DCP's ``enable_plan_caching`` planner;
  ``gemini_async_save`` ``AsyncCheckpointer.save`` (the replayed save) until the step is in the tier;
* ``stock_save``  ``dcp.save`` + ``FileSystemWriter`` into a tmpfs directory (for comparison);
* ``pinned_h2d``  the restore baseline: pinned buffers -> the GPU tensors;
* ``gemini_load_auto`` ``dcp.load`` + ``GeminiStorageReader`` onto the GPU tensors, defaults (the
  slot mapping page-locked, the chunks verified on the GPU); ``gemini_load_cpu_verify`` verified
  on the CPU (``GEMINI_DCP_H2D_VERIFY=cpu``, the earlier default); ``gemini_load_gpu_verify_pageable``
  / ``_registered`` on the GPU with the mapping never / always page-locked; each load's
  registration and verification seconds are kept (``landing``);
* ``stock_load``  ``dcp.load`` + ``FileSystemReader`` of the stock directory.

Also the checksum question of the issue: GPU ``xsum64`` vs CPU crc32c of a just-copied (warm)
chunk, GB/s each. Every load is checked bit-exact. Headline ratio: ``gemini_save`` GB/s over
``pinned_d2h`` GB/s (target >= 0.8). Writes JSON (``--json``) and a plot (``--png``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import IMG, MIB, RESULTS, gbps, machine_info, write_json  # noqa: E402

DEV = "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if DEV == "cuda" else t


def versions() -> dict[str, Any]:
    if DEV != "cuda":
        return {"torch": torch.__version__, "device": "cpu (dry run)"}
    out: dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                           "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = q.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["nvidia_smi"] = None
    return out


def make_state(args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    small_bytes = args.small * MIB
    big_each = max(MIB, (int(args.gib * (1 << 30)) - small_bytes) // max(1, args.big))
    sd: dict[str, Any] = {}
    for i in range(args.big):
        t = torch.randn(big_each // 4 // 1024, 1024, device=DEV)
        sd[f"big.{i}"] = distribute_tensor(t, mesh, [Shard(0)])
    for i in range(args.small):
        t = torch.randn(512, 1024, device=DEV).to(torch.bfloat16)
        sd[f"small.{i}"] = distribute_tensor(t, mesh, [Shard(0)])
    sd["step"] = 0
    return sd


def locals_of(sd: dict[str, Any]) -> list[torch.Tensor]:
    return [v.to_local() if hasattr(v, "to_local") else v for v in sd.values() if hasattr(v, "to_local") or isinstance(v, torch.Tensor)]


def zeroed_like(sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False)
        else:
            out[k] = v
    return out


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(locals_of(a), locals_of(b)))


def checksum_costs(n: int, rounds: int) -> dict[str, Any]:
    """GPU xsum64 of an n-byte tensor vs CPU crc32c of the same bytes just copied to the host (warm)."""
    from gemini_dcp.core.checksum import checksum
    from gemini_dcp.ext import cuda as ext_cuda

    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    host = pin(torch.empty(n, dtype=torch.uint8))
    from gemini_dcp.ext import cpu as ext_cpu

    gpu, cpu, cpu4, both = [], [], [], []
    chunk = 16 * MIB
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        ext_cuda.gpu_checksum(src)
        gpu.append(time.perf_counter() - t0)
        host.copy_(src)
        t0 = time.perf_counter()
        checksum(host, "crc32c")  # whole buffer: over L2/L3, mostly from DRAM
        cpu.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ext_cpu.crc32c(host, 0, 4)  # split over 4 threads (what the device copier does per piece)
        cpu4.append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # the device copier's way: per 16 MiB piece right after it landed
        for off in range(0, n, chunk):
            host[off : off + chunk].copy_(src[off : off + chunk])
            ext_cpu.crc32c(host[off : off + chunk], 0, 4)
        both.append(time.perf_counter() - t0)
    return {
        "bytes": n,
        "gpu_xsum64_gbps": gbps(n, statistics.median(gpu)),
        "cpu_crc32c_gbps": gbps(n, statistics.median(cpu)),
        "cpu_crc32c_4_threads_gbps": gbps(n, statistics.median(cpu4)),
        "d2h_then_crc_4_threads_per_16MiB_piece_gbps": gbps(n, statistics.median(both)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--big", type=int, default=16, help="large float32 tensors")
    ap.add_argument("--small", type=int, default=128, help="1 MiB bf16 tensors")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", default=None, help="tmpfs directory for the tier and the stock files (default /dev/shm)")
    ap.add_argument("--skip-stock", action="store_true")
    ap.add_argument("--tag", default="h100")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the script's logic")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args(argv)
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu_save.py needs a CUDA device (or --device cpu for a dry run)")
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
    from gemini_dcp.save.device_copy import copy_path

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if DEV == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if DEV == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(DEV, (1,))
    base = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.root or "/dev/shm"))
    (base / "tier").mkdir(mode=0o700)
    try:
        sd = make_state(args, mesh)
        tensors = locals_of(sd)
        nbytes = sum(t.nbytes for t in tensors)
        pinned = [pin(torch.empty(t.shape, dtype=t.dtype)) for t in tensors]
        from gemini_dcp.save.device_copy import DeviceCopier

        writer = GeminiStorageWriter(root=str(base / "tier"), job_id="gpu", keep=1)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer, checkpoint_id=0)
        first_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer, checkpoint_id=1)  # the second slot of the ring (keep=1)
        second_save = time.perf_counter() - t0
        # the same save with the checksum on the CPU (crc32c of each landed piece over 4 threads)
        variants: dict[str, Any] = {}
        vw = GeminiStorageWriter(root=str(base / "tier"), job_id="gpu-4", keep=1)
        vw.local_writer.device_copier = DeviceCopier(checksum_on="cpu", crc_threads=4)
        variants["gemini_save_cpu_crc4"] = vw
        # without the non-finite count (nonfinite="ignore"): the count's cost is the difference
        variants["gemini_save_no_count"] = GeminiStorageWriter(root=str(base / "tier"), job_id="gpu-nc", keep=1,
                                                                nonfinite="ignore")
        # DCP's own plan cache (torch >= 2.7): planning off the per-save path
        variants["gemini_save_plan_cache"] = GeminiStorageWriter(root=str(base / "tier"), job_id="gpu-pc", keep=1)
        cached_planner = dcp.DefaultSavePlanner(enable_plan_caching=True)
        for name, vwr in variants.items():
            for i in range(2):
                dcp.save(sd, storage_writer=vwr, checkpoint_id=i,
                         planner=cached_planner if name == "gemini_save_plan_cache" else None)
        from gemini_dcp import AsyncCheckpointer

        ack = AsyncCheckpointer(GeminiStorageWriter(root=str(base / "tier"), job_id="gpu-async", keep=1))
        for i in range(2):
            ack.save(sd, step=i)
            ack.wait()
        step = [2]
        target = zeroed_like(sd)

        def pinned_d2h() -> None:
            for p, t in zip(pinned, tensors):
                p.copy_(t, non_blocking=True)
            sync()

        def pinned_h2d() -> None:
            for p, t in zip(pinned, locals_of(target)):
                t.copy_(p, non_blocking=True)
            sync()

        def gemini_save() -> None:
            dcp.save(sd, storage_writer=writer, checkpoint_id=step[0])
            step[0] += 1

        def variant_save(name: str) -> Any:
            def run() -> None:
                dcp.save(sd, storage_writer=variants[name], checkpoint_id=step[0],
                         planner=cached_planner if name == "gemini_save_plan_cache" else None)
                step[0] += 1
            return run

        def gemini_async() -> None:  # AsyncCheckpointer's replayed save, until the step is in the tier
            ack.save(sd, step=step[0])
            ack.wait()
            step[0] += 1

        def stock_save() -> None:
            d = base / "stock"
            shutil.rmtree(d, ignore_errors=True)
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d)))

        def gemini_load(mode: str, job: str = "gpu", verify: str = "auto") -> Any:
            key = f"{mode}_{verify}_{job}"

            def run() -> None:
                os.environ["GEMINI_DCP_H2D_REGISTER"] = mode
                os.environ["GEMINI_DCP_H2D_VERIFY"] = verify
                try:
                    r = GeminiStorageReader(root=str(base / "tier"), job_id=job)
                    dcp.load(target, storage_reader=r)
                    sync()
                    st = r._staging
                    extra.setdefault(key, []).append({
                        "bytes_registered": getattr(st.last_lander, "bytes_registered", None),
                        "bytes_to_device": getattr(st.last_lander, "bytes_to_device", None),
                        "bytes_on_device": getattr(st.last_lander, "bytes_on_device", None),
                        "register_failed": getattr(st.last_lander, "register_failed", None),
                        "register_s": st.register_seconds, "device_verified": st.device_verified,
                        "device_verify_s": st.device_verify_seconds,
                    })
                finally:
                    os.environ.pop("GEMINI_DCP_H2D_REGISTER", None)
                    os.environ.pop("GEMINI_DCP_H2D_VERIFY", None)
            return run

        def stock_load() -> None:
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(base / "stock")))
            sync()

        extra: dict[str, Any] = {}
        methods: dict[str, Any] = {"pinned_d2h": pinned_d2h, "gemini_save": gemini_save, "pinned_h2d": pinned_h2d,
                                   "gemini_load_auto": gemini_load("auto"),
                                   "gemini_load_cpu_verify": gemini_load("auto", verify="cpu"),
                                   "gemini_load_gpu_verify_pageable": gemini_load("0", verify="gpu"),
                                   "gemini_load_gpu_verify_registered": gemini_load("1", verify="gpu"),
                                   "gemini_save_cpu_crc4": variant_save("gemini_save_cpu_crc4"),
                                   "gemini_save_no_count": variant_save("gemini_save_no_count"),
                                   "gemini_save_plan_cache": variant_save("gemini_save_plan_cache"),
                                   "gemini_async_save": gemini_async,
                                   "gemini_load_auto_crc_items": gemini_load("auto", "gpu-4")}
        if not args.skip_stock:
            stock_save()
            methods.update(stock_save=stock_save, stock_load=stock_load)
        times: dict[str, list[float]] = {k: [] for k in methods}
        exact: dict[str, bool] = {}
        order = list(methods)
        for rnd in range(args.rounds):
            for name in order[rnd % len(order):] + order[: rnd % len(order)]:
                if "load" in name or name == "pinned_h2d":
                    for t in locals_of(target):
                        t.zero_()
                sync()
                t0 = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t0)
                if "load" in name:
                    exact[name] = exact.get(name, True) and equal(target, sd)
        res = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "gbps": gbps(nbytes, statistics.median(v))}
               for k, v in times.items()}
        dc = writer.local_writer.device_copier
        out = {
            "bench": "gpu_save", "tag": args.tag, "machine": machine_info(), "versions": versions(),
            "command": " ".join([sys.executable, *sys.argv]),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "bytes": nbytes, "items": len(tensors), "copy_path": copy_path(),
            "device_copier": {"bytes_copied": dc.bytes_copied, "chunks_copied": dc.chunks_copied, "seconds": dc.seconds,
                              "gbps_inside_copier": gbps(dc.bytes_copied, dc.seconds), "checksum_on": dc.checksum_on,
                              "item_algo": dc.item_algo("crc32c"),
                              "register_failed": dc.register_failed, "chunk_bytes": dc.chunk_bytes},
            "device_copier_variants": {k: {"gbps_inside_copier": gbps(v.local_writer.device_copier.bytes_copied,
                                                                       v.local_writer.device_copier.seconds)}
                                       for k, v in variants.items()},
            "async_stats": _jsonable(ack.stats()),
            "first_save_s": first_save, "second_save_s": second_save,
            "methods": res, "bit_exact": exact, "landing": extra,
            "checksum": checksum_costs(min(nbytes, 1 << 30), max(3, args.rounds)),
            "ratios": ratios(res),
        }
        ack.close()
        print(f"{nbytes / MIB:.0f} MiB in {len(tensors)} tensors on {out['versions']['device']}; copy path {out['copy_path']}")
        for k, v in res.items():
            print(f"  {k:26s} {v['median_s'] * 1e3:9.1f} ms  {v['gbps']:7.2f} GB/s  [{v['min_s'] * 1e3:.1f}, {v['max_s'] * 1e3:.1f}]")
        print(f"  first save {first_save:.3f} s, second {second_save:.3f} s; bit-exact {exact}")
        for k, v in out["ratios"].items():
            print(f"  {k}: {v:.3f}")
        print(f"  checksum: {out['checksum']}")
        print(f"  device copier: {out['device_copier']}; landing: {extra}")
        write_json(args.json or RESULTS / f"gpu-save-{args.tag}.json", out)
        plot(out, args.png or IMG / "bench_gpu_save.png")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        dist.destroy_process_group()


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def ratios(res: dict[str, Any]) -> dict[str, float]:
    """Every save method's GB/s over pinned D2H, every load's over pinned H2D, the non-finite count's
    share of a save, and gemini over stock where stock ran."""
    out: dict[str, float] = {}
    for k, v in res.items():
        if k.startswith("gemini_save") or k == "gemini_async_save":
            out[f"{k}_over_pinned_d2h"] = v["gbps"] / res["pinned_d2h"]["gbps"]
        elif k.startswith("gemini_load"):
            out[f"{k}_over_pinned_h2d"] = v["gbps"] / res["pinned_h2d"]["gbps"]
    if "gemini_save_no_count" in res:
        out["nonfinite_count_share_of_save"] = (res["gemini_save"]["median_s"] - res["gemini_save_no_count"]["median_s"]) \
            / res["gemini_save"]["median_s"]
    if "stock_save" in res:
        out["gemini_save_over_stock_save"] = res["stock_save"]["median_s"] / res["gemini_save"]["median_s"]
        out["stock_load_over_gemini_load_auto"] = res["stock_load"]["median_s"] / res["gemini_load_auto"]["median_s"]
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["methods"])
    vals = [out["methods"][k]["gbps"] for k in names]
    colors = ["#888" if k.startswith("pinned") else "#c55" if k.startswith("stock") else "#2a7" for k in names]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GB/s (median)")
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    r = out["ratios"]
    ax.set_title(f"{out['bytes'] / (1 << 30):.1f} GiB in {out['items']} DTensors, {out['versions']['device']}: "
                 f"save {r['gemini_save_over_pinned_d2h']:.2f}x pinned D2H, load "
                 f"{r['gemini_load_auto_over_pinned_h2d']:.2f}x pinned H2D", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
