"""Peer-tier benchmark (issue 3): replication and lost-node restore vs raw gloo send/recv.

    python benchmarks/bench_peer.py                 # 2 GiB over 2 simulated nodes, 5 rounds, 3 restores
    python benchmarks/bench_peer.py --gib 1 --rounds 3 --restores 2
    python benchmarks/bench_peer.py --quick         # 64 MiB smoke run (no files written unless --json/--png)
    python benchmarks/bench_peer.py --transport gloo nixl   # the same run per peer_transport (issue 43)
    python benchmarks/bench_peer.py --gib 1 --rounds 3 --restores 3 --transport gloo nixl --passes 3

``--transport`` (run it with a python that has NIXL: scripts/nixl_venv.sh) repeats the save and
restore runs once per ``peer_transport`` (``--passes`` times, alternating which goes first: read
medians over passes on a shared host), in the same invocation, and adds raw NIXL: one WRITE of
the same bytes between the same processes, buffers registered and the transfer prepared once,
outside the timing (``raw_nixl_swap``, ``raw_nixl_oneway``). UCX_TLS defaults to ``sm,tcp`` and
UCX_NET_DEVICES to ``lo`` when unset. Writes benchmarks/results/peer_transport.json.

Two simulated nodes × one rank (each rank its own tier root), gloo on
127.0.0.1, one intra-op thread per rank, ``replicas=2`` (each node's shards
also in the other node's memory; both placements reduce to this pair).

Save run (one pair of processes): after the warm-up saves that create the
slots (``keep + 1`` own + ``keep + 1`` replica slots per node), rounds rotate:

* ``gemini_save`` — ``dcp.save`` with ``GeminiStorageWriter(replicas=2)``;
  its ``last_replication`` gives the bytes each rank sent and the seconds the
  replication took (slot exchange + receiver-side checksum verification +
  the agreement collective). Replication GB/s = sent bytes / seconds.
* ``raw_swap`` — the same exchange with bare ``dist.isend``/``dist.irecv`` of
  the same number of bytes between the same processes, into an already-touched
  buffer (what the slots are in steady state). The target: replication
  ≥ 80% of this.
* ``raw_oneway`` / ``raw_oneway_fresh`` — node 0 → node 1 only, into a touched
  or freshly allocated buffer (the restore direction).

Restore runs (``--restores`` times, fresh processes each time): node 1's
tier root is wiped between the save run and the load (a replaced machine),
then both nodes ``dcp.load`` with ``GeminiStorageReader``; node 1's shards
come from node 0's memory. Restore GB/s = ``restored_from["peer"]`` bytes /
``dcp.load`` wall time (and / ``reader.restore_seconds``), compared with raw
one-way gloo measured in the same fresh processes right after the load.
Loads are checked bit-exact against the saved state.

Writes benchmarks/results/peer.json and docs/img/bench_peer.png (full runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import GIB, fmt, gbps, median, spread  # noqa: E402

TARGET = 0.80
SAVE_OPS = ("gemini_save", "raw_swap", "raw_oneway", "raw_oneway_fresh")
NIXL_OPS = ("raw_nixl_swap", "raw_nixl_oneway")
JOB = "bench"


def _instrument_peer(clock: common.PhaseClock) -> None:
    """Time the verification and transfer helpers where they are looked up (module attributes)."""
    import gemini_dcp.dcp.reader as reader
    import gemini_dcp.peer.push as push

    if getattr(push, "_bench_wrapped", False):
        return
    clock.wrap(push, "_verify_items", "replica_verify")
    clock.wrap(push, "node_order", "node_order")
    clock.wrap(reader, "fetch_remote", "fetch_remote")  # the reader calls it by the name it imported
    push._bench_wrapped = True  # type: ignore[attr-defined]


def _raw_ops(rank: int, sizes: list[int], src: Any, touched: Any) -> dict[str, Any]:
    """Bare gloo transfers: ``sizes[r]`` bytes leave rank r in the swap; ``sizes[1]`` go 0 -> 1 one-way."""
    import torch
    import torch.distributed as dist

    other = 1 - rank
    send_buf = src[: sizes[rank]]
    recv_buf = touched[: sizes[other]]
    n1 = sizes[1]

    def swap() -> None:
        works = [dist.isend(send_buf, dst=other), dist.irecv(recv_buf, src=other)]
        for w in works:
            w.wait()

    def oneway() -> None:
        if rank == 0:
            dist.send(src[:n1], dst=1)
        else:
            dist.recv(touched[:n1], src=0)

    def oneway_fresh() -> None:
        if rank == 0:
            dist.send(src[:n1], dst=1)
        else:
            buf = torch.empty(n1, dtype=torch.uint8)
            dist.recv(buf, src=0)
            del buf

    return {"raw_swap": swap, "raw_oneway": oneway, "raw_oneway_fresh": oneway_fresh}


def _raw_nixl_ops(rank: int, sizes: list[int], src: Any, touched: Any) -> dict[str, Any]:
    """Raw NIXL: ``sizes[r]`` bytes WRITTEN from rank r into the other's buffer (the swap), or 0 -> 1 only.

    Both buffers are registered, the metadata exchanged and the transfer prepared once, here (not timed):
    each timed call is one posted WRITE and its wait, plus the wait for the peer's notification."""
    import torch.distributed as dist

    from gemini_dcp.transport import nixl

    eng = nixl.engine()
    agent = eng.agent
    other = 1 - rank
    send_buf, recv_buf = src[: sizes[rank]], touched[: sizes[other]]
    regs = [eng.register(send_buf), eng.register(recv_buf)]
    mine = (bytes(agent.get_partial_agent_metadata(regs[1], True)), recv_buf.data_ptr())
    got: list[Any] = [None, None]
    dist.all_gather_object(got, mine)
    name = agent.add_remote_agent(got[other][0])
    name = name.decode() if isinstance(name, bytes) else str(name)
    local = agent.get_xfer_descs([(send_buf.data_ptr(), sizes[rank], 0)], "DRAM")
    remote = agent.get_xfer_descs([(got[other][1], sizes[rank], 0)], "DRAM")
    handle = agent.initialize_xfer("WRITE", local, remote, name, b"warm")
    seq = [0]

    def write(tag: bytes) -> None:
        if agent.transfer(handle, tag) == "ERR":
            raise RuntimeError("NIXL WRITE failed")
        while agent.check_xfer_state(handle) == "PROC":
            pass

    def notified(tag: bytes) -> None:
        while not agent.check_remote_xfer_done(name, tag):
            pass

    def swap() -> None:
        seq[0] += 1
        tag = f"s{seq[0]}".encode()
        write(tag)
        notified(tag)

    def oneway() -> None:
        seq[0] += 1
        tag = f"o{seq[0]}".encode()
        if rank == 0:
            write(tag)
        else:
            notified(tag)
        dist.barrier()  # the next call starts together (rank 0 must not re-post before rank 1 saw this one)

    swap()  # UCX's lazy wire-up, outside the timing
    return {"raw_nixl_swap": swap, "raw_nixl_oneway": oneway, "_keep": (regs, handle)}


