"""Timelines of a job: which saved steps are live after in-job rollbacks (torch-free, pure).

A rollback (a restore of step ``b`` while newer steps exist) starts a new *timeline*: the saves
after it reuse the step numbers ``b+1, b+2, ...`` of the abandoned ones. A :class:`Lineage` is
the job's live history: a chain of segments ``(timeline id, branch step)``, root first, whose
branch steps strictly increase. The owner of step ``s`` is the timeline of the last segment
branched *below* ``s`` (the root owns every step up to the first branch). A saved step is
**live** when the timeline it was saved on (its record's ``timeline``, the store's
``.gemini/timeline.json``) owns its number; every other step belongs to an abandoned timeline
and is never restored by default, however many records of the new timeline were evicted.

Invariants:

* A lineage only ever changes into one with a higher ``gen`` (:meth:`Lineage.restore`); of
  several copies (node memories, the store's steps) the one with the highest ``gen`` is the
  newest knowledge (:func:`newest`), so a node replaced (memory wiped) learns it back from the
  store or its peers.
* The id of a new timeline is derived from the agreed restore (launch, step, the lineage it
  branches from, the steps it abandons): every rank of every node computes the same id.
* The root timeline is ``""`` (steps saved before any rollback, and by older releases).

This module is data and decisions only: where a lineage is kept is
:mod:`gemini_dcp.local.tier` (the node) and :mod:`gemini_dcp.persistent.timeline_file` (the store).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from .restore_order import NodeView, RestoreDecision

__all__ = ["ROOT", "Lineage", "after_restore", "job_lineage", "newest"]

Segment = tuple[str, "int | None"]


@dataclass(frozen=True, slots=True)
class Lineage:
    """The live history of a job (module docstring).

    ``gen``: how many rollbacks shaped it (higher is newer knowledge). ``segments``:
    ``(timeline id, branch step)`` root first; the root's branch step is None.
    """

    gen: int = 0
    segments: tuple[tuple[str, int | None], ...] = (("", None),)

    @property
    def tip(self) -> str:
        """The timeline new saves go on."""
        return self.segments[-1][0]

    def owner(self, step: int) -> str:
        """The timeline that owns step number ``step``."""
        owner = self.segments[0][0]
        for timeline, branch in self.segments[1:]:
            if branch is not None and branch < step:
                owner = timeline
        return owner

    def live(self, step: int, timeline: str) -> bool:
        """Whether a step saved on ``timeline`` as number ``step`` is part of the live history."""
        return self.owner(step) == timeline

    def restore(self, step: int, timeline: str, launch_id: str, abandoned: Iterable[int]) -> Lineage:
        """The lineage after a restore of ``step`` (saved on ``timeline``) by launch ``launch_id``,
        ``abandoned`` being the live steps newer than ``step``: unchanged when nothing newer is
        abandoned and ``timeline`` is the tip, else a new timeline branched at ``step``."""
        ids = [t for t, _ in self.segments]
        base = self.segments[: ids.index(timeline) + 1] if timeline in ids else ((timeline, None),)
        gone = sorted({int(s) for s in abandoned})
        if not gone and len(base) == len(self.segments):
            return self
        seed = repr((launch_id, int(step), timeline, self.gen, self.segments, gone)).encode()
        new_id = hashlib.sha256(seed).hexdigest()[:16]
        return Lineage(self.gen + 1, (*base, (new_id, int(step))))

    def to_json(self) -> dict[str, Any]:
        return {"gen": self.gen, "segments": [[t, b] for t, b in self.segments]}

    @classmethod
    def from_json(cls, data: Any) -> Lineage | None:
        """The lineage in ``data`` (untrusted: read from a file); None when it is not a valid one."""
        if isinstance(data, (bytes, str)):
            try:
                data = json.loads(data)
            except ValueError:
                return None
        if not isinstance(data, dict):
            return None
        gen, raw = data.get("gen"), data.get("segments")
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0 or not isinstance(raw, list) or not raw:
            return None
        segments: list[tuple[str, int | None]] = []
        last = None
        for i, seg in enumerate(raw):
            if not (isinstance(seg, list) and len(seg) == 2 and isinstance(seg[0], str) and len(seg[0]) <= 64):
                return None
            branch = seg[1]
            if i == 0:
                if branch is not None:
                    return None
            elif not isinstance(branch, int) or isinstance(branch, bool) or (last is not None and branch <= last):
                return None
            else:
                last = branch
            segments.append((seg[0], branch))
        return cls(gen, tuple(segments))


ROOT = Lineage()


def newest(lineages: Iterable[Lineage | None]) -> Lineage:
    """The newest knowledge among ``lineages`` (highest ``gen``; ties broken deterministically)."""
    best = ROOT
    for lin in lineages:
        if lin is not None and (lin.gen, repr(lin.segments)) > (best.gen, repr(best.segments)):
            best = lin
    return best


def job_lineage(views: Sequence[NodeView], others: Sequence[str] = ()) -> Lineage:
    """The newest lineage among the nodes' views and ``others`` (JSON, e.g. the store's): the job's history."""
    return newest(Lineage.from_json(text) for text in [*(v.lineage for v in views), *others] if text)


def after_restore(
    lineage: Lineage, decision: RestoreDecision, views: Sequence[NodeView], persisted: Sequence[int],
    persistent_timelines: Mapping[int, str], launch_id: str,
) -> Lineage:
    """The job's history once ``decision`` is restored by launch ``launch_id``: a new timeline
    branched at the restored step when ``lineage`` keeps steps newer than it (in any node's memory
    or in the store), else ``lineage`` as it is. The same on every rank (every input is agreed)."""
    step = decision.step
    timeline = persistent_timelines.get(step, "")
    for v in views:
        for sv in v.steps:
            if sv.step == step and sv.fingerprint == decision.fingerprint:
                timeline = sv.timeline
    newer = {sv.step for v in views for sv in v.steps if sv.step > step and lineage.live(sv.step, sv.timeline)}
    newer |= {s for s in persisted if s > step and lineage.live(s, persistent_timelines.get(s, ""))}
    return lineage.restore(step, timeline, launch_id, newer)
