"""Traffic interleaving, part 3: the live timeline of the running iteration and the online
greedy :class:`Pacer` the copy loop calls before each chunk
(see :mod:`gemini_dcp.snapshot.interleave` for the algorithm).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from .gaps import DEFAULT_ALPHA, DEFAULT_MAX_CHUNK, MIN_CHUNK, Where, span_capacity


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
    rate: float = 0.0  # bytes/s the copy was capped at without gaps (0: uncapped)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Pacer:
    """The online greedy scheduler, called by the copy loop before each chunk.

    ``gaps`` maps positions to gap lengths (:func:`gap_lengths`); ``timeline``
    is the live view fed by the collective wrappers. With no gaps (or no
    timeline) every chunk goes at once and the pacer only measures the copy
    rate — unless ``rate`` (bytes/s) is given: then chunk *k* waits until
    ``rate`` would have carried the bytes before it since the first chunk, so
    the copy is spread over the iteration instead of a burst at full memory
    bandwidth (``InterleaveOptions.spread``). ``hurry()`` ends any wait at once;
    so does ``deadline_s`` after the first chunk (a copy waiting for gaps).
    Thread-safe for one copying thread plus any number of ``hurry()``.
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
        rate: float | None = None,
        deadline_s: float | None = None,
    ) -> None:
        if bandwidth <= 0:
            raise ValueError("bandwidth must be positive")
        if rate is not None and not rate > 0:
            raise ValueError("rate must be positive (or None: uncapped)")
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
        self.rate = None if self.gaps else rate  # the gaps pace the copy when there are any
        if self.rate is not None:
            self.stats.rate = float(self.rate)
        # deadline_s: this long after the first chunk, every chunk goes at once — the bound of a copy that
        # waits for gaps of an iteration that never comes (training ended, or stalled, without a guard call).
        self.deadline_s = deadline_s
        self._t0: float | None = None  # the first chunk's time (the rate's and the deadline's origin)
        self._sent = 0  # bytes released so far

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

    def _at_rate(self, rate: float) -> None:
        """Wait until ``rate`` would have carried the bytes released so far (or a hurry)."""
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
            return
        wait = self._t0 + self._sent / rate - now
        if wait > 0:
            self._hurry.wait(wait)
            self.stats.waited_s += self._clock() - now

    def __call__(self, nbytes: int) -> None:
        self._learn(self._clock())
        self.stats.chunks += 1
        tl = self.timeline
        if not self.gaps or tl is None:
            if self.rate is not None and not self._hurry.is_set():
                self._at_rate(self.rate)
            if self._hurry.is_set():
                self.stats.bytes_hurried += nbytes
            else:
                self.stats.bytes_leftover += nbytes
            self._sent += nbytes
            self._last = (self._clock(), nbytes)
            return
        t_wait = self._clock()
        if self._t0 is None:
            self._t0 = t_wait
        late = None if self.deadline_s is None else self._t0 + self.deadline_s
        with tl.cond:
            while True:
                if self._hurry.is_set():
                    self.stats.bytes_hurried += nbytes
                    break
                if late is not None and self._clock() >= late:
                    self.stats.bytes_leftover += nbytes  # past the deadline: at once
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
