"""Benchmark of the gemini_dcp extension: CPU copy/CRC ops and, given a GPU, device-to-host paths.

    python benchmarks/bench_ext.py                         # CPU part (+ GPU part when CUDA is available)
    python benchmarks/bench_ext.py --cpu-mib 256 --gpu-mib 1024 --rounds 5 --out results.json

CPU (one buffer of --cpu-mib, destination already touched so no page faults are timed):
  torch ``dst.copy_(src)``; ``ext.copy_bytes``; ``ext.copy_with_crc32c`` (default threads
  and 1 thread); ``copy_`` then the ``crc32c`` package (the fallback); CRC alone, ext vs package.

GPU (one uint8 CUDA tensor of --gpu-mib), all in the same process and rounds:
  (a) pageable: ``src.to('cpu')`` (fresh allocation each time) and ``copy_`` into a touched
      pageable buffer; (b) pinned ``copy_(non_blocking=True)`` into ``pin_memory()`` — the
      baseline (one cudaMemcpyAsync); (c) ``ext.copy_d2h_chunked`` into a ``host_register``'ed
      MAP_SHARED mmap of a /dev/shm file (the memory tier's layout), at several chunk sizes;
      (c') the same target through the pure-torch fallback, and (c'') into the same mmap
      *unregistered*; ``ext.gpu_checksum`` throughput. Ratio (c)/(b) is the headline (target >= 0.8).

Each round runs the methods in a rotated order; figures are medians over rounds. Writes JSON to
--out (default benchmarks/results/ext-<cpu|gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemini_dcp import ext  # noqa: E402
from gemini_dcp.ops import gpuinfo  # noqa: E402

MiB = 1 << 20


def _timed(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> tuple[float, float]:
    if sync:
        sync()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - t0, time.process_time() - c0


def _run_rounds(methods: dict[str, Callable[[], Any]], nbytes: int, rounds: int, warmup: int = 1,
                sync: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    names = list(methods)
    for _ in range(warmup):
        for name in names:
            _timed(methods[name], sync)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            w, c = _timed(methods[name], sync)
            wall[name].append(w)
            cpu[name].append(c)
    out = {}
    for name in names:
        w = statistics.median(wall[name])
        c = statistics.median(cpu[name])
        out[name] = {
            "seconds": w,
            "gbps": nbytes / w / 1e9,
            "best_gbps": nbytes / min(wall[name]) / 1e9,
            "cpu_seconds": c,
            "gbps_per_cpu_second": nbytes / c / 1e9 if c > 0 else None,
        }
    return out


def bench_cpu(mib: int, rounds: int) -> dict[str, Any]:
    import crc32c as crc32c_pkg

    n = mib * MiB
    src = torch.arange(n // 8, dtype=torch.int64).mul_(0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF).view(torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8)
    dst.fill_(1)  # touch: page faults are not what is measured
    mv_src = memoryview(src.numpy())
    mv_dst = memoryview(dst.numpy())
    have = ext.load()

    def copy_then_pkg() -> None:
        dst.copy_(src)
        crc32c_pkg.crc32c(mv_dst)

    methods: dict[str, Callable[[], Any]] = {"torch_copy_": lambda: dst.copy_(src), "copy_then_pkg_crc32c": copy_then_pkg,
                                             "pkg_crc32c": lambda: crc32c_pkg.crc32c(mv_src)}
    if have:
        methods.update({
            "ext_copy_bytes": lambda: ext.copy_bytes(dst, src),
            "ext_copy_with_crc32c": lambda: ext.copy_with_crc32c(dst, src),
            "ext_copy_with_crc32c_1thread": lambda: ext.copy_with_crc32c(dst, src, num_threads=1),
            "ext_crc32c": lambda: ext.crc32c(src),
        })
        ops = torch.ops.gemini_dcp

        def with_path(path: str, fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                ops.crc32c_path("auto")
                ops.crc32c_path(path)
                try:
                    return fn()
                finally:
                    ops.crc32c_path("auto")
            return run

        # the x86 kernels side by side (test knob): one-pass PCLMUL copy+fold, copy
        # blocks then CRC with each CRC kernel; and the CRC kernels alone
        for path, label in (("pclmul", "onepass_pclmul"), ("blocks", "blocks_calibrated"), ("crc32", "blocks_crc32")):
            methods[f"ext_copy_with_crc32c_1thread_{label}"] = with_path(
                path, lambda: ext.copy_with_crc32c(dst, src, num_threads=1))
        methods["ext_crc32c_pclmul"] = with_path("pclmul", lambda: ext.crc32c(src))
        methods["ext_crc32c_crc32_3way"] = with_path("crc32", lambda: ext.crc32c(src))
        nt = torch.get_num_threads()
        if nt > 4:  # the default caps at 4 threads; show what all of torch's threads give
            methods[f"ext_copy_bytes_{nt}threads"] = lambda: ext.copy_bytes(dst, src, num_threads=nt)
            methods[f"ext_copy_with_crc32c_{nt}threads"] = lambda: ext.copy_with_crc32c(dst, src, num_threads=nt)
    res = _run_rounds(methods, n, rounds)
    if have:
        assert ext.copy_with_crc32c(dst, src) == crc32c_pkg.crc32c(mv_src)
    fused = res.get("ext_copy_with_crc32c", {}).get("gbps")
    ratios = {}
    if fused:
        ratios = {
            "fused_vs_copy_then_pkg": fused / res["copy_then_pkg_crc32c"]["gbps"],
            "fused_vs_torch_copy_": fused / res["torch_copy_"]["gbps"],
            "ext_crc_vs_pkg_crc": res["ext_crc32c"]["gbps"] / res["pkg_crc32c"]["gbps"],
            "ext_copy_bytes_vs_torch_copy_": res["ext_copy_bytes"]["gbps"] / res["torch_copy_"]["gbps"],
        }
    return {"bytes": n, "threads": torch.get_num_threads(), "methods": res, "ratios": ratios}


def _shm_tensor(n: int) -> tuple[torch.Tensor, Any, str]:
    d = "/dev/shm"
    if not (os.path.isdir(d) and os.access(d, os.W_OK) and os.statvfs(d).f_bavail * os.statvfs(d).f_frsize > 2 * n):
        d = tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="gemini_bench_ext_", dir=d)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(0)  # allocate the tmpfs pages now
    return t, mm, path


def bench_gpu(mib: int, rounds: int) -> dict[str, Any]:
    n = mib * MiB
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(0)
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    shm, mm, path = _shm_tensor(n)
    shm_unreg, mm2, path2 = _shm_tensor(n)
    t0 = time.perf_counter()
    ext.host_register(shm)
    register_s = time.perf_counter() - t0
    suggested = gpuinfo.suggest_chunk_bytes(torch.cuda.current_device())
    chunk_sizes = sorted({4 * MiB, 16 * MiB, 64 * MiB, suggested})

    def chunked(dst: torch.Tensor, chunk: int) -> Callable[[], Any]:
        return lambda: ext.copy_d2h_chunked(dst, src, chunk_bytes=chunk).synchronize()

    def fallback_chunked() -> None:
        saved = ext.loader.load  # the wrappers ask ext.loader.load(): patching it forces the fallbacks
        ext.loader.load = lambda verbose=False: False  # type: ignore[assignment]
        try:
            ext.copy_d2h_chunked(shm, src, chunk_bytes=64 * MiB).synchronize()  # noqa: F821 - called before the del below
        finally:
            ext.loader.load = saved  # type: ignore[assignment]

    methods: dict[str, Callable[[], Any]] = {
        "a_to_cpu": lambda: src.to("cpu"),
        "a_copy_pageable": lambda: pageable.copy_(src),
        "b_pinned_copy_nonblocking": lambda: pinned.copy_(src, non_blocking=True),
    }
    for c in chunk_sizes:
        methods[f"c_chunked_registered_shm_{c // MiB}MiB"] = chunked(shm, c)
    methods["c_fallback_registered_shm"] = fallback_chunked
    methods["c_chunked_unregistered_shm_64MiB"] = chunked(shm_unreg, 64 * MiB)
    res = _run_rounds(methods, n, rounds, sync=sync)

    # correctness of the headline path, on the same buffers
    ext.copy_d2h_chunked(shm, src, chunk_bytes=64 * MiB).synchronize()
    exact = bool(torch.equal(shm, src.cpu()))

    # gpu_checksum throughput (CUDA events) and agreement with the CPU reference
    ck = {}
    v = ext.gpu_checksum(src)
    times = []
    for _ in range(max(3, rounds)):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        ext.gpu_checksum(src)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    ck["gpu_checksum_gbps"] = n / statistics.median(times) / 1e9
    ref_n = min(n, 256 * MiB)
    t0 = time.perf_counter()
    ref = ext.xsum64_reference(src[:ref_n].cpu())
    ck["cpu_reference_gbps"] = ref_n / (time.perf_counter() - t0) / 1e9
    ck["matches_reference"] = bool(ext.gpu_checksum(src[:ref_n]) == ref)
    ck["value"] = hex(v)

    ext.host_unregister(shm)
    del shm, shm_unreg
    for m, p in ((mm, path), (mm2, path2)):
        try:
            m.close()
        except BufferError:
            pass
        Path(p).unlink(missing_ok=True)

    base = res["b_pinned_copy_nonblocking"]["gbps"]
    best_c = max((k for k in res if k.startswith("c_chunked_registered")), key=lambda k: res[k]["gbps"])
    c64 = res["c_chunked_registered_shm_64MiB"]["gbps"]
    return {
        "bytes": n,
        "device": torch.cuda.get_device_name(),
        "shm_dir": str(Path(path).parent),
        "host_register_seconds": register_s,
        "suggested_chunk_bytes": suggested,
        "methods": res,
        "bit_exact": exact,
        "checksum": ck,
        "ratios": {
            "c64_over_b": c64 / base,
            "best_c_over_b": res[best_c]["gbps"] / base,
            "best_c": best_c,
            "a_copy_pageable_over_b": res["a_copy_pageable"]["gbps"] / base,
            "a_to_cpu_over_b": res["a_to_cpu"]["gbps"] / base,
            "c_fallback_over_b": res["c_fallback_registered_shm"]["gbps"] / base,
            "c_unregistered_over_b": res["c_chunked_unregistered_shm_64MiB"]["gbps"] / base,
        },
    }


def _print(section: str, r: dict[str, Any]) -> None:
    print(f"\n== {section}: {r['bytes'] / MiB:.0f} MiB ==")
    print(f"{'method':48s} {'GB/s':>8s} {'best':>8s} {'GB/s/cpu-s':>11s}")
    for k, v in r["methods"].items():
        pc = v["gbps_per_cpu_second"]
        print(f"{k:48s} {v['gbps']:8.2f} {v['best_gbps']:8.2f} {pc if pc is None else round(pc, 2)!s:>11s}")
    for k, v in r.get("ratios", {}).items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-mib", type=int, default=256)
    ap.add_argument("--gpu-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    ext.load(verbose=True)
    load_s = time.perf_counter() - t0
    cuda = torch.cuda.is_available() and not args.no_gpu
    result: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "ext": ext.info(),
        "ext_load_seconds": load_s,
        "gpu_info": gpuinfo.gpu_info(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(f"ext: {ext.status()} (load {load_s:.1f} s)")
    if not args.no_cpu:
        result["cpu"] = bench_cpu(args.cpu_mib, args.rounds)
        _print("CPU", result["cpu"])
    if cuda:
        result["gpu"] = bench_gpu(args.gpu_mib, args.rounds)
        _print(f"GPU {result['gpu']['device']} -> host", result["gpu"])
        g = result["gpu"]
        print(f"  bit_exact={g['bit_exact']} host_register={g['host_register_seconds'] * 1e3:.1f} ms "
              f"suggested_chunk={g['suggested_chunk_bytes'] // MiB} MiB checksum={g['checksum']}")
    result["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    out = args.out or Path(__file__).resolve().parent / "results" / f"ext-{'gpu' if cuda else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
