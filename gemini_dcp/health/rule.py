"""The health rule of a step, decided identically on every rank from the commit gather.

Every rank's report carries its items' non-finite counts (:mod:`.count`; only the items with
any). A step is **unhealthy** when some item (an FQN, its counts summed over the ranks) holds
more non-finite values than it held in the newest healthy step of the job — the *baseline*.
The first checked step of a job sets the baseline, so a constant ``-inf`` attention-mask
buffer stays healthy step after step, while NaNs appearing in one rank's weight shard make
the whole step unhealthy on every rank. A wrong but finite value is invisible to this rule.

Pure: no I/O, no collective; every rank judges the same reports against the same baseline
(the baseline is the counts of a committed record, identical on every node).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["Counts", "StepHealth", "is_healthy", "judge", "totals"]

#: (rank, fqn, count) of every item holding non-finite values in a step.
Counts = tuple[tuple[int, str, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class StepHealth:
    """The verdict on one step: ``healthy``; ``counts`` (rank, fqn, count) of every item with
    any; ``worse``: (fqn, count, baseline count) of the items that made it unhealthy."""

    healthy: bool
    counts: Counts
    worse: tuple[tuple[str, int, int], ...] = ()

    def describe(self, limit: int = 8) -> str:
        """The items that made the step unhealthy, with the ranks holding them (for messages)."""
        parts = []
        for fqn, n, base in self.worse[:limit]:
            ranks = sorted({r for r, f, c in self.counts if f == fqn and c})
            parts.append(f"{fqn!r}: {n} non-finite (the newest healthy step held {base}) on ranks {ranks}")
        more = len(self.worse) - limit
        return "; ".join(parts) + (f"; and {more} more items" if more > 0 else "")


def totals(counts: Iterable[tuple[int, str, int]]) -> dict[str, int]:
    """Per FQN, the non-finite values summed over the ranks."""
    out: dict[str, int] = {}
    for _, fqn, n in counts:
        out[fqn] = out.get(fqn, 0) + int(n)
    return out


def judge(rank_counts: Sequence[tuple[int, Iterable[tuple[str, int]]]], baseline: Mapping[str, int] | None) -> StepHealth:
    """The health of a step from each rank's ``(rank, ((fqn, count), ...))``; ``baseline``: the
    per-FQN totals of the newest healthy step (None: no checked step yet, this one sets it)."""
    counts: Counts = tuple((int(r), str(f), int(n)) for r, items in rank_counts for f, n in items if n)
    if baseline is None or not counts:
        return StepHealth(True, counts)
    worse = tuple(sorted((f, n, int(baseline.get(f, 0))) for f, n in totals(counts).items() if n > baseline.get(f, 0)))
    return StepHealth(not worse, counts, worse)


def is_healthy(record: object) -> bool:
    """Whether a step record may be restored by default: not marked unhealthy (a record written
    without the check, or before it existed, counts as healthy)."""
    return getattr(record, "healthy", None) is not False
