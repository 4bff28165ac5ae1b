"""Draw where the checkpoint's device-to-host copies land in a profiled GPU training step (issue 20).

    python benchmarks/plot_gpu_trace.py TRACE.json[.gz] --png docs/img/gpu_step_trace.png --json out.json

Reads the Chrome trace that ``bench_async.py --device cuda --trace`` writes (``torch.profiler``:
2 plain steps, then 2 steps each followed by an ``AsyncCheckpointer`` save, annotated
``bench.step<i>.plain|checkpointed``) and reports, per step: its wall time, the time GPU compute
kernels ran, NCCL kernels, device-to-host copies (time, bytes, how much of it overlapped compute
kernels), and the optimizer step's CPU time (where the AsyncCheckpointer guard would wait). The
plot shows the GPU lanes (compute, NCCL, D2H, H2D) across the steps.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

Span = tuple[float, float]


def load(path: Path) -> list[dict[str, Any]]:
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def merged(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def total(spans: list[Span]) -> float:
    return sum(b - a for a, b in merged(spans))


def overlap(spans: list[Span], cover: list[Span]) -> float:
    """Time of ``spans`` (merged) that lies inside ``cover`` (merged)."""
    cov = merged(cover)
    got = 0.0
    for a, b in merged(spans):
        for c, d in cov:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                got += hi - lo
    return got


def clip(spans: list[Span], lo: float, hi: float) -> list[Span]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def classify(events: list[dict[str, Any]]) -> dict[str, Any]:
    lanes: dict[str, list[Span]] = {"compute": [], "nccl": [], "d2h": [], "h2d": []}
    d2h_bytes: list[tuple[float, float, int]] = []
    steps: list[tuple[str, float, float]] = []
    opt: list[Span] = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        cat, name = e.get("cat", ""), e.get("name", "")
        span = (ts, ts + dur)
        if cat == "kernel":
            lanes["nccl" if "nccl" in name.lower() else "compute"].append(span)
        elif cat == "gpu_memcpy":
            if "DtoH" in name:
                lanes["d2h"].append(span)
                d2h_bytes.append((ts, ts + dur, int((e.get("args") or {}).get("bytes", 0))))
            elif "HtoD" in name:
                lanes["h2d"].append(span)
        elif cat == "user_annotation" and name.startswith("bench.step"):
            steps.append((name, ts, ts + dur))
        elif cat in ("cpu_op", "user_annotation") and name.startswith("Optimizer.step#"):
            opt.append(span)
    steps.sort(key=lambda s: s[1])
    return {"lanes": lanes, "d2h_bytes": d2h_bytes, "steps": steps, "opt": opt}


def summarize(c: dict[str, Any]) -> dict[str, Any]:
    lanes = c["lanes"]
    per_step = []
    for name, lo, hi in c["steps"]:
        comp = clip(lanes["compute"], lo, hi)
        d2h = clip(lanes["d2h"], lo, hi)
        per_step.append({
            "step": name,
            "wall_ms": (hi - lo) / 1e3,
            "compute_ms": total(comp) / 1e3,
            "nccl_ms": total(clip(lanes["nccl"], lo, hi)) / 1e3,
            "d2h_ms": total(d2h) / 1e3,
            "d2h_bytes": sum(n for a, b, n in c["d2h_bytes"] if lo <= a < hi),
            "d2h_overlapping_compute_ms": overlap(d2h, comp) / 1e3,
            "optimizer_step_cpu_ms": sum(b - a for a, b in clip(c["opt"], lo, hi)) / 1e3,
        })
    all_d2h = lanes["d2h"]
    return {
        "steps": per_step,
        "d2h_total_ms": total(all_d2h) / 1e3,
        "d2h_total_bytes": sum(n for _, _, n in c["d2h_bytes"]),
        "d2h_overlapping_compute_ms": overlap(all_d2h, lanes["compute"]) / 1e3,
        "d2h_gbps": (sum(n for _, _, n in c["d2h_bytes"]) / (total(all_d2h) / 1e6) / 1e9) if all_d2h else None,
    }


def plot(c: dict[str, Any], s: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = c["lanes"]
    steps = c["steps"]
    t0 = steps[1][1] if len(steps) > 1 else min((a for v in lanes.values() for a, _ in v), default=0.0)
    t1 = max([b for v in lanes.values() for _, b in v] + [steps[-1][2] if steps else 0.0])
    fig, ax = plt.subplots(figsize=(12, 3.2))
    colors = {"compute": "#4C72B0", "nccl": "#55A868", "d2h": "#DD8452", "h2d": "#8172B3"}
    names = ["compute", "nccl", "d2h", "h2d"]
    for row, lane in enumerate(names):
        spans = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in merged(clip(lanes[lane], t0, t1))]
        ax.broken_barh(spans, (row - 0.4, 0.8), color=colors[lane])
    for name, lo, hi in steps:
        if hi < t0:
            continue
        ax.axvline((lo - t0) / 1e3, color="k", lw=0.6, ls="--")
        ax.text((lo - t0) / 1e3, len(names) - 0.4, name.replace("bench.", ""), fontsize=7, va="bottom")
    ax.set_yticks(range(len(names)), ["GPU compute", "NCCL", "D2H (checkpoint)", "H2D"])
    ax.set_xlabel("ms")
    ax.set_ylim(-0.6, len(names) + 0.2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--title", default="one plain and two checkpointed training steps (torch.profiler)")
    args = ap.parse_args()
    c = classify(load(args.trace))
    s = summarize(c)
    print(json.dumps(s, indent=1))
    if args.json:
        args.json.write_text(json.dumps(s, indent=1) + "\n")
    if args.png:
        plot(c, s, args.png, args.title)


if __name__ == "__main__":
    main()
