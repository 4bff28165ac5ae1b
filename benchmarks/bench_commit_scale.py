"""Per-save commit bookkeeping and per-restore record work at large world sizes (single process).

    python benchmarks/bench_commit_scale.py                       # 16 / 64 / 256 ranks x 900 tensors (~1 min)
    python benchmarks/bench_commit_scale.py --world 64 1024 --tensors 300

A thousand-GPU job cannot be run on this machine, but the Python work that a
save or a restore does per chunk of *every* rank can be: this script builds, in
one process, what a rank holds after the commit gather of a replayed save of W
ranks with N tensors each (the recorded layout and every rank's compact report of
checksums), and times both ways of committing it, in the same run:

* ``expanded`` (the path before the checksum overlay, still used by a save whose
  chunk layout changed): rebuild a WriteResult + ShardRef per chunk of every rank, build
  the record's ``storage_data`` dict, encode the record (the node leader),
  decode it (every other rank, once per save), fingerprint it, and index every
  chunk by location (each restoring rank);
* ``overlay`` (replayed saves, and plain saves of an unchanged structure, now):
  ``record_types.ChecksumOverlay`` — the shared layout plus one array of checksums —
  for the same steps; the fingerprint and location
  index of a second record of the same plan (what every save after the first and
  every restore after the first record costs).

The restore decision's view size per rank is printed too (it no longer carries
the record's rank → node map), and so is what one rank receives and unpickles in
the commit gather of a plain ``dcp.save`` of an unchanged structure: every rank's
write results in full plus the planned metadata (before), or checksums against
the last committed layout with the metadata already held (now); and the first
record of a layout in a process (the leader's encode; a fresh restoring process's
decode, packed rows vs one MetadataIndex + ShardRef per chunk as before).
Writes benchmarks/results/commit_scale.json and docs/img/bench_commit_scale.png.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import IMG, RESULTS, bar_chart, machine_info, median, write_json  # noqa: E402


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median seconds of ``repeat`` calls, and the last result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(median(times) or 0.0), out


def _lookup(refs: Any, keys: list[tuple[int, int]]) -> list[Any]:
    """What a restoring rank does: index the record by location once, read its own chunks."""
    return [refs[k] for k in keys]


def measure(world: int, tensors: int, ranks_per_node: int, repeat: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from gemini_dcp.commit.reports import RankReport, SplitLayout, expand, overlay
    from gemini_dcp.core.restore_order import NodeView, StepView
    from gemini_dcp.local.record_codec import decode_record, encode_record
    from gemini_dcp.local.record_types import RankSlot, ShardRef, StepRecord
    from gemini_dcp.peer.fetch import refs_by_key

    layout = {
        MetadataIndex(f"model.layers.{i // 3}.w{i % 3}", [r * 64, 0]): ShardRef(r, i * 65536, 65536, 0, "crc32c", "bfloat16", (64, 512))
        for r in range(world)
        for i in range(tensors)
    }
    split = SplitLayout.of(layout)
    nodes = tuple(f"node-{r // ranks_per_node:05d}" for r in range(world))

    def reports(step: int) -> list[Any]:
        return [
            RankReport(rank=r, node_id=nodes[r], slot=step % 2, nbytes=tensors * 65536, results=(),
                        checksums=tuple((step * 7919 + r * tensors + i) & 0xFFFFFFFF for i in range(tensors)))
            for r in range(world)
        ]

    def record(step: int, storage_data: Any) -> Any:
        return StepRecord("bench", step, world, Metadata({}, storage_data=storage_data), nodes,
                          (tensors * 65536,) * world, {}, 2, "mixed", (RankSlot(0, step % 2, 1),), nodes[0])

    reps1, reps2 = reports(1), reports(2)
    mine = [(r, i * 65536) for r in (world // 2,) for i in range(tensors)]  # one rank's chunks, by location
    out: dict[str, Any] = {"world": world, "tensors_per_rank": tensors, "chunks": world * tensors}

    # ---- expanded: what a save did with every rank's results, and what a restore did with the record
    def expand_build() -> Any:
        full = [expand(rep, split.by_rank) for rep in reps1]
        return {wr.index: wr.storage_data for rep in full for wr in rep.results}

    def record_work(commit_s: float, rec: Any) -> dict[str, Any]:
        """Time the record's life after the commit bookkeeping: encode, decode, fingerprint, one rank's refs."""
        t_enc, blob = _best(lambda: encode_record(rec), repeat)
        t_dec, _ = _best(lambda: decode_record(blob), repeat)
        t_fp, _ = _best(rec.fingerprint, repeat)
        t_refs, _ = _best(lambda: _lookup(refs_by_key(rec), mine), repeat)
        return {"commit_s": commit_s, "encode_s": t_enc, "decode_s": t_dec, "fingerprint_s": t_fp,
                "refs_s": t_refs, "record_bytes": len(blob)}

    t_expand, plain = _best(expand_build, repeat)
    rec_plain = record(1, plain)
    fp_plain = rec_plain.fingerprint()
    out["expanded"] = record_work(t_expand, rec_plain)

    # ---- overlay: the same steps over the shared layout (first record warms the per-layout caches)
    first = record(1, overlay(split, reps1))
    first.fingerprint()
    _lookup(refs_by_key(first), mine)
    t_ov, ov = _best(lambda: overlay(split, reps2), repeat)
    out["overlay"] = record_work(t_ov, record(2, ov))
    out["fingerprints_agree"] = record(1, overlay(split, reps1)).fingerprint() == fp_plain

    # ---- restore decision: what every rank sends (and receives world_size times)
    held = tuple(range(ranks_per_node * 2))
    view = NodeView(0, nodes[0], tuple(StepView(s, "0123456789abcdef", world, held, 1.0, True) for s in (1, 2, 3)))
    out["view_bytes"] = len(pickle.dumps(view, protocol=pickle.HIGHEST_PROTOCOL))
    out["view_bytes_before"] = out["view_bytes"] + 3 * len(pickle.dumps((nodes, (tensors * 65536,) * world), protocol=pickle.HIGHEST_PROTOCOL))

    out["plain_gather"] = plain_gather(world, tensors, nodes, repeat)
    out["first_record"] = first_record(record(3, overlay(split, reports(3))), repeat)

    e, o = out["expanded"], out["overlay"]
    out["save_s"] = {"expanded": e["commit_s"] + e["encode_s"] + e["decode_s"], "overlay": o["commit_s"] + o["encode_s"] + o["decode_s"]}
    out["restore_s"] = {"expanded": e["decode_s"] + e["fingerprint_s"] + e["refs_s"], "overlay": o["decode_s"] + o["fingerprint_s"] + o["refs_s"]}
    out["ratios"] = {
        "save_overlay_vs_expanded": out["save_s"]["overlay"] / out["save_s"]["expanded"],
        "restore_overlay_vs_expanded": out["restore_s"]["overlay"] / out["restore_s"]["expanded"],
        "view_bytes_after_vs_before": out["view_bytes"] / out["view_bytes_before"],
    }
    return out


def plain_gather(world: int, tensors: int, nodes: tuple[str, ...], repeat: int) -> dict[str, Any]:
    """What one rank receives and unpickles in the commit of a plain ``dcp.save`` of an unchanged
    structure: every rank's write results in full plus the planned metadata (before), or every
    rank's checksums against the last committed layout and no metadata (after: every rank holds it)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    from gemini_dcp.commit.reports import INLINE_METADATA_PADDING, RankReport
    from gemini_dcp.local.record_types import ShardRef

    fqns = [f"model.layers.{i // 3}.w{i % 3}" for i in range(tensors)]
    meta = Metadata({
        f: TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([64 * world, 512]),
                                 [ChunkStorageMetadata(torch.Size([r * 64, 0]), torch.Size([64, 512])) for r in range(world)])
        for f in fqns
    })
    meta_blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    inline = len(meta_blob) * (world - 1) <= INLINE_METADATA_PADDING
    r = world // 2  # a typical rank's part (every part is padded to the largest anyway)
    full = RankReport(rank=r, node_id=nodes[r], slot=1, nbytes=tensors * 65536, results=tuple(
        WriteResult(index=MetadataIndex(f, torch.Size([r * 64, 0]), r), size_in_bytes=65536,
                    storage_data=ShardRef(r, i * 65536, 65536, 0x9E3779B9 + i, "crc32c", "bfloat16", (64, 512)))
        for i, f in enumerate(fqns)))
    compact = RankReport(rank=r, node_id=nodes[r], slot=1, nbytes=tensors * 65536, results=(),
                          checksums=tuple(0x9E3779B9 + i for i in range(tensors)), known_metadata=b"d" * 16,
                          basis=(1, world * tensors))
    full_b, compact_b = (pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL) for x in (full, compact))
    part_before = len(full_b) + (len(meta_blob) if inline else 0)
    before_bytes = world * part_before + (0 if inline else len(meta_blob))
    after_bytes = world * len(compact_b)

    def receive(parts: list[bytes]) -> None:
        for b in parts:
            pickle.loads(b)

    t_before, _ = _best(lambda: receive([full_b] * world + [meta_blob]), repeat)
    t_after, _ = _best(lambda: receive([compact_b] * world), repeat)
    return {"metadata_bytes": len(meta_blob), "metadata_inline_before": inline, "full_part_bytes": len(full_b),
            "compact_part_bytes": len(compact_b), "received_bytes": {"before": before_bytes, "after": after_bytes},
            "unpickle_s": {"before": t_before, "after": t_after},
            "ratios": {"bytes_after_vs_before": after_bytes / before_bytes, "unpickle_after_vs_before": t_after / t_before}}


