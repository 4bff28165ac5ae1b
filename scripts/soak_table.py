"""The feature soak's tables for docs/reliability.md, made from benchmarks/results/soak.json.

    python scripts/soak_table.py            # rewrite the block between the markers in docs/reliability.md
    python scripts/soak_table.py --print    # print it instead

The block sits between ``<!-- soak-table:start -->`` and ``<!-- soak-table:end -->``; run this
again whenever the soak (``scripts/soak.sh``) has added trials.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "soak.json"
DOC = REPO / "docs" / "reliability.md"
START, END = "<!-- soak-table:start -->", "<!-- soak-table:end -->"
OUTCOMES = ("pass", "fail", "known", "hang", "harness-error")
SHOWN_FAILURES = 25


def _row(name: str, counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return f"| `{name}` | {total} | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |"


def _table(title: str, by: dict[str, dict[str, int]], keys: list[str]) -> list[str]:
    head = f"| {title} | trials | " + " | ".join(OUTCOMES) + " |"
    return [head, "|---|---:|" + "---:|" * len(OUTCOMES)] + [_row(k, by.get(k, {})) for k in keys]


def _fault_order(key: str) -> tuple[int, str]:
    kinds = ("signal:", "phase:", "fired:", "wipe", "flip", "enospc", "stale_lock", "none")
    return next((i for i, k in enumerate(kinds) if key.startswith(k)), len(kinds)), key


def render(doc: dict[str, Any]) -> str:
    """The Markdown block of a results file."""
    trials = doc.get("trials", 0)
    outcomes = doc.get("outcomes", {})
    seconds = doc.get("seconds", 0.0)
    runs = doc.get("runs", [])
    lines = [
        f"**{trials} trials** in {len(runs)} run(s) of `scripts/soak.sh` "
        f"(file `benchmarks/results/soak.json`; {seconds / max(trials, 1):.1f} s a trial, wall time of the "
        "trial itself, several soaks side by side on the shared 2-core development machine). Outcomes: "
        + ", ".join(f"{o} {outcomes.get(o, 0)}" for o in OUTCOMES) + ". "
        "`known`: a failure since explained (its `known` field says how: an open issue, a documented "
        "limit, or a fixed harness error); a failing trial is rerun at once (`rerun`); "
        "`harness-error`: the harness itself failed, not the library.",
        "",
        "Trials per feature value (every trial draws every feature):",
        "",
    ]
    by_feature = doc.get("by_feature", {})
    lines += _table("feature=value", by_feature, sorted(by_feature))
    by_fault = doc.get("by_fault", {})
    faults = doc.get("faults", {})
    lines += ["", "Signals at a named phase, each signal's cell *drawn / fired* (`fired`: the process reached the "
                  "phase and the signal hit it; the rest drew a phase their features never reached, e.g. a restore "
                  "phase after a training fault that left nothing to restore):", ""]
    sigs = ("SIGKILL", "SIGTERM", "SIGSTOP")
    lines += ["| phase | trials | " + " | ".join(sigs) + " | fired | " + " | ".join(OUTCOMES) + " |",
              "|---|---:|" + "---:|" * (len(sigs) + 1 + len(OUTCOMES))]
    phases = sorted({k.split(":")[1] for k in by_fault if k.startswith("phase:")})
    for ph in phases:
        counts = by_fault.get(f"phase:{ph}", {})
        fired = sum(faults.get(f"fired:{ph}:{s}", 0) for s in sigs)
        lines.append(f"| `{ph}` | {sum(counts.values())} | " + " | ".join(
            f"{faults.get(f'phase:{ph}:{s}', 0)} / {faults.get(f'fired:{ph}:{s}', 0)}" for s in sigs)
                     + f" | {fired} | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
    for s_ in sigs:
        counts = by_fault.get(f"signal:{s_}", {})
        lines.append(f"| all, {s_} | {sum(counts.values())} | " + " | ".join(
            str(sum(counts.values())) if x == s_ else "" for x in sigs) + " | "
            + str(sum(v for k, v in faults.items() if k.startswith("fired:") and k.endswith(s_))) + " | "
            + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
    lines += ["", "The other faults:", ""]
    others = sorted((k for k in by_fault if not k.startswith(("phase:", "signal:", "fired:"))), key=_fault_order)
    lines += _table("fault", by_fault, others)
    ev = doc.get("events", {})
    if ev:
        lines += ["", "What the trials really did (summed over trials; rank 0's journal events, errors by name, "
                      "the tiers restores came from, `fast_load`'s path, bits flipped, tmpfs mounted): "
                  + ", ".join(f"`{k}` {v}" for k, v in sorted(ev.items())) + "."]
    failures = doc.get("failures", [])
    lines += ["", f"Failures ({len(failures)} kept; the newest {min(len(failures), SHOWN_FAILURES)} shown). "
                  "Reproduce one with `PYTHONPATH=. python tests/soak_trials.py --seed-only SEED`:", ""]
    if not failures:
        lines.append("- none")
    for f in failures[-SHOWN_FAILURES:]:
        detail = re.sub(r"\s+", " ", str(f.get("detail", "")))[:260].replace("|", "/")
        known = f" (known: {f['known']})" if f.get("known") else ""
        lines.append(f"- seed {f['seed']}: {f.get('fault')}: **{f.get('outcome')}**{known} — {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--print", action="store_true", help="print the block instead of rewriting the doc")
    args = ap.parse_args(argv)
    block = render(json.loads(Path(args.results).read_text()))
    if args.print:
        print(block)
        return 0
    doc = Path(args.doc)
    text = doc.read_text()
    if START not in text or END not in text:
        print(f"{doc}: no {START} ... {END} block to replace", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{block}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
