"""The health baseline: which healthy step a save is judged against, agreed by every rank.

A step's health (:mod:`.rule`) compares its counts with those of the *baseline*, the newest
healthy step of the job. Where each rank looked the baseline up alone (its own node's records),
a replaced node (no records) judged its first poisoned save healthy while the others did not.
So the baseline is agreed, never read per node:

- every rank proposes a :data:`Baseline`, ``(step, ((fqn, total), ...))``, in its commit report:
  the newest of the step its writer last saw judged (the agreed baseline, or the step itself when
  healthy), the newest healthy record below the step on its own node (read once per writer), and
  a step restored in this process (:func:`note_restored`);
- every rank takes the newest proposal of all the reports (:func:`agree`), so the verdict is the
  same on every rank and in every node's record: one node that still knows the job's newest
  healthy step is enough;
- a restore hands the restored step's counts to the writers of the job in this process (local,
  a peer's record, XOR parity, or the persistent tier's ``health.json``): after a node lost its
  memory, the first save is still judged against the step it resumed from. A restored step
  replaces what the writer knew (a rollback goes back to an older step on purpose).

The handoff is per process, tier root and job id (a module-level table: never another job's, nor
the same job id's in another root). Pure apart from that table; torch-free.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Baseline", "agree", "baseline_of", "note_restored", "restored_baseline", "valid_counts"]

#: (step, ((fqn, total over the ranks), ...) sorted by fqn) of a healthy step.
Baseline = tuple[int, tuple[tuple[str, int], ...]]

_LOCK = threading.Lock()
_SEQ = itertools.count(1)
_RESTORED: dict[tuple[str, str], tuple[int, Baseline]] = {}  # (root, job id) -> (handoff number, restored step's baseline)


def baseline_of(step: int, totals: Mapping[str, int]) -> Baseline:
    """The baseline of healthy ``step`` whose items hold ``totals`` (fqn -> non-finite values)."""
    return int(step), tuple(sorted((str(f), int(n)) for f, n in totals.items() if n))


def agree(proposals: Iterable[Baseline | None]) -> Baseline | None:
    """The newest of every rank's proposals (ties, which equal records never produce, broken by the
    counts, so every rank picks the same one); None when no rank knows a healthy step."""
    known = [p for p in proposals if p is not None]
    return max(known) if known else None


def valid_counts(raw: Any) -> tuple[tuple[int, str, int], ...] | None:
    """``raw`` (read back from a store, hence untrusted) as ``(rank, fqn, count)`` triples; None when malformed."""
    if not isinstance(raw, (list, tuple)):
        return None
    out = []
    for c in raw:
        if (not isinstance(c, (list, tuple)) or len(c) != 3 or type(c[0]) is not int or not isinstance(c[1], str)
                or type(c[2]) is not int or c[2] < 0):
            return None
        out.append((c[0], c[1], c[2]))
    return tuple(out)


def note_restored(root: str | os.PathLike[str], job_id: str, baseline: Baseline) -> None:
    """A restore in this process loaded healthy step ``baseline[0]`` of ``job_id`` (tier root ``root``):
    the job's writers judge their next save against it (it replaces what they knew)."""
    with _LOCK:
        _RESTORED[(os.path.realpath(root), job_id)] = (next(_SEQ), baseline)


def restored_baseline(root: str | os.PathLike[str], job_id: str) -> tuple[int, Baseline] | None:
    """The last :func:`note_restored` of ``job_id`` in ``root`` in this process: (its number, the baseline); None: none."""
    with _LOCK:
        return _RESTORED.get((os.path.realpath(root), job_id))
