"""The async bound under kills: ``examples/accelerate_resume.py --async-save`` with few-millisecond steps
(``--width 16 --batch 8``: a step is much shorter than a save's commit), SIGKILLed ``--runs`` times during step
``--fail-at`` (the last rank, before its optimizer step) and restarted by torchrun.

Per run: the last step whose ``save()`` returned on any rank before the kill (every rank's ``--save-log``), the step
resumed, whether the bound held (resumed >= that step - 1: docs/async.md, "The bound") and whether every loss and
the final parameters equal one uninterrupted run's. Not a timing: the outcome of each kill. Run it from the venv
of scripts/integrations_venv.sh (issue 51)::

    PYTHONPATH=$PWD $(bash scripts/integrations_venv.sh | tail -1) benchmarks/bench_async_bound.py --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402
from integration_runs import launch, losses, private_tier_root  # noqa: E402

SCRIPT = str(REPO / "examples" / "accelerate_resume.py")
SMALL = ["--width", "16", "--batch", "8"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fail-at", type=int, default=9)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async-bound.json"))
    p.add_argument("--keep-logs", default=None, help="copy the log and save log of every run where the bound broke here")
    args = p.parse_args()
    rows = []
    with private_tier_root("bench_bound_") as root:
        scratch = root / "runs"
        ref = scratch / "ref"
        r = launch(root, ref, SCRIPT, "--job-id", "ref", "--steps", str(args.steps), *SMALL)
        if r.returncode:
            raise SystemExit(r.stdout[-3000:] + r.stderr[-3000:])
        want, final = losses(ref), torch.load(ref / "final.pt", weights_only=True)
        for i in range(args.runs):
            out = scratch / f"kill{i}"
            load = os.getloadavg()[0]
            r = launch(root, out, SCRIPT, "--job-id", f"kill{i}", "--steps", str(args.steps), *SMALL, "--async-save",
                       "--fail-at-step", str(args.fail_at), "--save-log", str(out / "saves"), restarts=1)
            log = r.stdout + r.stderr
            saves = [line.split() for line in (out / "saves").read_text().splitlines()]
            last = max(int(step) for attempt, _, step, _ in saves if attempt == "0")
            resumed = next((int(ln.split()[3]) for ln in log.splitlines() if ln.startswith("resumed from step ")), None)
            exact = r.returncode == 0 and losses(out) == want
            if exact:
                got = torch.load(out / "final.pt", weights_only=True)
                exact = all(torch.equal(got[k], final[k]) for k in final)
            row = {"run": i, "rc": r.returncode, "last_returned_save": last, "resumed": resumed,
                   "bound_held": resumed is not None and resumed >= last - 1, "bit_exact": exact, "load": load}
            rows.append(row)
            if args.keep_logs and not row["bound_held"]:
                keep = Path(args.keep_logs) / f"run{i}"
                keep.mkdir(parents=True, exist_ok=True)
                (keep / "log").write_text(log)
                (keep / "saves").write_text((out / "saves").read_text())
            print(json.dumps(row), flush=True)
    summary = {"runs": len(rows), "bound_held": sum(r["bound_held"] for r in rows),
               "bit_exact": sum(r["bit_exact"] for r in rows),
               "outcomes": {f"last save {a}, resumed {b}": sum(1 for r in rows if (r["last_returned_save"], r["resumed"]) == (a, b))
                            for a, b in sorted({(r["last_returned_save"], r["resumed"]) for r in rows}, key=str)}}
    print(json.dumps(summary), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
                                          "summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
