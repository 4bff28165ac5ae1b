"""Traffic interleaving: copy checkpoint chunks into the idle spans of a training iteration.

GEMINI (SOSP'23, §traffic interleaving) observes that a training iteration's
communication timeline is stable, profiles it once, and schedules checkpoint
traffic into the spans where training leaves the contended resource idle, so
that the checkpoint of step t is in CPU memory before the optimizer update of
step t+1 without slowing the forward and backward passes. This module is that
algorithm, in three parts:

1. **Profile** (:class:`CollectiveProfiler`): after ``warmup`` iterations, time
   every training collective for ``iterations`` iterations. An iteration
   starts when ``optimizer.step()`` returns; its *deadline* is the next
   ``optimizer.step()`` call (model states change only there). Collectives are
   seen by wrapping the ``torch.distributed`` functions that FSDP2 and user
   code call (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``,
   ``all_gather_into_tensor``, ...; an async op ends when its Work's future
   completes) or, for DDP, whose reducer calls the process group from C++,
   through :func:`ddp_allreduce_hook` registered as a DDP comm hook. Calls on
   the checkpoint control group are never recorded.

2. **Gaps and packing** (pure functions): each iteration is a sequence of
   alternating *idle* periods (no training collective in flight) and *busy*
   periods, and each period has a *position*: the number of collectives issued
   before it began. The length of the gap at a position is the minimum over
   the profiled iterations (GEMINI: "gap size at each position = minimum
   across iterations"); gaps under ``min_gap_s`` are ignored. Chunks are packed
   greedily, in copy order: a gap of length L holds ``L × bandwidth × alpha``
   bytes (``alpha`` ≈ 0.6-0.8, the safety factor); what does not fit goes after
   the last gap, before the deadline (:func:`pack`). ``where="between"``
   (default) uses the idle periods — the network/PCIe is free there: GEMINI's
   case, and the GPU case; ``where="during"`` uses the busy periods — on a CPU
   host whose cores compute, they are freest while training waits for
   communication.

3. **Run time** (:class:`LiveTimeline`, :class:`Pacer`): the same wrappers keep
   feeding a live view of the iteration (which position, idle or busy, since
   when). The copy loop calls ``pace(nbytes)`` before each chunk; the pacer
   applies the greedy rule to the live gaps: a chunk goes when the current
   period is a profiled gap with enough budget left (bytes and time), else it
   waits for the next gap; past the last gap it goes at once (leftover).
   Anchoring gaps to the live collective events rather than to clock offsets
   keeps the schedule right when an iteration runs early or late. The
   bandwidth estimate is refreshed from the chunks the pacer times.
   ``hurry()`` — called when the optimizer step waits for the copy — releases
   every remaining chunk: once training is blocked there is nothing left to
   interleave with.

Without a profile (not collected yet, no collective seen, a varying number of
collectives per iteration, or iteration times varying more than ``max_cv``)
the copy runs as fast as possible. Chunks are at most ``max_chunk_bytes``; the
copy goes from the live tensors straight into the tier, so at most one chunk
per copying thread is in flight and no staging buffer exists.

Limitation: on CUDA, NCCL futures complete when the work is *enqueued*, not
when it finishes on the GPU, so the busy periods seen here are too short;
GEMINI times collectives with CUDA events (left to do).

Where the parts live: :mod:`.gaps` (pure functions), :mod:`.pacer` (run time),
:mod:`.profiler` (profiling); this module is their one import path.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .gaps import (
    DEFAULT_ALPHA,
    DEFAULT_MAX_CHUNK,
    DEFAULT_MAX_CV,
    DEFAULT_MIN_GAP_S,
    MIN_CHUNK,
    Interval,
    IterationTrace,
    Packing,
    Period,
    Span,
    Where,
    choose_chunk_bytes,
    complement,
    gap_lengths,
    idle_spans,
    intersect,
    merge,
    pack,
    periods,
    span_capacity,
    split_chunks,
    timeline_cv,
)
from .pacer import LiveTimeline, Pacer, PacerStats
from .profiler import CollectiveProfiler, ddp_allreduce_hook

log = logging.getLogger(__name__)


def interleave_for(model: Any) -> bool:
    """Whether an adapter's :class:`~gemini_dcp.AsyncCheckpointer` should pace its copy into the gaps between
    training collectives (its ``interleave=``): when ``model`` (a module or a list of them) has parameters on an
    accelerator, GEMINI's case, where the gaps are the network's and the copy overlaps device compute. On the CPU
    those gaps are the training's own compute: a copy moved into them runs later and out of step across ranks
    (measured slower: docs/benchmarks.md), so a CPU model's copy goes at once; logged (INFO) when so decided.
    The torchtitan and Accelerate adapters use it; ``AsyncCheckpointer``'s own default is unchanged."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    on_device = any(p.device.type not in ("cpu", "meta") for part in parts for p in part.parameters())
    if not on_device:
        log.info("gemini_dcp: the model is on the CPU: the per-step copy is not paced into the gaps between "
                 "training collectives (measured slower there; docs/integrations.md)")
        if ranks_unpinned():
            log.info("gemini_dcp: %s ranks on this node and this one free to run on all %d CPUs: with each rank "
                     "pinned to its own cores (taskset, numactl, srun --cpu-bind=cores), a rank's per-step copy "
                     "delays only its own training, not another rank's (docs/deploying.md, 'CPU training')",
                     os.environ.get("LOCAL_WORLD_SIZE"), os.cpu_count())
    return on_device


def ranks_unpinned() -> bool:
    """Whether several ranks share this node (``LOCAL_WORLD_SIZE`` > 1) and this one may run on every CPU the node
    has: not pinned, so the kernel may put its snapshot thread on another rank's core (docs/deploying.md)."""
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    except (ValueError, OSError):
        return False
    return local_world > 1 and allowed > 1 and allowed == os.cpu_count()

__all__ = [
    "CollectiveProfiler",
    "DEFAULT_ALPHA",
    "DEFAULT_MAX_CHUNK",
    "DEFAULT_MAX_CV",
    "DEFAULT_MIN_GAP_S",
    "Interval",
    "IterationTrace",
    "LiveTimeline",
    "MIN_CHUNK",
    "Pacer",
    "PacerStats",
    "Packing",
    "Period",
    "Span",
    "Where",
    "choose_chunk_bytes",
    "complement",
    "ddp_allreduce_hook",
    "gap_lengths",
    "idle_spans",
    "interleave_for",
    "intersect",
    "merge",
    "pack",
    "periods",
    "ranks_unpinned",
    "span_capacity",
    "split_chunks",
    "timeline_cv",
]