def _sizes(n: int) -> list[int]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([n], dtype=torch.int64))
    return [int(x.item()) for x in out]


def _slot_source(writer: Any, step: int, rank: int, nbytes: int) -> Any:
    """The raw transfers send the very bytes replication sends: this rank's newest slot, mapped read-only
    (no extra memory). Falls back to a filled buffer if the slot is smaller (rank 1 with fewer bytes)."""
    import torch

    from gemini_dcp.local.slots import ReadOnlySlot

    rec = writer.tier.record(step)
    rs = rec.slot_of(rank) if rec is not None else None
    if rs is not None:
        m = ReadOnlySlot(writer.tier.slot_path(rank, rs.slot))
        if m.size >= nbytes:
            return m.view(0, nbytes)
    return torch.full((nbytes,), 7, dtype=torch.uint8)


def save_worker(rank: int, world: int, *, total_bytes: int, rounds: int, keep: int, roots: list[str],
                transport: str = "gloo") -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageWriter

    timed = common.timed
    sd = common.make_state(total_bytes, rank, world)
    expect = common.fingerprint(sd)
    clock = common.PhaseClock()
    _instrument_peer(clock)
    writer = GeminiStorageWriter(root=roots[rank], job_id=JOB, keep=keep, replicas=2, peer_transport=transport)
    step = 0
    rows: list[dict[str, Any]] = []

    def save() -> None:
        nonlocal step
        clock.reset()
        dcp.save(sd, storage_writer=writer, checkpoint_id=step)
        step += 1

    warm = []
    for _ in range(keep + 1):
        warm.append(timed(save))
    sizes = _sizes(int(writer.commit.last_replication.get("sent_bytes", 0)))
    src = _slot_source(writer, step - 1, rank, max(sizes))
    touched = torch.empty(max(sizes), dtype=torch.uint8)
    touched.fill_(0)
    raw = _raw_ops(rank, sizes, src, touched)
    raw["raw_swap"]()  # warm gloo's pairs
    names = SAVE_OPS
    if transport == "nixl":
        raw.update(_raw_nixl_ops(rank, sizes, src, touched))
        names = SAVE_OPS + NIXL_OPS
    ops: dict[str, list[float]] = {op: [] for op in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for op in order:
            if op == "gemini_save":
                ops[op].append(timed(save))
                rep = dict(writer.commit.last_replication)
                rep.update(clock.acc)
                rep["save_seconds"] = writer.commit.last_save_seconds
                rows.append(rep)
            else:
                ops[op].append(timed(raw[op]))
    del src, touched
    return {
        "rank": rank,
        "node_root": roots[rank],
        "warmup_saves_s": warm,
        "ops": ops,
        "replication": rows,
        "payload_bytes": sizes[rank],
        "sizes": sizes,
        "last_step": step - 1,
        "expect": expect,
        "rank_bytes": common.state_bytes(sd, rank),
    }


def restore_worker(rank: int, world: int, *, total_bytes: int, roots: list[str], expect_by_rank: list[dict[str, int]], extra_loads: int,
                   before: bool = False, transport: str = "gloo") -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader

    if before:  # as before the fix: the extension loaded on first use inside the restore, one pre-fault call
        import gemini_dcp.ext.loader as ext_loader
        import gemini_dcp.peer.arena as arena

        ext_loader.preload = lambda: None
        arena.POPULATE_STEP = 0

    timed = common.timed
    expect = expect_by_rank[rank]
    sd = common.make_state(total_bytes, rank, world, seed=1)  # same structure, other values
    common.scramble(sd)
    clock = common.PhaseClock()
    _instrument_peer(clock)
    readers: list[Any] = []

    def load() -> None:
        clock.reset()
        reader = GeminiStorageReader(root=roots[rank], job_id=JOB, peer_transport=transport)
        clock.wrap(reader, "_stage", "verify_copy")  # checksum of the stored bytes (before any copy)
        clock.wrap(reader, "_apply", "verify_copy")  # the copy into the live tensors, once every rank verified
        clock.wrap(reader, "read_metadata", "read_metadata")
        clock.wrap(reader, "_read_all", "read_all")
        clock.wrap(reader, "read_data", "read_data")
        dcp.load(sd, storage_reader=reader)
        readers[:] = [reader]

    first = timed(load)  # the first thing these fresh processes do
    rd = readers[0]
    ok = common.fingerprint(sd) == expect
    out: dict[str, Any] = {
        "rank": rank,
        "load_s": first,
        "restore_seconds": rd.restore_seconds,
        "restored_from": dict(rd.restored_from),
        "rank_restored_from": dict(rd.rank_restored_from),
        "restored_step": rd.restored_step,
        "phases": dict(clock.acc),
        "timeline": {k: [round(a, 4), round(b, 4)] for k, (a, b) in clock.spans.items()},
        "bit_exact": ok,
        "again": [],
    }
    for _ in range(extra_loads):  # the same restore again in the same (now warm) processes
        common.scramble(sd)
        out["again"].append({"load_s": timed(load), "restore_seconds": readers[0].restore_seconds,
                             "phases": dict(clock.acc)})
        out["bit_exact"] = out["bit_exact"] and common.fingerprint(sd) == expect
    nbytes = int(rd.restored_from.get("peer", 0))
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(3)
    touched = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    raw = _raw_ops(rank, [nbytes, nbytes], src, touched)
    out["raw_oneway"] = [timed(raw["raw_oneway"]) for _ in range(2)]
    out["raw_oneway_fresh"] = [timed(raw["raw_oneway_fresh"]) for _ in range(2)]
    out["raw_bytes"] = nbytes
    if transport == "nixl":
        nx = _raw_nixl_ops(rank, [nbytes, nbytes], src, touched)
        out["raw_nixl_oneway"] = [timed(nx["raw_nixl_oneway"]) for _ in range(2)]
    return out


def wipe(root: Path) -> None:
    """A replaced machine: its tier root is empty."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(mode=0o700)


def summarize(save: list[dict[str, Any]], restores: list[list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    s0 = save[0]
    sizes = s0["sizes"]
    payload = sum(sizes) / len(sizes)  # mean bytes each node sends (rank 0 also holds the replicated tensors)
    figs: dict[str, Any] = {}
    # replication: per round, the slowest rank's seconds; GB/s per node = mean bytes sent per node / seconds
    rep_s = [max(save[r]["replication"][i]["seconds"] for r in range(len(save))) for i in range(len(s0["replication"]))]
    rep_rates = [gbps(payload, x) for x in rep_s]
    figs["replication"] = {"bytes_per_rank": sizes, "seconds": rep_s, "median_s": median(rep_s),
                           "gbps": median(rep_rates), "gbps_range": spread(rep_rates)}
    for op in SAVE_OPS:
        secs = s0["ops"][op]
        b = {"gemini_save": s0["rank_bytes"] + save[1]["rank_bytes"], "raw_swap": payload}.get(op, sizes[1])
        rates = [gbps(b, x) for x in secs]
        figs[op] = {"bytes": b, "seconds": secs, "median_s": median(secs), "gbps": median(rates), "gbps_range": spread(rates)}
    for op in NIXL_OPS:
        if op in s0["ops"]:
            secs = s0["ops"][op]
            b = payload if op == "raw_nixl_swap" else sizes[1]
            rates = [gbps(b, x) for x in secs]
            figs[op] = {"bytes": b, "seconds": secs, "median_s": median(secs), "gbps": median(rates), "gbps_range": spread(rates)}
    # restore: bytes node 1 pulled from node 0's memory / wall time of the whole dcp.load
    rest_rows = []
    for run in restores:
        peer = sum(r["rank_restored_from"].get("peer", 0) for r in run)
        rest_rows.append({
            "load_s": run[0]["load_s"],
            "restore_seconds": max(r["restore_seconds"] for r in run),
            "peer_bytes": peer,
            "restored_from": run[0]["restored_from"],
            "restored_step": run[0]["restored_step"],
            "bit_exact": all(r["bit_exact"] for r in run),
            "raw_oneway_s": median(run[0]["raw_oneway"]),
            "raw_oneway_fresh_s": median(run[0]["raw_oneway_fresh"]),
            "again_load_s": [a["load_s"] for a in run[0]["again"]],
            "phases": {f"rank{r['rank']}": r["phases"] for r in run},
            "timeline": {f"rank{r['rank']}": r["timeline"] for r in run},
        })
    peer_bytes = rest_rows[0]["peer_bytes"] if rest_rows else 0
    figs["restore"] = {
        "peer_bytes": peer_bytes,
        "load_s": [x["load_s"] for x in rest_rows],
        "gbps": median(gbps(x["peer_bytes"], x["load_s"]) for x in rest_rows),
        "gbps_range": spread([gbps(x["peer_bytes"], x["load_s"]) for x in rest_rows]),
        "gbps_by_restore_seconds": median(gbps(x["peer_bytes"], x["restore_seconds"]) for x in rest_rows),
        "again_gbps": median(gbps(peer_bytes, t) for x in rest_rows for t in x["again_load_s"]),
    }
    loads = sorted(x["load_s"] for x in rest_rows)
    figs["restore"]["spread"] = {  # replacement-node restores in fresh processes: the tail, not only the median
        "load_s_sorted": loads, "median_s": median(loads), "max_s": loads[-1] if loads else None,
        "max_over_median": (loads[-1] / median(loads)) if loads and median(loads) else None,
    }
    figs["restore_raw_oneway"] = {
        "gbps": median(gbps(x["peer_bytes"], x["raw_oneway_s"]) for x in rest_rows),
        "gbps_range": spread([gbps(x["peer_bytes"], x["raw_oneway_s"]) for x in rest_rows]),
    }
    if restores and "raw_nixl_oneway" in restores[0][0]:
        figs["restore_raw_nixl_oneway"] = {
            "gbps": median(gbps(x["peer_bytes"], median(run[0]["raw_nixl_oneway"])) for x, run in zip(rest_rows, restores)),
        }
    figs["restore_raw_oneway_fresh"] = {
        "gbps": median(gbps(x["peer_bytes"], x["raw_oneway_fresh_s"]) for x in rest_rows),
        "gbps_range": spread([gbps(x["peer_bytes"], x["raw_oneway_fresh_s"]) for x in rest_rows]),
    }

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    rep_ratio = ratio(figs["replication"]["gbps"], figs["raw_swap"]["gbps"])
    res_ratio = ratio(figs["restore"]["gbps"], figs["restore_raw_oneway"]["gbps"])
    keys = sorted({k for r in save for row in r["replication"] for k in row if isinstance(row[k], float)})
    rep_phases = {f"rank{r['rank']}": {k: median(row.get(k, 0.0) for row in r["replication"]) for k in keys} for r in save}
    return {
        "benchmark": "peer",
        "machine": common.machine_info(),
        "config": {"peer_transport": getattr(args, "transport_now", "gloo"), "before_dlopen_fix": args.before, "gib": args.gib, "nodes": 2, "ranks_per_node": 1, "threads_per_rank": 1, "replicas": 2,
                   "keep": args.keep, "rounds": args.rounds, "restores": args.restores, "gb": "1e9 bytes",
                   "tier_dir": args.shm, "tier_mount": common.mount_options(args.shm)},
        "payload_bytes_per_rank": payload,
        "warmup_saves_s": s0["warmup_saves_s"],
        "figures": figs,
        "replication_phases_s": rep_phases,
        "restores": rest_rows,
        "ratios": {
            "replication_vs_raw_swap": rep_ratio,
            "restore_vs_raw_oneway": res_ratio,
            "restore_vs_raw_oneway_fresh": ratio(figs["restore"]["gbps"], figs["restore_raw_oneway_fresh"]["gbps"]),
            "target": TARGET,
            "replication_target_met": bool(rep_ratio and rep_ratio >= TARGET),
            "restore_target_met": bool(res_ratio and res_ratio >= TARGET),
        },
        "bit_exact": all(x["bit_exact"] for x in rest_rows),
        "restored_peer": all(x["peer_bytes"] > 0 for x in rest_rows),
    }


def report(s: dict[str, Any]) -> None:
    f = s["figures"]
    print(f"\npayload: {s['payload_bytes_per_rank'] / GIB:.3f} GiB per node; 2 nodes x 1 rank; replicas=2; "
          f"medians [min-max] GB/s (1 GB = 1e9 B)")

    def line(name: str, x: dict[str, Any], extra: str = "") -> None:
        rng = x.get("gbps_range") or [None, None]
        print(f"  {name:52s} {fmt(x['gbps']):>6s} GB/s  [{fmt(rng[0])}-{fmt(rng[1])}] {extra}")

    line("replication (sent bytes / last_replication seconds)", f["replication"], f"median {fmt(f['replication']['median_s'], '.3f')} s")
    line("raw gloo isend/irecv swap, touched buffer (per rank)", f["raw_swap"], f"median {fmt(f['raw_swap']['median_s'], '.3f')} s")
    line("raw gloo one-way 0->1, touched buffer", f["raw_oneway"])
    line("raw gloo one-way 0->1, fresh buffer", f["raw_oneway_fresh"])
    sp = f["restore"].get("spread") or {}
    if sp.get("load_s_sorted"):
        print(f"  restores in fresh processes ({len(sp['load_s_sorted'])}): "
              f"{', '.join(fmt(x, '.3f') for x in sp['load_s_sorted'])} s; median {fmt(sp['median_s'], '.3f')} s, "
              f"max {fmt(sp['max_over_median'], '.2f')}x the median")
    line("whole dcp.save replicas=2 (all state bytes / wall)", f["gemini_save"], f"median {fmt(f['gemini_save']['median_s'], '.3f')} s")
    line("restore of lost node from peer (peer bytes / dcp.load)", f["restore"],
         f"(by restore_seconds {fmt(f['restore']['gbps_by_restore_seconds'])}; warm re-load {fmt(f['restore']['again_gbps'])})")
    line("raw gloo one-way in the restore processes, touched", f["restore_raw_oneway"])
    line("raw gloo one-way in the restore processes, fresh", f["restore_raw_oneway_fresh"])
    r = s["ratios"]
    print(f"  replication / raw swap: {fmt(r['replication_vs_raw_swap'])} (target >= {TARGET}: "
          f"{'met' if r['replication_target_met'] else 'MISSED'})")
    print(f"  restore / raw one-way:  {fmt(r['restore_vs_raw_oneway'])} (target >= {TARGET}: "
          f"{'met' if r['restore_target_met'] else 'MISSED'}); vs fresh-buffer raw {fmt(r['restore_vs_raw_oneway_fresh'])}")
    print("  replication phases (median s): " + "; ".join(
        f"{rk}: " + ", ".join(f"{k}={v:.3f}" for k, v in ph.items() if v is not None) for rk, ph in s["replication_phases_s"].items()))
    for i, x in enumerate(s["restores"]):
        print(f"  restore {i}: step {x['restored_step']} from {x['restored_from']}, load {x['load_s']:.3f} s, "
              f"bit-exact {x['bit_exact']}; phases " + "; ".join(
                  f"{rk}: " + ", ".join(f"{k}={v:.3f}" for k, v in ph.items()) for rk, ph in x["phases"].items()))
        for rk, tl in x["timeline"].items():
            print(f"    {rk} timeline (s after load start): " + ", ".join(
                f"{k} {a:.2f}-{b:.2f}" for k, (a, b) in sorted(tl.items(), key=lambda kv: kv[1][0])))


def markdown(s: dict[str, Any]) -> str:
    """The figures as the Markdown table used in docs/benchmarks.md."""
    f, r = s["figures"], s["ratios"]
    rows = [
        ("raw gloo `isend`/`irecv` swap, touched buffers", "raw_swap"),
        ("**replication** in `dcp.save(replicas=2)` (`last_replication`)", "replication"),
        ("raw gloo one-way 0→1, touched buffer (save processes)", "raw_oneway"),
        ("raw gloo one-way 0→1, touched buffer (restore processes)", "restore_raw_oneway"),
        ("raw gloo one-way 0→1, fresh buffer (restore processes)", "restore_raw_oneway_fresh"),
        ("**restore** of the lost node from peer memory (`dcp.load`)", "restore"),
        ("whole `dcp.save(replicas=2)`, all state bytes", "gemini_save"),
    ]
    out = ["| operation (2 simulated nodes × 1 rank) | GB/s per node | range |", "|---|---:|---|"]
    for name, op in rows:
        x = f[op]
        rng = x.get("gbps_range") or [None, None]
        out.append(f"| {name} | **{fmt(x['gbps'])}** | {fmt(rng[0])}–{fmt(rng[1])} |")
    out.append("")
    out.append(f"replication / raw swap **{fmt(r['replication_vs_raw_swap'])}** (target ≥ {TARGET:g}: "
               f"{'met' if r['replication_target_met'] else '**missed**'}); restore / raw one-way "
               f"**{fmt(r['restore_vs_raw_oneway'])}** (target ≥ {TARGET:g}: "
               f"{'met' if r['restore_target_met'] else '**missed**'}); restores bit-exact: {s['bit_exact']}.")
    return "\n".join(out)


def plot(s: dict[str, Any], path: Path) -> None:
    f = s["figures"]
    r = s["ratios"]
    order = ["raw_swap", "replication", "restore_raw_oneway", "restore_raw_oneway_fresh", "restore"]
    labels = ["raw gloo swap", "replication (save)", "raw gloo one-way", "raw one-way, fresh buf", "restore from peer"]
    notes = [fmt(f[o]["gbps"]) for o in order]
    notes[1] += f"\n{fmt(r['replication_vs_raw_swap'])} of raw"
    notes[4] += f"\n{fmt(r['restore_vs_raw_oneway'])} of raw"
    raw_swap = f["raw_swap"]["gbps"] or 0
    raw_one = f["restore_raw_oneway"]["gbps"] or 0
    common.bar_chart(
        path, labels, [f[o]["gbps"] for o in order],
        colors=["#DDDDDD", "#4C72B0", "#DDDDDD", "#DDDDDD", "#4C72B0"],
        errors=[f[o].get("gbps_range") for o in order], annotate=notes,
        hlines=[(TARGET * raw_swap, "80% of raw swap"), (TARGET * raw_one, "80% of raw one-way")],
        title=f"Peer tier, {s['payload_bytes_per_rank'] / GIB:.2f} GiB per node, 2 simulated nodes, gloo loopback — GB/s per node"
              f"\n(CPU pressure during the run: {s['machine'].get('cpu_pressure_during_run_pct')}% of the time a task waited for a core)",
    )
    if s["restores"]:
        timeline_plot(s["restores"][0], path.with_name(path.stem + "_timeline" + path.suffix))


def timeline_plot(restore: dict[str, Any], path: Path) -> None:
    """Per-rank spans of the phases of one lost-node restore (the first, in fresh processes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["read_metadata", "verify_copy", "peer_transfer", "fetch_remote"]
    names = {"read_metadata": "restore decision (read_metadata)", "verify_copy": "verify + copy into live tensors",
             "peer_transfer": "gloo send/recv round", "fetch_remote": "peer fetch incl. final agreement"}
    colors = dict(zip(phases, ["#8172B2", "#55A868", "#4C72B0", "#64B5CD"]))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ranks = sorted(restore["timeline"])
    for y, rk in enumerate(ranks):
        tl = restore["timeline"][rk]
        for j, ph in enumerate(phases):
            if ph in tl:
                a, b = tl[ph]
                ax.barh(y + (j - 1.5) * 0.18, b - a, left=a, height=0.16, color=colors[ph], label=names[ph] if y == 0 else None)
    ax.axvline(restore["load_s"], color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"{rk} ({'serves' if rk == 'rank0' else 'replaced node'})" for rk in ranks], fontsize=8)
    ax.set_xlabel("seconds after dcp.load started (spans: first start to last end of each phase)")
    ax.set_title(f"Restore of the replaced node 1 from node 0's memory (fresh processes): where the time goes\n"
                 f"dashed: dcp.load returns at {restore['load_s']:.2f} s", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=4, frameon=False)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="total state size over both nodes, GiB (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds in the save run (default 5)")
    ap.add_argument("--restores", type=int, default=3, help="lost-node restores, fresh processes each (default 3)")
    ap.add_argument("--extra-loads", type=int, default=1, help="further loads in the same restore processes (default 1)")
    ap.add_argument("--keep", type=int, default=1, help="gemini keep= (default 1: bounds memory; speed does not depend on it)")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds, 1 restore; writes files only if --json/--png")
    ap.add_argument("--json", type=Path, default=None, help="output JSON (default benchmarks/results/peer.json)")
    ap.add_argument("--png", type=Path, default=None, help="output plot (default docs/img/bench_peer.png)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--before", action="store_true",
                    help="restore as before the dlopen fix: the extension loaded lazily inside the restore and the "
                         "receive arena pre-faulted in one madvise call (for a before/after of the restore spread)")
    ap.add_argument("--shm", default="/dev/shm",
                    help="memory-backed directory the nodes' tier roots are made in (default /dev/shm; "
                         "e.g. a tmpfs mounted with huge=within_size, see docs/architecture.md)")
    ap.add_argument("--markdown", action="store_true", help="also print the docs/benchmarks.md table")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="on a shared machine: first wait up to S seconds for CPU pressure (avg10) below 10%%")
    ap.add_argument("--transport", nargs="+", choices=("gloo", "nixl"), default=None,
                    help="run once per peer_transport, same invocation (writes benchmarks/results/peer_transport.json)")
    ap.add_argument("--passes", type=int, default=1,
                    help="with --transport: repeat the runs, alternating which transport goes first (default 1)")
    args = ap.parse_args(argv)
    if args.transport:
        return main_transports(args)
    if args.quick:
        args.gib = min(args.gib, 1 / 16)
        args.rounds, args.restores, args.extra_loads = min(args.rounds, 2), 1, min(args.extra_loads, 1)
    else:
        args.json = args.json or common.RESULTS / "peer.json"
        args.png = args.png or common.IMG / "bench_peer.png"
    total = int(args.gib * GIB)
    # state + own and replica slots on each node + the raw receive buffer
    common.require_memory(int(total * (2 + 2 * (args.keep + 1))), "bench_peer", args.shm)
    scratch = common.shm_dir("gemini-bench-peer-", args.shm)
    roots = [scratch / "node0", scratch / "node1"]
    for r in roots:
        r.mkdir(mode=0o700)
    try:
        if args.wait_quiet > 0:
            print(f"cpu pressure avg10 at start: {common.wait_quiet(args.wait_quiet)}%")
        t0 = time.time()
        load_before = common.loadavg()
        pressure_before = common.cpu_pressure()
        psi_total = common.cpu_pressure_total()
        save = common.spawn(save_worker, 2, total_bytes=total, rounds=args.rounds, keep=args.keep, roots=[str(r) for r in roots])
        restores = []
        for _ in range(args.restores):
            wipe(roots[1])  # node 1 is replaced: fresh processes, empty memory
            restores.append(common.spawn(restore_worker, 2, total_bytes=total, roots=[str(r) for r in roots],
                                         expect_by_rank=[x["expect"] for x in save], extra_loads=args.extra_loads,
                                         before=args.before))
        s = summarize(save, restores, args)
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
        print(f"wrote {args.png} (+ {args.png.stem}_timeline{args.png.suffix})")
    if not (s["bit_exact"] and s["restored_peer"]):
        print("ERROR: a restore was not bit-exact or did not use the peer tier")
        return 2
    ok = s["ratios"]["replication_target_met"] and s["ratios"]["restore_target_met"]
    return 1 if args.check and not ok else 0




