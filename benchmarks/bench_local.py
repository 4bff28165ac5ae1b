"""Local-tier benchmark (issue 2): gemini_dcp vs stock DCP FileSystemWriter/Reader on /dev/shm.

    python benchmarks/bench_local.py                # 2 GiB over 2 ranks, 7 rounds (~2 min here)
    python benchmarks/bench_local.py --gib 4 --rounds 7
    python benchmarks/bench_local.py --quick        # 64 MiB smoke run (no files written unless --json/--png)

Two gloo ranks (spawned processes, one intra-op thread each, as torchrun
runs them) share one tier root, i.e. one node. The state is ``--gib`` GiB in
total: four large float32 DTensors ``Shard(0)`` over the ranks plus a few
small sharded / replicated tensors and plain values. In the same processes,
in a rotating order per round (the machine is shared, so figures drift
between passes; rotating cancels most of that), it measures:

* ``stock_save``   ``dcp.save`` + ``FileSystemWriter`` into a new step
  directory under /dev/shm each time (the oldest beyond ``--keep`` is deleted
  outside the timing, as a retention policy would);
* ``gemini_save``  ``dcp.save`` + one ``GeminiStorageWriter`` reused across
  steps (steady state: after its ``keep + 1`` slots exist; the first save and
  the slot warm-up saves are reported separately);
* ``stock_load``   ``dcp.load`` + ``FileSystemReader`` of the newest stock step;
* ``gemini_load``  ``dcp.load`` + a new ``GeminiStorageReader`` (latest step);
* raw baselines of the same bytes on the same ranks: ``copy_`` into
  already-touched memory, ``copy_`` into freshly allocated memory, and a
  ``write()`` of each tensor into a new /dev/shm file.

Loads go into the live state (its tensors are overwritten with -1 before
each load, outside the timing) and are checked bit-exact afterwards.
Every figure is a barrier-to-barrier wall time (the slowest rank) of all
ranks' bytes; GB/s uses 1 GB = 10**9 bytes; the median over rounds is reported
with its [min, max]. Gemini saves and loads are also split into phases
(planning and DCP collectives, copy+checksum, gemini collectives, record
write; metadata decision, mmap + verify + copy) to show where time goes.

Writes benchmarks/results/local.json and docs/img/bench_local.png (full runs).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import GIB, fmt, gbps, median, spread  # noqa: E402

SAVE_TARGET = 5.0
# What GeminiStorageWriter's default checksum="auto" resolves to on this machine (crc32c with the extension).
from gemini_dcp.core.checksum import resolve_algo  # noqa: E402

DEFAULT_ALGO = resolve_algo("auto")
LOAD_TARGET = 3.0
# rotation units: "gemini" / "gemini_crc32c" each time a save and then a load of that step
UNITS = ("stock_save", "gemini", "stock_load", "gemini_crc32c", "copy_touched", "copy_fresh", "shm_new_file", "xxh3_only")
OPS = ("stock_save", "gemini_save", "stock_load", "gemini_load", "gemini_save_crc32c", "gemini_load_crc32c",
       "copy_touched", "copy_fresh", "shm_new_file", "xxh3_only")
RAW_OPS = ("copy_touched", "copy_fresh", "shm_new_file", "xxh3_only")
ALGO_SUFFIX = {"xxh3": "", "crc32c": "_crc32c"}


def instrument_writer(writer: Any, clock: common.PhaseClock) -> None:
    import gemini_dcp.dcp.writer as wmod

    clock.wrap(writer, "write_data", "write_data")
    clock.wrap(writer, "_write_local", "copy_checksum")
    clock.wrap(writer.commit, "commit_on_node", "record_write")
    clock.wrap(writer, "prepare_local_plan", "space_check")
    clock.wrap(writer, "finish", "finish")
    # the gemini collectives inside write_data: all_gather / broadcast over the control group
    orig = getattr(wmod, "get_comm", None)
    if orig is not None and not getattr(orig, "_bench_wrapped", False):
        def get_comm(*a: Any, **k: Any) -> Any:
            comm = orig(*a, **k)
            clock.wrap(comm, "all_gather_object", "gemini_collectives")
            clock.wrap(comm, "broadcast_object", "gemini_collectives")
            return comm

        get_comm._bench_wrapped = True  # type: ignore[attr-defined]
        wmod.get_comm = get_comm


def instrument_reader(reader: Any, clock: common.PhaseClock) -> None:
    clock.wrap(reader, "read_metadata", "read_metadata")
    clock.wrap(reader, "prepare_global_plan", "global_plan")
    clock.wrap(reader, "read_data", "read_data")
    clock.wrap(reader, "_read_all", "read_local")
    clock.wrap(reader, "_local_bytes", "mmap_slots")
    clock.wrap(reader, "_stage", "verify_copy")  # checksum of the stored bytes (before any copy)
    clock.wrap(reader._staging, "land", "verify_copy")  # the copy into the live tensors, once every rank verified


# ---- the per-rank body ------------------------------------------------------------------------
def worker(rank: int, world: int, *, total_bytes: int, rounds: int, keep: int, scratch: str, stock_threads: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import xxhash
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    timed = common.timed
    sd = common.make_state(total_bytes, rank, world)
    mine = common.state_bytes(sd, rank)
    counts = torch.tensor([mine], dtype=torch.int64)
    dist.all_reduce(counts)
    nbytes = int(counts.item())
    expect = common.fingerprint(sd)
    big = [t for k, t in common.local_tensors(sd).items() if "layer" in k]

    root = Path(scratch, "gemini")
    stock_base = Path(scratch, "stock")
    raw_dir = Path(scratch, f"raw-{rank}")
    if rank == 0:
        root.mkdir(mode=0o700, exist_ok=True)
        stock_base.mkdir(mode=0o700, exist_ok=True)
    raw_dir.mkdir(mode=0o700, exist_ok=True)
    dist.barrier()

    res: dict[str, Any] = {"bytes": nbytes, "rank_bytes": mine, "ops": {op: [] for op in OPS}}
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in OPS if k.startswith("gemini")}
    clock = common.PhaseClock()

    # ---- gemini: one writer per checksum algorithm, each reused for every step, both in one job
    # (so they share the ring of keep+1 slots per rank: no extra memory); the first keep+1 saves
    # create and fault the slots, and the crc32c writer's first saves map them.
    writers = {algo: GeminiStorageWriter(root=root, job_id="bench", keep=keep, checksum=algo) for algo in ALGO_SUFFIX}
    for w in writers.values():
        instrument_writer(w, clock)
    step = 0

    def gemini_save(algo: str) -> None:
        nonlocal step
        clock.reset()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writers[algo], checkpoint_id=step)
        clock.acc["dcp_save_total"] = time.perf_counter() - t0
        step += 1

    warm: list[float] = []
    for _ in range(keep + 1):
        warm.append(timed(lambda: gemini_save("xxh3")))
    res["gemini_first_save_s"] = warm[0]
    res["gemini_warmup_saves_s"] = warm
    res["gemini_crc32c_warmup_saves_s"] = [timed(lambda: gemini_save("crc32c")) for _ in range(keep + 1)]

    # ---- stock: a new directory per save, the oldest beyond keep removed outside the timing ----
    stock_steps: list[Path] = []
    stock_step = [0]

    def stock_save() -> None:
        d = stock_base / f"step-{stock_step[0]:06d}"
        dcp.save(sd, storage_writer=FileSystemWriter(d, thread_count=stock_threads))
        stock_steps.append(d)
        stock_step[0] += 1

    def stock_retain() -> None:
        if rank == 0:
            while len(stock_steps) > keep:
                shutil.rmtree(stock_steps.pop(0), ignore_errors=True)
        else:
            while len(stock_steps) > keep:
                stock_steps.pop(0)
        dist.barrier()

    res["stock_first_save_s"] = timed(stock_save)
    stock_retain()

    def stock_load() -> None:
        dcp.load(sd, storage_reader=FileSystemReader(stock_steps[-1]))

    last_reader: list[Any] = []

    def gemini_load() -> None:
        clock.reset()
        reader = GeminiStorageReader(root=root, job_id="bench")
        instrument_reader(reader, clock)
        t0 = time.perf_counter()
        dcp.load(sd, storage_reader=reader)  # the latest step: the one just saved
        clock.acc["dcp_load_total"] = time.perf_counter() - t0
        last_reader[:] = [reader]

    # one destination per distinct shape, reused: touched memory (the tensors are far larger than the caches)
    dst_by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    for t in big:
        dst_by_shape.setdefault(tuple(t.shape), torch.empty_like(t)).copy_(t)
    dst_touched = [dst_by_shape[tuple(t.shape)] for t in big]
    big_bytes = sum(t.numel() * t.element_size() for t in big)
    bb = torch.tensor([big_bytes], dtype=torch.int64)
    dist.all_reduce(bb)
    big_total = int(bb.item())

    def copy_touched() -> None:
        for d, t in zip(dst_touched, big):
            d.copy_(t)

    fresh: list[torch.Tensor] = []

    def copy_fresh() -> None:
        for t in big:
            d = torch.empty_like(t)
            d.copy_(t)
            fresh.append(d)

    def shm_new_file() -> None:
        for i, t in enumerate(big):
            with open(raw_dir / f"t{i}.bin", "wb") as f:
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))

    def xxh3_only() -> None:
        for t in big:
            xxhash.xxh3_64_intdigest(memoryview(t.view(-1).view(torch.uint8).numpy()))

    verify_fail: list[str] = []

    def check(what: str) -> None:
        got = common.fingerprint(sd)
        if got != expect:
            bad = sorted(k for k in expect if got.get(k) != expect[k])
            verify_fail.append(f"{what}: {bad}")

    for r in range(rounds):
        order = UNITS[r % len(UNITS):] + UNITS[: r % len(UNITS)]
        for op in order:
            if op == "stock_save":
                res["ops"][op].append(timed(stock_save))
                stock_retain()
            elif op == "stock_load":
                common.scramble(sd)
                res["ops"][op].append(timed(stock_load))
                check(op)
            elif op in ("gemini", "gemini_crc32c"):
                algo = "xxh3" if op == "gemini" else "crc32c"
                sfx = ALGO_SUFFIX[algo]
                res["ops"]["gemini_save" + sfx].append(timed(lambda: gemini_save(algo)))
                phases["gemini_save" + sfx].append(dict(clock.acc))
                common.scramble(sd)
                res["ops"]["gemini_load" + sfx].append(timed(gemini_load))
                phases["gemini_load" + sfx].append(dict(clock.acc))
                rd = last_reader[0]
                res.setdefault("gemini_restored_from", dict(rd.restored_from))
                check("gemini_load" + sfx)
            elif op == "copy_touched":
                res["ops"][op].append(timed(copy_touched))
            elif op == "copy_fresh":
                res["ops"][op].append(timed(copy_fresh))
                fresh.clear()
            elif op == "shm_new_file":
                res["ops"][op].append(timed(shm_new_file))
                for p in raw_dir.iterdir():
                    p.unlink()
            elif op == "xxh3_only":
                res["ops"][op].append(timed(xxh3_only))
    res["phases"] = phases
    res["verify_failures"] = verify_fail
    res["raw_bytes"] = big_total
    from gemini_dcp import ext

    res["ext_status"] = ext.status()
    dist.barrier()
    return res


# ---- driver -------------------------------------------------------------------------------------
def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    r0 = results[0]
    nbytes = r0["bytes"]
    raw_bytes = r0["raw_bytes"]
    figs: dict[str, Any] = {}
    for op in OPS:
        secs = r0["ops"][op]
        b = raw_bytes if op in RAW_OPS else nbytes
        rates = [gbps(b, s) for s in secs]
        figs[op] = {
            "bytes": b,
            "seconds": secs,
            "median_s": median(secs),
            "gbps": median(rates),
            "gbps_range": spread(rates),
        }
    save_ratio = figs["stock_save"]["median_s"] / figs["gemini_save"]["median_s"]
    load_ratio = figs["stock_load"]["median_s"] / figs["gemini_load"]["median_s"]
    crc_save_ratio = figs["stock_save"]["median_s"] / figs["gemini_save_crc32c"]["median_s"]
    crc_load_ratio = figs["stock_load"]["median_s"] / figs["gemini_load_crc32c"]["median_s"]
    # the same ratios paired within each round (adjacent in time), then the median: less exposed to drift
    ops0 = r0["ops"]
    save_pairs = [a / b for a, b in zip(ops0["stock_save"], ops0["gemini_save"])]
    load_pairs = [a / b for a, b in zip(ops0["stock_load"], ops0["gemini_load"])]
    crc_save_pairs = [a / b for a, b in zip(ops0["stock_save"], ops0["gemini_save_crc32c"])]
    crc_load_pairs = [a / b for a, b in zip(ops0["stock_load"], ops0["gemini_load_crc32c"])]

    def phase_medians(kind: str) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        for rank, res in enumerate(results):
            rows = res["phases"][kind]
            keys = sorted({k for row in rows for k in row})
            out[f"rank{rank}"] = {k: median(row.get(k, 0.0) for row in rows) for k in keys}
        return out

    return {
        "benchmark": "local",
        "machine": common.machine_info(),
        "config": {
            "gib": args.gib, "ranks": 2, "threads_per_rank": 1, "rounds": args.rounds, "keep": args.keep,
            "stock_thread_count": args.stock_threads, "state": "4 float32 DTensor Shard(0) (rows x 1024) + 4 small "
            "sharded + 4 small replicated tensors + 2 plain values", "gb": "1e9 bytes",
            "tier_dir": args.shm, "tier_mount": common.mount_options(args.shm),
        },
        "state_bytes": nbytes,
        "figures": figs,
        "gemini_first_save_s": r0["gemini_first_save_s"],
        "gemini_first_save_gbps": gbps(nbytes, r0["gemini_first_save_s"]),
        "gemini_warmup_saves_s": r0["gemini_warmup_saves_s"],
        "gemini_crc32c_warmup_saves_s": r0["gemini_crc32c_warmup_saves_s"],
        "stock_first_save_s": r0["stock_first_save_s"],
        "ext_status": r0.get("ext_status"),
        "ratios": {
            "save_vs_filesystemwriter": save_ratio,
            "load_vs_filesystemreader": load_ratio,
            "save_target": SAVE_TARGET,
            "load_target": LOAD_TARGET,
            "save_target_met": save_ratio >= SAVE_TARGET,
            "load_target_met": load_ratio >= LOAD_TARGET,
            "save_per_round": save_pairs,
            "load_per_round": load_pairs,
            "save_per_round_median": median(save_pairs),
            "load_per_round_median": median(load_pairs),
            "copy_touched_vs_stock_save": figs["copy_touched"]["gbps"] / figs["stock_save"]["gbps"],
            "copy_touched_vs_stock_load": figs["copy_touched"]["gbps"] / figs["stock_load"]["gbps"],
            "gemini_save_vs_copy_touched": figs["gemini_save"]["gbps"] / figs["copy_touched"]["gbps"],
            "gemini_load_vs_copy_touched": figs["gemini_load"]["gbps"] / figs["copy_touched"]["gbps"],
            "default_checksum": DEFAULT_ALGO,
            "default": {
                "checksum": DEFAULT_ALGO,
                "save_vs_filesystemwriter": crc_save_ratio if DEFAULT_ALGO == "crc32c" else save_ratio,
                "load_vs_filesystemreader": crc_load_ratio if DEFAULT_ALGO == "crc32c" else load_ratio,
                "save_target_met": (crc_save_ratio if DEFAULT_ALGO == "crc32c" else save_ratio) >= SAVE_TARGET,
                "load_target_met": (crc_load_ratio if DEFAULT_ALGO == "crc32c" else load_ratio) >= LOAD_TARGET,
            },
            "crc32c": {
                "save_vs_filesystemwriter": crc_save_ratio,
                "load_vs_filesystemreader": crc_load_ratio,
                "save_per_round_median": median(crc_save_pairs),
                "load_per_round_median": median(crc_load_pairs),
                "save_target_met": crc_save_ratio >= SAVE_TARGET,
                "load_target_met": crc_load_ratio >= LOAD_TARGET,
                "save_vs_copy_touched": figs["gemini_save_crc32c"]["gbps"] / figs["copy_touched"]["gbps"],
                "load_vs_copy_touched": figs["gemini_load_crc32c"]["gbps"] / figs["copy_touched"]["gbps"],
            },
        },
        "gemini_save_phases_s": phase_medians("gemini_save"),
        "gemini_load_phases_s": phase_medians("gemini_load"),
        "gemini_save_crc32c_phases_s": phase_medians("gemini_save_crc32c"),
        "gemini_load_crc32c_phases_s": phase_medians("gemini_load_crc32c"),
        "gemini_restored_from": r0.get("gemini_restored_from"),
        "verify_failures": [f for res in results for f in res["verify_failures"]],
    }


def report(s: dict[str, Any]) -> None:
    f = s["figures"]
    print(f"\nstate: {s['state_bytes'] / GIB:.3f} GiB over 2 ranks (1 thread each); {s['config']['rounds']} rounds; "
          f"medians [min-max] in GB/s (1 GB = 1e9 B)")
    names = {
        "stock_save": "dcp.save FileSystemWriter -> /dev/shm",
        "gemini_save": "dcp.save GeminiStorageWriter checksum=xxh3",
        "gemini_save_crc32c": "dcp.save GeminiStorageWriter checksum=crc32c",
        "stock_load": "dcp.load FileSystemReader <- /dev/shm",
        "gemini_load": "dcp.load GeminiStorageReader (xxh3 step)",
        "gemini_load_crc32c": "dcp.load GeminiStorageReader (crc32c step)",
        "copy_touched": "raw copy_ into touched memory",
        "copy_fresh": "raw copy_ into fresh memory",
        "shm_new_file": "raw write() into new /dev/shm file",
        "xxh3_only": "raw xxh3 of the same bytes",
    }
    for op, name in names.items():
        x = f[op]
        rng = x["gbps_range"] or [None, None]
        print(f"  {name:42s} {fmt(x['gbps']):>6s} GB/s  [{fmt(rng[0])}-{fmt(rng[1])}]  median {fmt(x['median_s'], '.3f')} s")
    print(f"  gemini first save: {s['gemini_first_save_s']:.3f} s ({fmt(s['gemini_first_save_gbps'])} GB/s); "
          f"warm-up saves {', '.join(f'{x:.3f}' for x in s['gemini_warmup_saves_s'])} s")
    r = s["ratios"]
    print(f"  save ratio gemini/stock: {r['save_vs_filesystemwriter']:.2f}x (target >= {SAVE_TARGET}x: "
          f"{'met' if r['save_target_met'] else 'MISSED'}); paired per round: median {fmt(r['save_per_round_median'])}x "
          f"[{', '.join(f'{x:.2f}' for x in r['save_per_round'])}]")
    print(f"  load ratio gemini/stock: {r['load_vs_filesystemreader']:.2f}x (target >= {LOAD_TARGET}x: "
          f"{'met' if r['load_target_met'] else 'MISSED'}); paired per round: median {fmt(r['load_per_round_median'])}x "
          f"[{', '.join(f'{x:.2f}' for x in r['load_per_round'])}]")
    c = r["crc32c"]
    print(f"  with checksum='crc32c' ({s.get('ext_status')}): save {c['save_vs_filesystemwriter']:.2f}x "
          f"(paired {fmt(c['save_per_round_median'])}x), load {c['load_vs_filesystemreader']:.2f}x "
          f"(paired {fmt(c['load_per_round_median'])}x)")
    d = r["default"]
    print(f"  DEFAULT writer (checksum='auto' -> {d['checksum']}): save {d['save_vs_filesystemwriter']:.2f}x "
          f"(target >= {SAVE_TARGET}x: {'met' if d['save_target_met'] else 'MISSED'}), load "
          f"{d['load_vs_filesystemreader']:.2f}x (target >= {LOAD_TARGET}x: {'met' if d['load_target_met'] else 'MISSED'})")
    print(f"  ceiling set by raw copy_ into touched memory: {r['copy_touched_vs_stock_save']:.2f}x the stock save, "
          f"{r['copy_touched_vs_stock_load']:.2f}x the stock load")
    for kind in ("gemini_save_phases_s", "gemini_load_phases_s", "gemini_save_crc32c_phases_s", "gemini_load_crc32c_phases_s"):
        print(f"  {kind} (median s per rank):")
        for rank, ph in s[kind].items():
            print("    " + rank + ": " + ", ".join(f"{k}={v:.3f}" for k, v in ph.items() if v is not None))
    if s["verify_failures"]:
        print("  VERIFY FAILURES:", s["verify_failures"])


def markdown(s: dict[str, Any]) -> str:
    """The figures as the Markdown table used in docs/benchmarks.md."""
    f, r = s["figures"], s["ratios"]
    rows = [
        ("`dcp.save` + `FileSystemWriter` → /dev/shm (new step dir)", "stock_save"),
        ("`dcp.save` + `GeminiStorageWriter(checksum=\"xxh3\")` (steady state)", "gemini_save"),
        ("`dcp.save` + `GeminiStorageWriter(checksum=\"crc32c\")`", "gemini_save_crc32c"),
        ("`dcp.load` + `FileSystemReader` ← /dev/shm", "stock_load"),
        ("`dcp.load` + `GeminiStorageReader` (xxh3 step)", "gemini_load"),
        ("`dcp.load` + `GeminiStorageReader` (crc32c step)", "gemini_load_crc32c"),
        ("raw `copy_` into already-touched memory", "copy_touched"),
        ("raw `copy_` into freshly allocated memory", "copy_fresh"),
        ("raw `write()` into a new /dev/shm file", "shm_new_file"),
        ("raw xxh3 of the same bytes", "xxh3_only"),
    ]
    out = ["| operation (2 ranks, 1 thread each) | median s | GB/s | range GB/s |", "|---|---:|---:|---|"]
    for name, op in rows:
        x = f[op]
        rng = x["gbps_range"] or [None, None]
        out.append(f"| {name} | {fmt(x['median_s'], '.3f')} | **{fmt(x['gbps'])}** | {fmt(rng[0])}–{fmt(rng[1])} |")
    out.append(f"| Gemini first save (creates + faults the slots) | {s['gemini_first_save_s']:.3f} | "
               f"{fmt(s['gemini_first_save_gbps'])} | |")
    out.append("")
    out.append(f"save ratio **{r['save_vs_filesystemwriter']:.2f}×** (paired per round: median "
               f"{fmt(r['save_per_round_median'])}×; target ≥ {SAVE_TARGET:g}×: "
               f"{'met' if r['save_target_met'] else '**missed**'}); load ratio **{r['load_vs_filesystemreader']:.2f}×** "
               f"(paired: {fmt(r['load_per_round_median'])}×; target ≥ {LOAD_TARGET:g}×: "
               f"{'met' if r['load_target_met'] else '**missed**'}). With `checksum=\"crc32c\"`: save "
               f"**{r['crc32c']['save_vs_filesystemwriter']:.2f}×** (paired {fmt(r['crc32c']['save_per_round_median'])}×), "
               f"load **{r['crc32c']['load_vs_filesystemreader']:.2f}×** (paired {fmt(r['crc32c']['load_per_round_median'])}×). "
               f"The default writer (`checksum=\"auto\"` → {r['default']['checksum']} here) meets the save target: "
               f"{'yes' if r['default']['save_target_met'] else '**no**'}, the load target: "
               f"{'yes' if r['default']['load_target_met'] else '**no**'}. Raw touched `copy_` is "
               f"{r['copy_touched_vs_stock_save']:.2f}× the stock save and {r['copy_touched_vs_stock_load']:.2f}× the stock load.")
    return "\n".join(out)


def plot(s: dict[str, Any], path: Path) -> None:
    f = s["figures"]
    order = ["stock_save", "gemini_save", "gemini_save_crc32c", "stock_load", "gemini_load", "gemini_load_crc32c",
             "copy_fresh", "shm_new_file", "copy_touched", "xxh3_only"]
    labels = ["save FileSystemWriter", "save Gemini (xxh3)", "save Gemini (crc32c)", "load FileSystemReader",
              "load Gemini (xxh3)", "load Gemini (crc32c)", "raw copy_ fresh memory", "raw write() new shm file",
              "raw copy_ touched memory", "raw xxh3 of the bytes"]
    colors = ["#999999", "#4C72B0", "#55A868", "#999999", "#4C72B0", "#55A868", "#DDDDDD", "#DDDDDD", "#DDDDDD", "#DDDDDD"]
    r = s["ratios"]
    notes = [f"{fmt(f[o]['gbps'])}" for o in order]
    notes[1] += f"\n{r['save_vs_filesystemwriter']:.1f}x"
    notes[2] += f"\n{r['crc32c']['save_vs_filesystemwriter']:.1f}x"
    notes[4] += f"\n{r['load_vs_filesystemreader']:.1f}x"
    notes[5] += f"\n{r['crc32c']['load_vs_filesystemreader']:.1f}x"
    common.bar_chart(
        path, labels, [f[o]["gbps"] for o in order], colors=colors,
        errors=[f[o]["gbps_range"] for o in order], annotate=notes,
        hlines=[(SAVE_TARGET * (f["stock_save"]["gbps"] or 0), f"save target: {SAVE_TARGET:g}x FileSystemWriter"),
                (LOAD_TARGET * (f["stock_load"]["gbps"] or 0), f"load target: {LOAD_TARGET:g}x FileSystemReader")],
        title=f"Local tier, {s['state_bytes'] / GIB:.1f} GiB over 2 gloo ranks (1 thread each), /dev/shm — median GB/s"
              f"\n(CPU pressure during the run: {s['machine'].get('cpu_pressure_during_run_pct')}% of the time a task waited for a core)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="total state size over both ranks, GiB (default 2)")
    ap.add_argument("--rounds", type=int, default=7, help="measured rounds of every operation (default 7)")
    ap.add_argument("--keep", type=int, default=1,
                    help="steps retained by both writers (gemini keep=; stock dirs); default 1 bounds memory: "
                         "steady-state speed does not depend on it")
    ap.add_argument("--stock-threads", type=int, default=1, help="FileSystemWriter thread_count (default 1, its default)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds: a smoke run; writes files only if --json/--png")
    ap.add_argument("--json", type=Path, default=None, help="output JSON (default benchmarks/results/local.json)")
    ap.add_argument("--png", type=Path, default=None, help="output plot (default docs/img/bench_local.png)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--shm", default="/dev/shm",
                    help="memory-backed directory both writers' roots are made in (default /dev/shm; "
                         "e.g. a tmpfs mounted with huge=within_size, see docs/architecture.md)")
    ap.add_argument("--markdown", action="store_true", help="also print the docs/benchmarks.md table")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="on a shared machine: first wait up to S seconds for CPU pressure (avg10) below 10%%")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the GPU save path instead (benchmarks/bench_gpu_save.py: dcp.save of CUDA DTensors "
                         "into the tier vs pinned D2H, loads onto the GPU; one process on one GPU)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import bench_gpu_save  # noqa: PLC0415 - the GPU variant lives in its own script

        fwd = ["--gib", str(args.gib), "--rounds", str(args.rounds), "--root", args.shm]
        fwd += ["--json", str(args.json)] if args.json else []
        fwd += ["--png", str(args.png)] if args.png else []
        bench_gpu_save.main(fwd)
        return 0
    if args.quick:
        args.gib = min(args.gib, 1 / 16)
        args.rounds = min(args.rounds, 2)
    else:
        args.json = args.json or common.RESULTS / "local.json"
        args.png = args.png or common.IMG / "bench_local.png"
    total = int(args.gib * GIB)
    # state + gemini slots (keep+1 per rank) + stock dirs (keep, +1 while saving) + raw baseline buffers
    common.require_memory(int(total * (1 + 2 * (args.keep + 1) + 0.5)), "bench_local", args.shm)
    scratch = common.shm_dir("gemini-bench-local-", args.shm)
    try:
        if args.wait_quiet > 0:
            print(f"cpu pressure avg10 at start: {common.wait_quiet(args.wait_quiet)}%")
        t0 = time.time()
        load_before = common.loadavg()
        pressure_before = common.cpu_pressure()
        psi_total = common.cpu_pressure_total()
        results = common.spawn(worker, 2, total_bytes=total, rounds=args.rounds, keep=args.keep,
                               scratch=str(scratch), stock_threads=args.stock_threads)
        s = summarize(results, args)
        s["wall_s"] = time.time() - t0
        s["machine"]["loadavg_before"] = load_before
        s["machine"]["cpu_pressure_before"] = pressure_before
        s["machine"]["cpu_pressure_during_run_pct"] = common.pressure_during(psi_total, s["wall_s"])
    finally:
        common.remove_dir(scratch)
    report(s)
    print(f"  CPU pressure during the run: {s['machine'].get('cpu_pressure_during_run_pct')}% "
          f"(share of the time some task on the machine waited for a core)")
    if args.markdown:
        print(markdown(s))
    if args.json:
        common.write_json(args.json, s)
        print(f"wrote {args.json}")
    if args.png:
        plot(s, args.png)
        print(f"wrote {args.png}")
    if s["verify_failures"]:
        return 2
    ok = s["ratios"]["save_target_met"] and s["ratios"]["load_target_met"]
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
