"""What a restore says about health: the unhealthy steps it passed over, an unhealthy step asked for.

The choice itself is :func:`gemini_dcp.core.restore_order.decide` (the newest healthy restorable
step unless one is requested); this module holds the reader's messages and the persistent tier's
part (the health the drain stored beside the stock layout). Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["persisted_unhealthy", "warn_health"]

log = logging.getLogger("gemini_dcp.dcp.reader")


def persisted_unhealthy(store: Any, steps: Sequence[int]) -> list[int]:
    """Those of ``steps`` the persistent ``store`` holds marked unhealthy (a store without health: none)."""
    fn = getattr(store, "unhealthy_steps", None)
    if fn is None:
        return []
    try:
        return sorted(int(s) for s in fn(steps))
    except Exception as exc:  # noqa: BLE001 - health is advisory for the store's steps: restore goes on
        log.warning("could not read the health of the persistent tier's steps: %s", exc)
        return []


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