def _run(args: argparse.Namespace, roots: list[Path], total: int, transport: str) -> dict[str, Any]:
    """One save run and ``args.restores`` restores with ``peer_transport=transport``; its summary."""
    t0 = time.time()
    psi_total = common.cpu_pressure_total()
    for r in roots:
        wipe(r)
    save = common.spawn(save_worker, 2, total_bytes=total, rounds=args.rounds, keep=args.keep,
                        roots=[str(r) for r in roots], transport=transport)
    restores = []
    for _ in range(args.restores):
        wipe(roots[1])
        restores.append(common.spawn(restore_worker, 2, total_bytes=total, roots=[str(r) for r in roots],
                                     expect_by_rank=[x["expect"] for x in save], extra_loads=args.extra_loads,
                                     transport=transport))
    args.transport_now = transport
    s = summarize(save, restores, args)
    s["wall_s"] = time.time() - t0
    s["machine"]["cpu_pressure_during_run_pct"] = common.pressure_during(psi_total, s["wall_s"])
    return s


def main_transports(args: argparse.Namespace) -> int:
    """``--transport gloo nixl``: the same runs per transport, alternated over ``--passes``, one JSON (issue 43)."""
    os.environ.setdefault("UCX_TLS", "sm,tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if args.quick:
        args.gib = min(args.gib, 1 / 16)
        args.rounds, args.restores, args.extra_loads = min(args.rounds, 2), 1, min(args.extra_loads, 1)
    out_path = args.json or common.RESULTS / "peer_transport.json"
    total = int(args.gib * GIB)
    common.require_memory(int(total * (2 + 2 * (args.keep + 1))), "bench_peer", args.shm)
    scratch = common.shm_dir("gemini-bench-peer-", args.shm)
    roots = [scratch / "node0", scratch / "node1"]
    kinds = list(args.transport)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    passes = []
    try:
        for p in range(args.passes):
            order = kinds[p % len(kinds):] + kinds[: p % len(kinds)]  # alternate who goes first
            passes.append(order)
            for kind in order:
                s = _run(args, roots, total, kind)
                s["pass"] = p
                runs[kind].append(s)
                print(f"\n== pass {p}, peer_transport={kind} ==")
                report(s)
    finally:
        common.remove_dir(scratch)
    rows = []
    for kind, ss in runs.items():
        def each(get: Any) -> list[Any]:
            return [get(s) for s in ss]  # noqa: B023 - used at once

        rep = each(lambda s: s["figures"]["replication"]["gbps"])
        res = each(lambda s: s["figures"]["restore"]["gbps"])
        loads = sorted(x for s in ss for x in s["figures"]["restore"]["load_s"])
        rows.append({
            "transport": kind,
            "replication_gbps": median(rep), "replication_gbps_per_pass": rep,
            "replication_median_s": median(x for s in ss for x in s["figures"]["replication"]["seconds"]),
            "raw_gloo_swap_gbps": median(each(lambda s: s["figures"]["raw_swap"]["gbps"])),
            "raw_nixl_swap_gbps": median(each(lambda s: s["figures"].get("raw_nixl_swap", {}).get("gbps"))) if kind == "nixl" else None,
            "restore_gbps": median(res), "restore_gbps_per_pass": res,
            "restore_load_s_sorted": loads, "restore_load_median_s": median(loads),
            "restore_again_gbps": median(each(lambda s: s["figures"]["restore"]["again_gbps"])),
            "restore_read_metadata_s": median(
                r["phases"][rk].get("read_metadata", 0.0) for s in ss for r in s["restores"] for rk in r["phases"]),
            "raw_gloo_oneway_gbps": median(each(lambda s: s["figures"]["restore_raw_oneway"]["gbps"])),
            "raw_nixl_oneway_gbps": median(each(lambda s: s["figures"].get("restore_raw_nixl_oneway", {}).get("gbps")))
            if kind == "nixl" else None,
            "bit_exact": all(s["bit_exact"] for s in ss),
            "cpu_pressure_pct_per_pass": each(lambda s: s["machine"].get("cpu_pressure_during_run_pct")),
        })
    print("\n| peer_transport | replication GB/s (per pass) | raw gloo swap | raw NIXL swap | restore GB/s (per pass) | "
          "restore dcp.load s (median) | raw gloo one-way | raw NIXL one-way | CPU pressure % | bit-exact |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['transport']} | **{fmt(r['replication_gbps'])}** ({', '.join(fmt(x) for x in r['replication_gbps_per_pass'])}) | "
              f"{fmt(r['raw_gloo_swap_gbps'])} | {fmt(r['raw_nixl_swap_gbps'])} | **{fmt(r['restore_gbps'])}** "
              f"({', '.join(fmt(x) for x in r['restore_gbps_per_pass'])}) | {fmt(r['restore_load_median_s'], '.3f')} | "
              f"{fmt(r['raw_gloo_oneway_gbps'])} | {fmt(r['raw_nixl_oneway_gbps'])} | "
              f"{', '.join(str(x) for x in r['cpu_pressure_pct_per_pass'])} | {r['bit_exact']} |")
    from gemini_dcp.transport.nixl import UCX_DEFAULTS

    ucx = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES", *UCX_DEFAULTS)}
    ucx["engine_defaults"] = dict(UCX_DEFAULTS)  # what the NIXL engine sets where the environment does not
    doc = {"benchmark": "peer_transport", "ucx": ucx,
           "passes": passes, "summary": rows, "runs": runs}
    common.write_json(out_path, doc)
    print(f"wrote {out_path}")
    return 0 if all(r["bit_exact"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
