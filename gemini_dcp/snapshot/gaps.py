"""Traffic interleaving, part 2: the gaps of a profiled iteration and the packing of chunks
into them, as pure functions (see :mod:`gemini_dcp.snapshot.interleave` for the algorithm).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterable, Literal, Sequence

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
