"""Per-step saves without re-planning: replay the last DCP save plan while the
state dict keeps its structure.

``dcp.save`` plans every call: each rank builds its local plan, the coordinator
gathers the plans, deduplicates replicated items and scatters the final plans,
and after the write the results are gathered and the metadata broadcast — four
pickled-object collectives through one coordinator, on top of the writer's own
commit gather. A job that checkpoints every step saves the same structure every
step, so the plan does not change; on this project's 2-core CPU host the
planning was ~60% of the background CPU of a per-step snapshot, taken from
training (docs/async.md), and on a large job every plan goes through rank 0.

:class:`PlanReplay` runs the first save (and any save whose structure changed)
through ``dcp.save`` with a planner that records the plans, then replays:

1. each rank builds its local plan with the same planner (local work, no
   collective) and compares it with the recorded one;
2. one all-reduce of three integers on the checkpoint control group decides
   for all ranks together: replay only if every rank's plan is unchanged and
   every rank holds the plans of the same recorded save, else every rank runs
   ``dcp.save`` (ranks never split between the two protocols);
3. a replay writes the recorded final plan (the same items, deduplicated the
   same way) and commits with the recorded global metadata through
   :meth:`GeminiStorageWriter.write_replayed`: the write-result gather of the
   commit is the only pickled collective left.

The bytes, checksums and step record are those ``dcp.save`` would produce for
the same state dict; only the planning is skipped. Tensor *values* and
non-tensor values (a step counter) are read at write time as always.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from .writer import GeminiStorageWriter

__all__ = ["PlanReplay", "RecordingSavePlanner", "same_plan"]

log = logging.getLogger(__name__)


class RecordingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that keeps this rank's local plan (before the coordinator's
    deduplication) and final plan (after it) of the save it planned."""

    local_plan: SavePlan | None = None
    final_plan: SavePlan | None = None

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.local_plan = plan
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.final_plan = plan
        return plan


@dataclasses.dataclass(frozen=True, slots=True)
class _Recorded:
    generation: int  # counts recorded saves; equal on every rank that recorded the same save
    local_plan: SavePlan
    final_plan: SavePlan
    metadata: Metadata


def same_plan(a: SavePlan, b: SavePlan) -> bool:
    """Plans that lead to the same global plan (``MetadataIndex.index`` hints are not compared)."""
    return a.items == b.items and a.planner_data == b.planner_data and a.storage_data == b.storage_data


class PlanReplay:
    """Save through ``dcp.save`` once, then replay its plan while the structure holds.

    One instance per writer and checkpoint group; :meth:`save` is collective over
    ``group``: **all ranks must call it together, for the same step**.
    """

    def __init__(self, writer: GeminiStorageWriter, group: Any, *, no_dist: bool) -> None:
        self.writer = writer
        self.group = group
        self.no_dist = no_dist
        self._recorded: _Recorded | None = None
        self._generation = 0
        self.replayed = 0  # saves that skipped planning
        self.planned = 0  # saves that went through dcp.save

    def forget(self) -> None:
        """Drop the recorded plan: the next save plans again (on every rank, by the agreement)."""
        self._recorded = None

    def save(self, state_dict: dict[str, Any], step: int) -> Metadata:
        """Save ``state_dict`` as ``step``; returns the global metadata. Collective."""
        rank = 0 if self.no_dist or self.group is None else dist.get_rank(self.group)
        is_coordinator = rank == 0
        w = self.writer
        w.reset(step)
        planner = RecordingSavePlanner()
        rec = self._recorded
        hit = False
        if rec is not None:
            try:
                planner.set_up_planner(state_dict, w.storage_meta(), is_coordinator)
                hit = same_plan(planner.create_local_plan(), rec.local_plan)
            except Exception:  # noqa: BLE001 - planned again below by dcp.save, which reports it to every rank
                log.debug("step %s: local planning failed; dcp.save will plan and report it", step, exc_info=True)
        if self._agree(hit, rec.generation if rec is not None else -1):
            assert rec is not None
            w.set_up_storage_writer(is_coordinator, rank=rank, use_collectives=True)
            meta = rec.metadata
            if meta.storage_meta is not None:
                meta = dataclasses.replace(meta, storage_meta=w.storage_meta())
            w.write_replayed(rec.final_plan, planner, meta)
            self.replayed += 1
            return meta
        return self._plan_and_save(state_dict, step)

    def _plan_and_save(self, state_dict: dict[str, Any], step: int) -> Metadata:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        self._recorded = None  # a failed save below leaves nothing to replay
        planner = RecordingSavePlanner()
        meta = dcp.save(
            state_dict, storage_writer=self.writer, checkpoint_id=step, planner=planner,
            process_group=self.group, no_dist=self.no_dist,
        )
        self.planned += 1
        global_meta = self.writer.planned_metadata
        if planner.local_plan is not None and planner.final_plan is not None and isinstance(global_meta, Metadata):
            self._generation += 1
            self._recorded = _Recorded(self._generation, planner.local_plan, planner.final_plan, global_meta)
        return meta

    def _agree(self, hit: bool, generation: int) -> bool:
        """True on every rank iff every rank hit and all hold the same recorded save."""
        if self.no_dist or self.group is None:
            return hit
        flags = torch.tensor([int(hit), generation, -generation], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flags[0] == 1) and int(flags[1]) == -int(flags[2])
