"""Step time of torchtitan's trainer with a checkpoint every step: gemini_dcp (blocking / AsyncCheckpointer)
against torchtitan's own DCP checkpoints (sync / ``async``) and no checkpoint, measured in the same run.

Runs ``examples/torchtitan/run_cpu.sh`` (llama3 debugmodel on CPU, 2 ranks, FSDP2 over gloo, seq 256 x batch 2
by default — the issue's reference setup —; 80 MB of model + optimizer state in all; torchtitan's default activation
checkpointing, selective, unless ``--ac`` says otherwise) once per variant and reads the time between consecutive
``step:`` log lines — one iteration: the previous step's checkpoint save plus this step's forward,
backward and optimizer step. torchtitan's folder lives under /dev/shm too, so every variant writes to memory.
Needs the torchtitan venv (examples/torchtitan/README.md)::

    PYTHONPATH=$PWD /work/venv-titan/bin/python benchmarks/bench_torchtitan.py [--steps 14] [--rounds 1] \
        [--seq-len 256] [--batch 2] [--ac none|full|selective] [--variants "no checkpoint" "gemini_dcp, AsyncCheckpointer"] [--out torchtitan]

Results: benchmarks/results/<out>.json, docs/img/torchtitan.png (default --out only; matplotlib if installed).
Small sizes on a shared 2-core CPU: medians, with min/max; ratios against the no-checkpoint run, overall and
paired per round (each run against the no-checkpoint run of its round, adjacent in time). The
``alternating blocks`` variants save in blocks of ``--block`` steps and not in the next ones, in one run
(launch.py's ``TITAN_GEMINI_BLOCKS``): iterations with and without a save under the same load, the comparison
least moved by other work on the host. gemini_dcp's per-save costs (state dict, ``save()``, background CPU,
copy and commit times, guard wait) are parsed from its log lines.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import IMG, REPO, RESULTS, bar_chart, machine_info, median, shm_dir, spread, write_json  # noqa: E402

SCRIPT = REPO / "examples" / "torchtitan" / "run_cpu.sh"
OVERRIDE = "gemini_dcp.integrations.torchtitan.gemini_checkpoint"
NEVER = 10**9

# name -> (env, extra torchtitan flags)
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "no checkpoint": ({}, ["--checkpoint.no-enable"]),
    "gemini_dcp, blocking": ({"INTERVAL": str(NEVER), "GEMINI_ASYNC": "false"}, []),
    "gemini_dcp, AsyncCheckpointer": ({"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true"}, []),
    # The same, with the copy in one burst (InterleaveOptions(spread=0)): the spread's A/B.
    "gemini_dcp, AsyncCheckpointer, spread 0": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_SPREAD": "0"}, []),
    # The training thread waits for the local copy after save() (the commit stays in the background).
    # Interleaving off: the copy as fast as possible even once the profile has found gaps (the integration's
    # default for a model on the CPU since 2026-11-27; before, it paced: the next variant).
    "gemini_dcp, AsyncCheckpointer, not paced": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_PACING": "0"}, []),
    "gemini_dcp, AsyncCheckpointer, paced": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_PACING": "1"}, []),
    # The copy paced into the collectives (busy periods) instead of the gaps between them.
    "gemini_dcp, AsyncCheckpointer, during": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_WHERE": "during", "TITAN_GEMINI_PACING": "1"}, []),
    # The background thread ahead of training (nice -10): each rank's save in one burst at save().
    "gemini_dcp, AsyncCheckpointer, nice -10": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_BG_NICE": "-10"}, []),
    "gemini_dcp, AsyncCheckpointer, copy waited": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_WAIT_COPY": "1"}, []),
    # One run, saves in alternating blocks of BLOCK steps: iterations with and without a save under the same load.
    "gemini_dcp, AsyncCheckpointer, alternating blocks": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_BLOCKS": "BLOCK"}, []),
    # The example pins each rank to its own CPUs (run_cpu.sh's PIN_CORES=1); these leave the ranks unpinned.
    "no checkpoint, unpinned": ({"PIN_CORES": "0"}, ["--checkpoint.no-enable"]),
    "gemini_dcp, AsyncCheckpointer, alternating blocks, unpinned": (
        {"INTERVAL": str(NEVER), "GEMINI_ASYNC": "true", "TITAN_GEMINI_BLOCKS": "BLOCK", "PIN_CORES": "0"}, []),
    "torchtitan DCP, sync": ({"INTERVAL": "1"}, ["--override.imports", f'{OVERRIDE}={{"gemini_every": {NEVER}}}']),
    "torchtitan DCP, async": ({"INTERVAL": "1"}, ["--override.imports", f'{OVERRIDE}={{"gemini_every": {NEVER}}}',
                                                 "--checkpoint.async_mode", "async"]),
}

# gemini_dcp's per-save line (integrations/torchtitan.py): the training thread's part, and the last finished
# save's background part.
SNAP_LINE = re.compile(r"gemini_dcp: step (\d+) snapshot: state dict ([\d.]+) ms \(CPU ([\d.]+) ms;.*?save\(\) ([\d.]+) ms"
                       r"(?:; step \d+: copied in ([\d.]+) ms, committed in ([\d.]+) ms, background CPU ([\d.]+) ms, "
                       r"training waited ([\d.]+) ms)?")
SNAP_FIELDS = ("state_dict_ms", "state_dict_cpu_ms", "save_call_ms", "copied_ms", "committed_ms", "background_cpu_ms",
               "guard_wait_ms")
STEP_LINE = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step:\s+(\d+)\s")


def step_times(log: str) -> dict[int, float]:
    """First time each step's metrics line was logged (either rank)."""
    out: dict[int, float] = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        m = STEP_LINE.match(line)
        if m and int(m.group(2)) not in out:
            out[int(m.group(2))] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def save_costs(log: str, first: int = 3) -> dict[str, list[float]]:
    """gemini_dcp's per-save costs from its log lines (both ranks; steps after the warm-up)."""
    out: dict[str, list[float]] = {f: [] for f in SNAP_FIELDS}
    for m in SNAP_LINE.finditer(re.sub(r"\x1b\[[0-9;]*m", "", log)):
        if int(m.group(1)) <= first:
            continue
        for f, v in zip(SNAP_FIELDS, m.groups()[1:]):
            if v is not None:
                out[f].append(float(v))
    return out


