"""Traffic interleaving, part 1: the profiler of training collectives, which learns the gaps
of an iteration and feeds the live timeline (see :mod:`gemini_dcp.snapshot.interleave`).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any, Callable, Iterable

from .gaps import (
    DEFAULT_MAX_CV,
    DEFAULT_MIN_GAP_S,
    IterationTrace,
    Span,
    Where,
    gap_lengths,
    idle_spans,
    timeline_cv,
)
from .pacer import LiveTimeline

log = logging.getLogger(__name__)

# ---- profiling -------------------------------------------------------------------------------
_PATCHED = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all_single",
    "all_to_all",
    "reduce",
    "_all_gather_base",
    "_reduce_scatter_base",
)


class CollectiveProfiler:
    """Learn the gaps of the training iteration and keep the live timeline (module docstring).

    ``install(optimizer)`` marks iteration boundaries with optimizer step hooks
    and wraps the ``torch.distributed`` collectives; for DDP also register
    :func:`ddp_allreduce_hook` with this profiler as its state. ``profile()``
    returns the traces once ``warmup + iterations`` iterations have been seen;
    ``gaps()`` the gap lengths by position, or None when there is no usable
    profile (``reason`` says why). With ``live=False`` the wrappers are removed
    once the profile is complete.
    """

    def __init__(
        self,
        *,
        warmup: int = 3,
        iterations: int = 20,
        where: Where = "between",
        min_gap_s: float = DEFAULT_MIN_GAP_S,
        max_cv: float = DEFAULT_MAX_CV,
        exclude_groups: Iterable[Any] = (),
        live: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.warmup = warmup
        self.iterations = iterations
        self.where: Where = where
        self.min_gap_s = min_gap_s
        self.max_cv = max_cv
        self.live = live
        self._exclude = [g for g in exclude_groups if g is not None]
        self.clock = clock
        self.timeline = LiveTimeline(clock)
        self._lock = threading.Lock()
        self._iter_start: float | None = None
        self._events: list[list[float]] = []  # [start, end] per collective, in issue order
        self._seen = 0
        self._traces: list[IterationTrace] = []
        self._originals: dict[str, Callable[..., Any]] = {}
        self._hooks: list[Any] = []
        self.done = threading.Event()
        self.reason: str | None = None  # why there is no usable profile, once done
        self.ddp_process_group: Any = None
        self._gaps: tuple[tuple[int, str, float], dict[int, float] | None] | None = None  # gaps() of the profile

    # -- iteration boundaries --
    def iteration_start(self) -> None:
        """Mark the start of an iteration (the end of ``optimizer.step()``)."""
        self.timeline.iteration_start()
        with self._lock:
            self._iter_start = self.clock()
            self._events = []

    def iteration_deadline(self) -> None:
        """Mark the deadline of the current iteration (the call of ``optimizer.step()``)."""
        finished = False
        with self._lock:
            if self._iter_start is None or self.done.is_set():
                return
            t0 = self._iter_start
            now = self.clock()
            self._seen += 1
            if self._seen > self.warmup:
                busy = tuple((s - t0, (e if e is not None else now) - t0) for s, e in self._events)
                self._traces.append(IterationTrace(deadline=now - t0, busy=busy))
                finished = len(self._traces) >= self.iterations
            self._iter_start = None
        if finished:
            self._finish()

    def add_exclude_group(self, group: Any) -> None:
        if group is not None:
            self._exclude.append(group)

    def record(self, start: float, end: float) -> None:
        """Record a collective that ran from ``start`` to ``end`` (absolute clock)."""
        with self._lock:
            if self._iter_start is not None and not self.done.is_set():
                self._events.append([start, end])

    # -- live events (wrappers) --
    def _issue(self) -> list[float] | None:
        self.timeline.issued_one()
        with self._lock:
            if self._iter_start is None or self.done.is_set():
                return None
            ev = [self.clock(), None]
            self._events.append(ev)  # type: ignore[arg-type]
            return ev  # type: ignore[return-value]

    def _complete(self, ev: list[float] | None) -> None:
        self.timeline.completed_one()
        if ev is not None:
            ev[1] = self.clock()

    @property
    def active(self) -> bool:
        return not self.done.is_set() or self.live

    # -- results --
    def profile(self) -> list[IterationTrace] | None:
        return list(self._traces) if self.done.is_set() else None

    def gaps(self) -> dict[int, float] | None:
        """The gap lengths by position (None without a usable profile). Computed once per profile and
        settings (every save asks; over 20 traces it cost ~5 ms of the background thread's CPU)."""
        traces = self.profile()
        if not traces or self.reason is not None:
            return None
        key = (len(traces), self.where, self.min_gap_s)
        cached = self._gaps
        if cached is None or cached[0] != key:
            cached = self._gaps = (key, gap_lengths(traces, where=self.where, min_gap_s=self.min_gap_s) or None)
        return None if cached[1] is None else dict(cached[1])

    def spans(self) -> list[Span] | None:
        traces = self.profile()
        if not traces or self.reason is not None:
            return None
        return idle_spans(traces, where=self.where, min_gap_s=self.min_gap_s)

    def summary(self) -> dict[str, Any]:
        traces = self._traces
        spans = self.spans() or []
        return {
            "done": self.done.is_set(),
            "iterations": len(traces),
            "reason": self.reason,
            "where": self.where,
            "collectives_per_iteration": sorted({len(t.busy) for t in traces}),
            "deadline_s": statistics.fmean(t.deadline for t in traces) if traces else None,
            "cv": timeline_cv(traces) if traces else None,
            "gaps": [(s.pos, round(s.start, 6), round(s.length, 6)) for s in spans],
            "gap_s": sum(s.length for s in spans),
        }

    def _finish(self) -> None:
        traces = self._traces
        cv = timeline_cv(traces)
        counts = {len(t.busy) for t in traces}
        if not any(t.busy for t in traces):
            self.reason = "no training collective was seen during the profiled iterations"
        elif len(counts) > 1:
            self.reason = f"the number of collectives per iteration varies ({sorted(counts)})"
        elif cv > self.max_cv:
            self.reason = f"unstable timeline (iteration time varies by {cv:.0%} > {self.max_cv:.0%})"
        elif not gap_lengths(traces, where=self.where, min_gap_s=self.min_gap_s):
            self.reason = f"no gap of at least {self.min_gap_s * 1e3:.1f} ms at a stable position"
        self.done.set()
        if self.reason or not self.live:
            self.uninstall_patches()
        if self.reason:
            log.info("interleaving disabled: %s; checkpoint chunks are copied as fast as possible", self.reason)

    # -- installation --
    def install(self, optimizer: Any = None, *, patch_dist: bool = True) -> "CollectiveProfiler":
        """Hook ``optimizer`` for iteration boundaries and wrap ``torch.distributed`` collectives."""
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.iteration_deadline()))
            self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.iteration_start()))
        if patch_dist:
            self._patch()
        return self

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.uninstall_patches()

    def _excluded(self, group: Any) -> bool:
        return any(group is g for g in self._exclude)

    def _patch(self) -> None:
        import torch.distributed as dist

        if self._originals or not dist.is_available():
            return
        for name in _PATCHED:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(fn))

    def uninstall_patches(self) -> None:
        if not self._originals:
            return
        import torch.distributed as dist

        for name, fn in self._originals.items():
            if getattr(getattr(dist, name, None), "__wrapped__", None) is fn:
                setattr(dist, name, fn)
        self._originals = {}

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        prof = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not prof.active or prof._excluded(kwargs.get("group")):
                return fn(*args, **kwargs)
            ev = prof._issue()
            try:
                work = fn(*args, **kwargs)
            except BaseException:
                prof._complete(ev)
                raise
            if work is not None and kwargs.get("async_op"):
                prof._on_complete(work, ev)
            else:
                prof._complete(ev)
            return work

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(fn, "__name__", "collective")
        return wrapper

    def _on_complete(self, work: Any, ev: list[float] | None) -> None:
        try:
            fut = work.get_future()
        except (RuntimeError, AttributeError):  # backend without futures: count until issue only
            self._complete(ev)
            return
        fut.add_done_callback(lambda _f: self._complete(ev))


def ddp_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
    """DDP comm hook: the default all-reduce (mean), timed for the profiler.

    ``model.register_comm_hook(profiler, ddp_allreduce_hook)``; set
    ``profiler.ddp_process_group`` if DDP does not run on the default group.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if not state.active:
        return allreduce_hook(state.ddp_process_group, bucket)
    ev = state._issue()
    fut = allreduce_hook(state.ddp_process_group, bucket)

    def done(f: Any) -> Any:
        state._complete(ev)
        return f.value()

    return fut.then(done)
