"""The summary of ``scripts/main_job.sh``: what checkpointing every step cost, the resume, the equality.

Reads the logs of the job's runs (``examples/train_fsdp2.py`` prints one line per step with
``wall <ms>``: the whole step, training plus checkpointing, as the training loop sees it):

- the baselines: the same run without checkpoints, uninterrupted (run before and after the main run,
  so that a change of the machine's load during the job falls on both sides of the comparison);
- the main run: ``AsyncCheckpointer`` every step, a rank SIGKILLed mid-run, torchrun's restart and the
  resume from memory.

The cost per step: the time the training loop waited for checkpointing, measured in the main run
(``save()`` and the guard in the next optimizer step), against the baseline's step; and the step time
against the baseline, paired by step (the median over the steps of main run's step - baseline's same step),
next to the difference between the two baseline runs (the host's own noise: on a shared machine it can
exceed the cost). The steps right after each start (warm-up: the first save builds the snapshot's
structures) are left out. Equality: the final parameters' sha256 and every step's loss (bit-exact, from ``--loss-log``).

    python examples/main_job_summary.py --main LOG --main-loss FILE --baseline LOG FILE [--baseline LOG FILE]

Exits 1 when the main run never resumed or differs from the uninterrupted run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

STEP = re.compile(r"^step +(\d+) +loss \S+ +iter ([\d.]+) ms(?: +ckpt ([\d.]+) ms(?: \(save [\d.]+, guard [\d.]+\))?)? +wall ([\d.]+) ms", re.M)
ATTEMPT = re.compile(r"attempt (\d+);")
WARMUP = 2  # steps left out after each start


def steps(log: str) -> tuple[dict[int, float], list[float]]:
    """step -> wall ms (the last attempt's value for a re-run step), and the ckpt ms of every step, warm-up
    steps of each attempt left out."""
    wall: dict[int, float] = {}
    ckpt: list[float] = []
    for part in ATTEMPT.split(log)[2::2] or [log]:  # the text of each attempt
        for i, m in enumerate(STEP.finditer(part)):
            if i < WARMUP:
                continue
            wall[int(m.group(1))] = float(m.group(4))
            if m.group(3) is not None:
                ckpt.append(float(m.group(3)))
    return wall, ckpt


def losses(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        step, hexloss = line.split()
        out[int(step)] = hexloss  # a re-run step overwrites: the resumed run's value counts
    return out


def params_hash(log: str) -> str | None:
    got = re.findall(r"final params sha256 ([0-9a-f]+)", log)
    return got[-1] if got else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--main", type=Path, required=True, help="the main run's log")
    p.add_argument("--main-loss", type=Path, required=True, help="the main run's --loss-log")
    p.add_argument("--baseline", type=Path, nargs=2, action="append", required=True, metavar=("LOG", "LOSS"),
                   help="a baseline run's log and --loss-log (given once per baseline run)")
    a = p.parse_args(argv)
    main_log = a.main.read_text()
    base_logs = [log.read_text() for log, _ in a.baseline]
    main_wall, ckpt = steps(main_log)
    base = [steps(log)[0] for log in base_logs]
    paired = sorted(set(main_wall).intersection(*base))
    ok = True
    print("== summary")
    if paired:
        base_ms = [statistics.fmean(b[s] for b in base) for s in paired]
        main_ms = [main_wall[s] for s in paired]
        diff = statistics.median(m - b for m, b in zip(main_ms, base_ms))
        b_med = statistics.median(base_ms)
        each = [statistics.median(b[s] for s in paired) for b in base]
        noise = (max(each) - min(each)) / b_med if len(each) > 1 else 0.0
        print(f"checkpointing: AsyncCheckpointer, a save every step into node memory ({len(paired)} steps compared)")
        print(f"  step time, median: {statistics.median(main_ms):.1f} ms with checkpoints, {b_med:.1f} ms without "
              f"(the same run without checkpoints, before and after: {' / '.join(f'{m:.1f}' for m in each)} ms)")
        if ckpt:
            waited = statistics.median(ckpt)
            print(f"  cost of checkpointing per step, measured in the run: training waited {waited:.2f} ms for it "
                  f"(save() + the guard in the next optimizer step) = {100 * waited / b_med:.1f}% of the baseline step")
        verdict = "within the host's noise" if abs(diff) <= noise * b_med else "outside the host's noise"
        print(f"  step time against the baseline (paired by step, median): {diff:+.1f} ms ({100 * diff / b_med:+.1f}%); "
              f"the two baseline runs differ by {100 * noise:.1f}%: {verdict}")
    else:
        print("no steps to compare (see the logs)")
    for line in main_log.splitlines():
        if "injected failure" in line:
            print("failure:", line.strip())
    resumed = [ln.strip() for ln in main_log.splitlines() if ln.startswith("resumed from step")]
    if resumed:
        print("resume:", *resumed)
    else:
        print("resume: the main run never resumed from a checkpoint", file=sys.stderr)
        ok = False
    want, got = params_hash(base_logs[0]), params_hash(main_log)
    ref_loss, run_loss = losses(a.baseline[0][1]), losses(a.main_loss)
    same_params = want is not None and want == got
    same_loss = bool(ref_loss) and ref_loss == run_loss
    print(f"equal to the uninterrupted run: final parameters {'identical' if same_params else 'DIFFER'} "
          f"(sha256 {(got or '?')[:16]}...), losses of all {len(run_loss)} steps "
          f"{'bit-identical' if same_loss else 'DIFFER'}")
    return 0 if ok and same_params and same_loss else 1


if __name__ == "__main__":
    sys.exit(main())
