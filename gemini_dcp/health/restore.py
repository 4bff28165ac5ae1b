"""What a restore says about health: the unhealthy steps it passed over, an unhealthy step asked for.

The choice itself is :func:`gemini_dcp.core.restore_order.decide` (the newest healthy restorable
step unless one is requested); this module holds the reader's messages and the persistent tier's
part (the health the drain stored beside the stock layout). Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .baseline import Baseline, baseline_of, note_restored, valid_counts
from .rule import totals

__all__ = ["hand_off", "persisted_health", "warn_health"]

log = logging.getLogger("gemini_dcp.dcp.reader")


def persisted_health(store: Any, steps: Sequence[int]) -> tuple[list[int], dict[int, Baseline]]:
    """The health the persistent ``store`` holds for ``steps``: (those marked unhealthy, the baseline
    of each one marked healthy). A step without health counts as healthy, without a baseline."""
    fn = getattr(store, "step_health", None)
    bad: list[int] = []
    good: dict[int, Baseline] = {}
    if fn is None:
        return bad, good
    try:
        for s in steps:
            data = fn(s)
            if data is None:
                continue
            if not data["healthy"]:
                bad.append(int(s))
                continue
            counts = valid_counts(data.get("nonfinite", []))
            if counts is None:
                log.warning("step %s of the persistent tier: its health.json lists malformed counts; ignored", s)
            else:
                good[int(s)] = baseline_of(s, totals(counts))
    except Exception as exc:  # noqa: BLE001 - health is advisory for the store's steps: restore goes on
        log.warning("could not read the health of the persistent tier's steps: %s", exc)
    return sorted(bad), good


def hand_off(root: Any, job_id: str, step: int, record: Any, persisted: dict[int, Baseline]) -> None:
    """Hand the restored ``step``'s counts to this process's writers of ``job_id`` in tier root ``root``
    (:func:`gemini_dcp.health.baseline.note_restored`): from its step ``record`` (local, peer, parity),
    else from the persistent tier's health (``persisted``); nothing for a step not checked, or unhealthy."""
    if record is not None:
        if getattr(record, "healthy", None) is True:
            note_restored(root, job_id, baseline_of(step, totals(getattr(record, "nonfinite", ()))))
    elif step in persisted:
        note_restored(root, job_id, persisted[step])


def warn_health(decision: Any, views: Sequence[Any], persisted_bad: Sequence[int], requested: int | None,
                job_id: str, rank: int) -> None:
    """Rank 0: log the unhealthy steps ``decision`` passed over, or that a requested step is unhealthy."""
    if rank != 0:
        return
    bad = {sv.step for v in views for sv in v.steps if sv.unhealthy} | set(persisted_bad)
    if requested is not None and requested in bad:
        log.warning(
            "job %r: loading step %s as asked, though its save marked it unhealthy (it holds NaN/Inf values the "
            "newest healthy step did not); omit checkpoint_id to restore the newest healthy step.", job_id, requested,
        )
    elif decision.skipped_unhealthy:
        log.warning(
            "job %r: passed over unhealthy steps %s (NaN/Inf values the newest healthy step did not hold); "
            "restoring step %s, the newest healthy one. Load one of them explicitly with checkpoint_id.",
            job_id, list(decision.skipped_unhealthy), decision.step,
        )
