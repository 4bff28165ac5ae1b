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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Literal, Sequence

log = logging.getLogger(__name__)

Where = Literal["between", "during"]

DEFAULT_ALPHA = 0.7
DEFAULT_MIN_GAP_S = 1e-3
DEFAULT_MAX_CHUNK = 4 << 20
MIN_CHUNK = 64 << 10
DEFAULT_MAX_CV = 0.25

Interval = tuple[float, float]


# ---- pure functions --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """A gap, in seconds after the start of the iteration; ``pos`` is its position."""

    start: float
    end: float
    pos: int | None = None

    @property
    def length(self) -> float:
        return max(0.0, self.end - self.start)


@dataclasses.dataclass(frozen=True, slots=True)
class IterationTrace:
    """One profiled iteration: collectives (start, end) relative to its start, in issue order."""

    deadline: float  # start -> next optimizer.step() call
    busy: tuple[Interval, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Period:
    kind: Literal["idle", "busy"]
    pos: int  # collectives issued before the period began
    start: float
    end: float


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def complement(busy: Sequence[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of [lo, hi] not covered by ``busy`` (disjoint, sorted)."""
    out: list[Interval] = []
    cur = lo
    for s, e in merge(busy):
        if e <= cur:
            continue
        if s >= hi:
            break
        if s > cur:
            out.append((cur, min(s, hi)))
        cur = max(cur, e)
    if cur < hi:
        out.append((cur, hi))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two sets of disjoint sorted intervals."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def periods(trace: IterationTrace) -> list[Period]:
    """The alternating idle/busy periods of one iteration, with their positions."""
    events: list[tuple[float, int]] = []  # (time, +1 issue / -1 completion); completions first on ties
    for s, e in trace.busy:
        s = max(0.0, s)
        e = max(s, min(e, trace.deadline))
        events += [(s, 1), (e, -1)]
    events.sort(key=lambda ev: (ev[0], ev[1]))
    out: list[Period] = []
    in_flight = issued = 0
    start, kind, pos = 0.0, "idle", 0
    for t, d in events:
        if d == 1:
            if in_flight == 0:
                out.append(Period("idle", pos, start, t))
                start, kind, pos = t, "busy", issued
            in_flight += 1
            issued += 1
        else:
            in_flight -= 1
            if in_flight == 0:
                out.append(Period("busy", pos, start, t))
                start, kind, pos = t, "idle", issued
    out.append(Period(kind, pos, start, max(start, trace.deadline)))  # type: ignore[arg-type]
    return out


def gap_lengths(
    traces: Sequence[IterationTrace], *, where: Where = "between", min_gap_s: float = DEFAULT_MIN_GAP_S
) -> dict[int, float]:
    """Position -> gap length, the minimum over iterations; positions missing in any iteration
    (or shorter than ``min_gap_s``) are dropped."""
    kind = "idle" if where == "between" else "busy"
    common: dict[int, float] | None = None
    for t in traces:
        mine = {p.pos: p.end - p.start for p in periods(t) if p.kind == kind}
        common = mine if common is None else {k: min(v, mine[k]) for k, v in common.items() if k in mine}
    return {k: v for k, v in sorted((common or {}).items()) if v >= min_gap_s}


def idle_spans(
    traces: Sequence[IterationTrace], *, where: Where = "between", min_gap_s: float = DEFAULT_MIN_GAP_S
) -> list[Span]:
    """The gaps as spans on the iteration's clock: each starts at the median start of its
    period and lasts the minimum length (for reports and :func:`pack`)."""
    lengths = gap_lengths(traces, where=where, min_gap_s=min_gap_s)
    kind = "idle" if where == "between" else "busy"
    starts: dict[int, list[float]] = {}
    for t in traces:
        for p in periods(t):
            if p.kind == kind and p.pos in lengths:
                starts.setdefault(p.pos, []).append(p.start)
    return [Span(statistics.median(starts[k]), statistics.median(starts[k]) + v, k) for k, v in lengths.items()]


def timeline_cv(traces: Sequence[IterationTrace]) -> float:
    """Normalized standard deviation of the iteration deadlines (GEMINI saw < 10%)."""
    d = [t.deadline for t in traces]
    if len(d) < 2:
        return 0.0
    mean = statistics.fmean(d)
    return statistics.pstdev(d) / mean if mean > 0 else math.inf


def span_capacity(span: Span | float, bandwidth: float, alpha: float) -> int:
    """Bytes scheduled into a gap: length × bandwidth × alpha."""
    length = span.length if isinstance(span, Span) else span
    return int(length * bandwidth * alpha + 0.5)


@dataclasses.dataclass(frozen=True, slots=True)
class Packing:
    """Result of :func:`pack`: the span each chunk goes to (None: after the last span)."""

    assign: tuple[int | None, ...]
    span_bytes: tuple[int, ...]
    capacity: tuple[int, ...]
    leftover_bytes: int

    @property
    def scheduled_bytes(self) -> int:
        return sum(self.span_bytes)


def pack(chunks: Sequence[int], spans: Sequence[Span], bandwidth: float, alpha: float = DEFAULT_ALPHA) -> Packing:
    """Greedy, order-preserving packing of chunk sizes (bytes) into spans (taken in time order).

    Chunks are copied in order, so a chunk never goes to a span earlier than its
    predecessor's: it goes to the current span if it fits in what is left of it,
    else the next span is opened; once the spans are used up every remaining
    chunk is *leftover* (copied after the last span, before the deadline).
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha={alpha}: the safety factor must be in (0, 1]")
    spans = sorted(spans, key=lambda s: s.start)
    caps = [span_capacity(s, bandwidth, alpha) for s in spans]
    used = [0] * len(spans)
    assign: list[int | None] = []
    cur = 0
    leftover = 0
    for c in chunks:
        while cur < len(spans) and used[cur] + c > caps[cur]:
            cur += 1
        if cur == len(spans):
            assign.append(None)
            leftover += c
        else:
            used[cur] += c
            assign.append(cur)
    return Packing(tuple(assign), tuple(used), tuple(caps), leftover)


def split_chunks(sizes: Iterable[int], chunk_bytes: int) -> list[int]:
    """Cut item sizes (bytes, in copy order) into chunks of at most ``chunk_bytes`` (as the copy loop does)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    out: list[int] = []
    for n in sizes:
        for start in range(0, n, chunk_bytes):
            out.append(min(chunk_bytes, n - start))
    return out


def choose_chunk_bytes(
    lengths: Iterable[Span | float], bandwidth: float, alpha: float = DEFAULT_ALPHA, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK
) -> int:
    """A chunk size that wastes little of the gaps: a quarter of the median gap capacity,
    a power of two in [64 KiB, max_chunk_bytes]."""
    caps = sorted(c for c in (span_capacity(s, bandwidth, alpha) for s in lengths) if c > 0)
    if not caps:
        return max_chunk_bytes
    target = caps[len(caps) // 2] // 4
    size = MIN_CHUNK
    while size * 2 <= min(target, max_chunk_bytes):
        size *= 2
    return max(MIN_CHUNK, min(size, max_chunk_bytes))


# ---- run time --------------------------------------------------------------------------------
class LiveTimeline:
    """The current period of the running iteration, fed by the collective wrappers."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.cond = threading.Condition()
        self.iteration = 0
        self.in_flight = 0
        self.issued = 0
        self.kind: str = "idle"
        self.pos = 0
        self.since = clock()

    def iteration_start(self) -> None:
        with self.cond:
            self.iteration += 1
            self.issued = 0
            self.in_flight = 0
            self.kind, self.pos, self.since = "idle", 0, self.clock()
            self.cond.notify_all()

    def issued_one(self) -> None:
        with self.cond:
            if self.in_flight == 0:
                self.kind, self.pos, self.since = "busy", self.issued, self.clock()
                self.cond.notify_all()
            self.in_flight += 1
            self.issued += 1

    def completed_one(self) -> None:
        with self.cond:
            if self.in_flight == 0:
                return  # an op issued before the iteration started
            self.in_flight -= 1
            if self.in_flight == 0:
                self.kind, self.pos, self.since = "idle", self.issued, self.clock()
                self.cond.notify_all()

    def state(self) -> tuple[int, str, int, float]:
        return self.iteration, self.kind, self.pos, self.since


@dataclasses.dataclass(slots=True)
class PacerStats:
    chunks: int = 0
    bytes_in_spans: int = 0
    bytes_leftover: int = 0
    bytes_hurried: int = 0
    waited_s: float = 0.0
    gaps_used: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Pacer:
    """The online greedy scheduler, called by the copy loop before each chunk.

    ``gaps`` maps positions to gap lengths (:func:`gap_lengths`); ``timeline``
    is the live view fed by the collective wrappers. With no gaps (or no
    timeline) every chunk goes at once and the pacer only measures the copy
    rate. Thread-safe for one copying thread plus any number of ``hurry()``.
    """

    def __init__(
        self,
        gaps: dict[int, float] | None = None,
        timeline: LiveTimeline | None = None,
        *,
        where: Where = "between",
        bandwidth: float,
        alpha: float = DEFAULT_ALPHA,
        chunk_bytes: int = DEFAULT_MAX_CHUNK,
        max_wait_s: float = 0.05,
        one_iteration: bool = False,
    ) -> None:
        if bandwidth <= 0:
            raise ValueError("bandwidth must be positive")
        self.gaps = dict(gaps or {}) if timeline is not None else {}
        self.timeline = timeline
        self.kind = "idle" if where == "between" else "busy"
        self.alpha = alpha
        self.bandwidth = float(bandwidth)
        self.block_bytes = int(chunk_bytes)
        self.max_wait_s = max_wait_s
        self._clock = timeline.clock if timeline is not None else time.perf_counter
        self._hurry = threading.Event()
        self._last_pos = max(self.gaps) if self.gaps else -1
        self._key: tuple[int, int] | None = None  # (iteration, pos) of the gap being filled
        self._used = 0
        self._exhausted: set[tuple[int, int]] = set()
        self._last: tuple[float, int] | None = None  # (return time, nbytes) of the previous chunk
        # one_iteration: use only the gaps of the iteration of the first chunk; once the next
        # iteration has begun, every chunk goes at once (no guard bounds such a transfer).
        self._one_iteration = one_iteration
        self._first_iteration: int | None = None
        self.stats = PacerStats()

    def hurry(self) -> None:
        """Let every remaining chunk go at once (training is waiting for the copy)."""
        self._hurry.set()
        tl = self.timeline
        if tl is not None:
            with tl.cond:
                tl.cond.notify_all()

    @property
    def hurried(self) -> bool:
        return self._hurry.is_set()

    def _learn(self, now: float) -> None:
        if self._last is not None:
            t_prev, n_prev = self._last
            dt = now - t_prev
            if dt > 0 and n_prev >= MIN_CHUNK:
                # EMA of the measured rate of the previous chunk (its copy and checksum).
                self.bandwidth = 0.7 * self.bandwidth + 0.3 * (n_prev / dt)

    def __call__(self, nbytes: int) -> None:
        self._learn(self._clock())
        self.stats.chunks += 1
        tl = self.timeline
        if not self.gaps or tl is None:
            if self._hurry.is_set():
                self.stats.bytes_hurried += nbytes
            else:
                self.stats.bytes_leftover += nbytes
            self._last = (self._clock(), nbytes)
            return
        t_wait = self._clock()
        with tl.cond:
            while True:
                if self._hurry.is_set():
                    self.stats.bytes_hurried += nbytes
                    break
                it, kind, pos, since = tl.state()
                if self._one_iteration and self._first_iteration is None:
                    self._first_iteration = it
                if (
                    pos > self._last_pos
                    or (pos == self._last_pos and (it, pos) in self._exhausted)
                    or (self._one_iteration and it != self._first_iteration)
                ):
                    self.stats.bytes_leftover += nbytes  # past the last gap: before the deadline, at once
                    break
                key = (it, pos)
                if kind == self.kind and pos in self.gaps and key not in self._exhausted:
                    length = self.gaps[pos]
                    if key != self._key:
                        self._key, self._used = key, 0
                        self.stats.gaps_used += 1
                    left = length - (self._clock() - since)
                    if self._used + nbytes <= span_capacity(length, self.bandwidth, self.alpha) and nbytes / self.bandwidth <= left:
                        self._used += nbytes
                        self.stats.bytes_in_spans += nbytes
                        break
                    self._exhausted.add(key)
                    continue
                tl.cond.wait(self.max_wait_s)
        self.stats.waited_s += self._clock() - t_wait
        self._last = (self._clock(), nbytes)


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
        traces = self.profile()
        if not traces or self.reason is not None:
            return None
        return gap_lengths(traces, where=self.where, min_gap_s=self.min_gap_s) or None

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