def run_variant(name: str, steps: int, scratch: Path, i: int, shape: dict[str, str],
                costs: dict[str, list[float]] | None = None, blocks: dict[str, list[float]] | None = None,
                block: int = 4, first: int = 3) -> list[float]:
    env_extra, flags = VARIANTS[name]
    env_extra = {k: (str(block) if v == "BLOCK" else v) for k, v in env_extra.items()}
    out = scratch / f"v{i}"
    root = scratch / f"tier{i}"
    root.mkdir(mode=0o700)
    env = dict(os.environ, PYTHON=sys.executable, GEMINI_DCP_ROOT=str(root), JOB_ID=f"bench-{i}", STEPS=str(steps),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **shape, **env_extra)
    proc = subprocess.run(["bash", str(SCRIPT), str(out), *flags], env=env, text=True, capture_output=True,
                          timeout=900, cwd=REPO)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: run failed\n{log[-3000:]}")
    t = step_times(log)
    if costs is not None:
        for f, v in save_costs(log, first).items():
            costs.setdefault(f, []).extend(v)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    its = {s: t[s + 1] - t[s] for s in range(first, steps) if s in t and s + 1 in t}  # steps 1..first: warm-up
    block = int(env.get("TITAN_GEMINI_BLOCKS", "0"))
    if block and blocks is not None:  # iteration s -> s+1 carries the save of step s (and its background copy)
        def saved(s: int) -> bool:
            return ((s - 1) // block) % 2 == 0

        blocks["on"] += [v for s, v in its.items() if saved(s)]
        blocks["off"] += [v for s, v in its.items() if not saved(s) and not saved(s - 1)]  # no spill-over
    return list(its.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the variants (interleaved)")
    ap.add_argument("--alternate", action="store_true", help="reverse the variants' order every other round (ABBA)")
    ap.add_argument("--seq-len", type=int, default=256, help="training.seq_len (the issue's reference: 256)")
    ap.add_argument("--batch", type=int, default=2, help="training.local_batch_size")
    ap.add_argument("--ac", default="", choices=["", "none", "full", "selective"],
                    help="activation checkpointing (run_cpu.sh's AC); default: torchtitan's own (selective for llama3)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="the variants to run ('no checkpoint' is always run: the ratios are against it)")
    ap.add_argument("--out", default="torchtitan", help="results/<out>.json and img/<out>.png")
    ap.add_argument("--block", type=int, default=4, help="steps per block of the 'alternating blocks' variants")
    ap.add_argument("--measure-from", type=int, default=3,
                    help="iterations from this step on are measured (the first are warm-up); 30 with --steps 45: only "
                         "after AsyncCheckpointer's interleaving profile (3 + 20 iterations) is done")
    args = ap.parse_args()
    names = ["no checkpoint", *(n for n in args.variants if n != "no checkpoint")]
    shape = {"SEQ_LEN": str(args.seq_len), "LOCAL_BATCH": str(args.batch), "AC": args.ac}
    scratch = shm_dir("bench_titan_")
    assets = scratch / "assets-src"
    subprocess.run([sys.executable, str(SCRIPT.parent / "make_assets.py"), str(assets)], check=True, capture_output=True)
    samples: dict[str, list[float]] = {n: [] for n in names}
    per_round: dict[str, list[float | None]] = {n: [] for n in names}  # each run's median
    costs: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    blocks: dict[str, dict[str, list[float]]] = {n: {"on": [], "off": []} for n in names}
    load_before = os.getloadavg()
    i = 0
    t0 = time.time()
    for rnd in range(args.rounds):
        # --alternate: every other round runs the variants in reverse order (ABBA), so a bias of the position in
        # a round (the host's load drifting, the page cache) weighs on every variant alike.
        for name in (names[::-1] if args.alternate and rnd % 2 else names):
            i += 1
            (scratch / f"v{i}").mkdir()
            shutil.copytree(assets, scratch / f"v{i}" / "assets")
            got = run_variant(name, args.steps, scratch, i, shape, costs[name], blocks[name], args.block,
                              args.measure_from)
            samples[name] += got
            per_round[name].append(median(got))
            print(f"{name:32s} median {median(samples[name]):.3f} s/step", flush=True)
    base = median(samples["no checkpoint"])
    ac = args.ac or "torchtitan's default (selective)"
    rows = {}
    for n, v in samples.items():
        # Paired: each run against the no-checkpoint run of the same round (adjacent in time), then the median.
        ratios = [a / b for a, b in zip(per_round[n], per_round["no checkpoint"]) if a and b]
        rows[n] = {"median_s": median(v), "min_max_s": spread(v), "n": len(v),
                   "ratio_vs_no_checkpoint": (median(v) / base) if base and v else None,
                   "paired_ratio_median": median(ratios), "paired_ratios": ratios, "run_medians_s": per_round[n],
                   "save_costs_median_ms": {f: median(x) for f, x in costs[n].items() if x}, "samples_s": v}
        on, off = blocks[n]["on"], blocks[n]["off"]
        if on and off:  # the same run's iterations with and without a save
            rows[n]["blocks"] = {"block_steps": args.block, "with_save_median_s": median(on),
                                 "without_save_median_s": median(off), "ratio": median(on) / median(off),
                                 "with_save_s": on, "without_save_s": off}
    data = {
        "what": f"torchtitan llama3 debugmodel on CPU, 2 ranks FSDP2/gloo, seq {args.seq_len} x batch {args.batch}, "
                f"activation checkpointing {ac}, checkpoint every step; iteration time = previous save + this step "
                f"(steps {args.measure_from + 1}..N)",
        "seq_len": args.seq_len, "local_batch": args.batch, "activation_checkpointing": ac,
        "state_bytes_total": 80_059_650, "steps": args.steps, "measure_from": args.measure_from, "rounds": args.rounds, "alternate": args.alternate, "wall_s": time.time() - t0,
        "command": " ".join(sys.argv), "loadavg_before": load_before, "machine": machine_info(), "variants": rows,
    }
    write_json(RESULTS / f"{args.out}.json", data)
    try:
        if args.out != "torchtitan":
            raise ImportError  # side runs (A/B files) get no plot in docs/img
        labels = list(rows)
        bar_chart(IMG / f"{args.out}.png", labels, [rows[n]["median_s"] for n in labels],
                  errors=[rows[n]["min_max_s"] for n in labels], ylabel="s / iteration",
                  title=f"torchtitan debugmodel, CPU 2 ranks, seq {args.seq_len} x {args.batch}, AC {args.ac or 'selective'}: "
                        "a checkpoint every step",
                  annotate=[f"{rows[n]['median_s']:.3f} s ({rows[n]['ratio_vs_no_checkpoint']:.2f}x)" for n in labels])
    except ImportError:
        print("no plot (matplotlib not installed, or --out is not the default)")
    for n, r in rows.items():
        print(f"{n:32s} {r['median_s']:.3f} s  {r['ratio_vs_no_checkpoint']:.3f}x  paired {r['paired_ratio_median']:.3f}x "
              f"{[round(x, 3) for x in r['paired_ratios']]}  (min/max {r['min_max_s']})")
        if "blocks" in r:
            b = r["blocks"]
            print(f"{'':32s} same run, blocks of {b['block_steps']}: with a save {b['with_save_median_s']:.3f} s, "
                  f"without {b['without_save_median_s']:.3f} s: {b['ratio']:.3f}x (n={len(b['with_save_s'])}/"
                  f"{len(b['without_save_s'])})")
        if r["save_costs_median_ms"]:
            print(f"{'':32s} per save (medians, ms): {r['save_costs_median_ms']}")


if __name__ == "__main__":
    main()