def first_record(rec: Any, repeat: int) -> dict[str, Any]:
    """The first record of a layout in a process: the node leader's encode (layout pickled and its
    location digest computed once per layout), and a restoring process's decode, kept packed
    (now) vs materializing a MetadataIndex and a ShardRef per chunk (what decoding did before)."""
    from gemini_dcp.local import record_codec, record_types

    def cold() -> None:
        for cache in (record_types._layout_blobs, record_types._digests, record_types._positions, record_types._locations):
            cache._entries.clear()
        record_types._layouts_by_blob.clear()
        record_types._indexes.clear()

    def encode() -> bytes:
        cold()
        return record_codec.encode_record(rec)

    t_enc, blob = _best(encode, repeat)

    def decode(materialize: bool) -> Any:
        cold()
        sd = record_codec.decode_record(blob).metadata.storage_data
        return dict(sd.layout.items()) if materialize else sd

    t_packed, _ = _best(lambda: decode(False), repeat)
    t_mat, _ = _best(lambda: decode(True), repeat)
    return {"encode_s": t_enc, "decode_s": {"materialized": t_mat, "packed": t_packed},
            "ratios": {"decode_packed_vs_materialized": t_packed / t_mat}}


def report(rows: list[dict[str, Any]]) -> None:
    print(f"{'ranks':>6} {'chunks':>8} | {'save: expanded':>15} {'overlay':>9} {'ratio':>7} | "
          f"{'restore: expanded':>18} {'overlay':>9} {'ratio':>7} | {'view B (before)':>16}")
    for r in rows:
        s, q = r["save_s"], r["restore_s"]
        print(f"{r['world']:>6} {r['chunks']:>8} | {s['expanded'] * 1e3:>12.1f} ms {s['overlay'] * 1e3:>6.1f} ms "
              f"{r['ratios']['save_overlay_vs_expanded']:>7.3f} | {q['expanded'] * 1e3:>15.1f} ms {q['overlay'] * 1e3:>6.1f} ms "
              f"{r['ratios']['restore_overlay_vs_expanded']:>7.3f} | {r['view_bytes']:>6} ({r['view_bytes_before']})")
    print("save = commit bookkeeping + record encode (node leader) + decode (other ranks), per save on every rank;")
    print("restore = decode + fingerprint + one rank's chunk refs, per record at restore; ratios < 1: faster now.")
    print()
    print(f"{'ranks':>6} | plain dcp.save commit, received per rank: {'before':>10} {'after':>10} {'ratio':>7} | "
          f"{'unpickle before':>15} {'after':>9}")
    for r in rows:
        g = r["plain_gather"]
        b, u = g["received_bytes"], g["unpickle_s"]
        print(f"{r['world']:>6} | {'':>41} {b['before'] / 2**20:>7.1f} MB {b['after'] / 2**20:>7.2f} MB "
              f"{g['ratios']['bytes_after_vs_before']:>7.3f} | {u['before'] * 1e3:>12.1f} ms {u['after'] * 1e3:>6.1f} ms")
    print("before: every rank's full write results + the planned metadata; after: checksums only, metadata already held.")
    print()
    print(f"{'ranks':>6} | first record of a layout: encode (leader) | decode in a fresh process: materialized  packed  ratio")
    for r in rows:
        f = r["first_record"]
        print(f"{r['world']:>6} | {f['encode_s'] * 1e3:>38.0f} ms | {f['decode_s']['materialized'] * 1e3:>36.0f} ms "
              f"{f['decode_s']['packed'] * 1e3:>5.0f} ms {f['ratios']['decode_packed_vs_materialized']:>6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--tensors", type=int, default=900, help="tensors (chunks) per rank (default 900: a ~7B model with Adam)")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=RESULTS / "commit_scale.json")
    ap.add_argument("--png", type=Path, default=IMG / "bench_commit_scale.png")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = [measure(w, args.tensors, args.ranks_per_node, args.repeat) for w in args.world]
    report(rows)
    write_json(args.json, {"benchmark": "commit_scale", "machine": machine_info(), "config": vars(args) | {"json": str(args.json), "png": str(args.png)},
                           "rows": rows, "wall_s": time.perf_counter() - t0})
    labels, values, notes = [], [], []
    for r in rows:
        for kind in ("expanded", "overlay"):
            labels.append(f"{r['world']} ranks: save, {kind}")
            values.append(r["save_s"][kind] * 1e3)
            notes.append(f"{r['save_s'][kind] * 1e3:.1f} ms")
    bar_chart(args.png, labels, values, ylabel="ms per save (every rank)", annotate=notes,
              colors=["#C44E52", "#4C72B0"] * len(rows),
              title=f"Replayed-save commit bookkeeping, {args.tensors} tensors per rank (expanded results vs checksum overlay)")
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
