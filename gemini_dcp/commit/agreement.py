"""The pre-write agreement: one MIN all-reduce of three ints before any byte is written.

Every rank contributes :func:`prewrite_values` of the step it saves; the element-wise
minimum over all ranks says, identically on every rank:

- ``G`` (the *global step*): the newest step committed on every node. The save neither
  overwrites nor evicts it, so a commit that fails on some node (a full tmpfs at the
  record write, a crash) always leaves every node holding G;
- whether some rank already committed this very step in this launch (a second
  ``dcp.save`` of one step would replace the first: refused on every rank);
- whether a record write failed on some node at the previous save (every rank warns).

A replayed save (:mod:`gemini_dcp.snapshot.replay`) carries these three values in its own
agreement all-reduce and hands the combined values over (``agreed``), so it runs no
collective of its own here. A plain ``dcp.save`` carries them in DCP's own planning
collective: each rank's values ride its local plan to the coordinator (:class:`PlannedValues`
in ``SavePlan.storage_data``), the coordinator's ``prepare_global_plan`` combines them
(:func:`combine_planned`) into every rank's final plan, and ``write_data`` takes them from
there (:func:`take_agreed`) instead of running the all-reduce. Whether a save takes the
values or runs the all-reduce is decided by the coordinator alone and read by every rank
from the plan it scattered, so all ranks decide alike; a plan DCP's plan cache hands back
from an earlier save carries values already used, and the all-reduce runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from ..local.tier import LocalTier
from ..transport.p2p import transport_for

log = logging.getLogger(__name__)

NO_STEP = 2**63 - 1  # "no step" in the MIN all-reduce


class AllReduceGroup(Protocol):
    """What the all-reduce needs of the control group (:class:`gemini_dcp.transport.comm.Comm` has it)."""

    @property
    def distributed(self) -> bool: ...

    @property
    def group(self) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Agreement:
    """The combined (MIN over ranks) pre-write values, read back."""

    global_step: int | None  # G: the newest step committed on every node (None: none yet)
    repeated: bool  # some rank already committed this step in this launch
    failed_step: int | None  # a step whose record write failed on some node at the last save

    @classmethod
    def of(cls, vals: Sequence[int]) -> Agreement:
        return cls(
            global_step=None if vals[0] == NO_STEP else int(vals[0]),
            repeated=vals[1] < 0,
            failed_step=-vals[2] - 1 if vals[2] < 0 else None,
        )


@dataclasses.dataclass(eq=False, slots=True)
class PlannedValues:
    """One rank's :func:`prewrite_values` of ``step``, riding its local plan to DCP's coordinator.

    ``used`` is set once the coordinator combined them: DCP's plan cache keeps plans of earlier
    saves and may hand this very object back later, when the values are stale.
    """

    step: int
    values: list[int]
    used: bool = False


@dataclasses.dataclass(eq=False, slots=True)
class AgreedValues:
    """The combined (MIN over every rank) :class:`PlannedValues` of ``step``, in a final plan;
    ``values`` None: the ranks run the all-reduce. ``used`` once a ``write_data`` took them."""

    step: int
    values: list[int] | None
    used: bool = False


def combine_planned(step: int, payloads: Sequence[object], delivered: bool) -> list[int] | None:
    """The coordinator's part (local): the MIN over ranks of their :class:`PlannedValues` of
    ``step``, when every plan carries fresh ones and ``delivered`` (every final plan it sends is
    one each rank will use as is); else None. Marks the values used."""
    fresh = all(type(p) is PlannedValues and p.step == step and not p.used for p in payloads)
    for p in payloads:
        if type(p) is PlannedValues:
            p.used = True
    if not (fresh and delivered and payloads):
        return None
    return [min(vals) for vals in zip(*(p.values for p in payloads))]  # type: ignore[attr-defined]


def take_agreed(payload: object, step: int) -> list[int] | None:
    """A rank's part in ``write_data`` (local): the combined values of ``step`` its final plan
    carries, fresh from the coordinator; else None (the all-reduce runs). Marks them used."""
    if type(payload) is not AgreedValues or payload.step != step or payload.used:
        return None
    payload.used = True
    return None if payload.values is None else list(payload.values)


def prewrite_values(
    tier: LocalTier, step: int, *, leader: bool | None, failed_commit: int | None, launch_id: str
) -> list[int]:
    """This rank's part of the pre-write agreement of saving ``step``: three int64 values,
    each combined over all ranks by MIN (local work).

    Each node's newest step comes from its leader (its records are renamed by the leader
    after the previous commit gather, so another rank of the node may list them too
    early); a rank that does not know yet whether it leads (``leader`` None: a fresh
    writer) reports too: the minimum over nodes is only more conservative.
    """
    newest: int | None = None
    again = False
    try:
        steps = tier.steps()
        if leader is not False:
            newest = next((s for s in reversed(steps) if s < step and tier.record(s) is not None), None)
        if step in steps:
            rec = tier.record(step)
            # Saved by this launch on its current timeline: a rollback (LocalTier.note_restore) starts another.
            again = (rec is not None and bool(rec.launch_id) and rec.launch_id == launch_id
                     and rec.timeline == tier.timeline(launch_id))
            rolled_back = rec is not None and rec.launch_id == launch_id and not again
            if rec is not None and not again and not rolled_back and leader is not False:
                log.warning(
                    "step %s of job %r in %s was saved by another launch (%s): this save replaces it.",
                    step, tier.job_id, tier.root, rec.launch_description or "unknown",
                )
    except OSError as exc:  # the save itself reports an unusable tier; G stays unknown here
        log.warning("step %s: could not list this node's records: %s", step, exc)
    return [NO_STEP if newest is None else newest, -int(again), -(failed_commit + 1) if failed_commit is not None else 0]


def min_all_reduce(comm: AllReduceGroup, vals: list[int]) -> list[int]:
    """Collective (all ranks of the control group call it, with lists of one length):
    the element-wise minimum of ``vals`` over all ranks. One process: ``vals`` itself."""
    return transport_for(comm).all_reduce_ints(vals, "min")  # type: ignore[arg-type]
