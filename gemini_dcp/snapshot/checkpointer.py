"""Zero-stall snapshots: checkpoint every step while the next step trains.

Model states change only at the optimizer step, so the bytes of step t can be
copied into the memory tier *during the forward and backward passes of step
t+1*, straight from the live tensors (no staging copy, no second copy of the
model in host memory); only the next ``optimizer.step()`` must wait until this
rank's bytes are in the tier. That is what :class:`AsyncCheckpointer` does::

    ckpt = AsyncCheckpointer(GeminiStorageWriter(job_id="run1"), optimizer=opt, model=model)
    for step in range(start, steps):
        loss = model(batch).sum(); loss.backward()
        opt.step()                # waits (only) for the previous snapshot's local copy
        opt.zero_grad()
        ckpt.save(get_state_dict_for(model, opt), step)   # returns once the structure is snapshotted
    ckpt.close()                  # waits for the last commit, raises any error

``save()`` records the request and returns; a background thread runs
``dcp.save(..., process_group=<the dedicated gloo control group>)`` — never the
training group, so checkpoint collectives cannot interleave with or deadlock
against training collectives. The writer calls ``on_local_copy_done`` as soon
as this rank's bytes are copied and checksummed, before the commit
collectives and the peer replication; that releases the guard, an optimizer
step pre-hook installed for the user (``wait_copied()`` is the same guard
for loops without a ``torch.optim.Optimizer``). The commit (every rank's
write results gathered, the step record renamed into place) and the peer
copies finish later in the background; ``wait()`` waits for them.

The copy is paced by :mod:`gemini_dcp.snapshot.interleave`: the first iterations are
profiled (training collectives timed between optimizer steps), and the copy's
chunks are scheduled into the idle spans of the iteration; without a profile
they are copied as fast as possible. When the guard starts waiting, pacing
stops and the rest is copied at full speed.

What the guard protects, and what it cannot:

* Tensors modified by ``optimizer.step()`` (parameters, optimizer state) are
  copied as they are at the ``save()`` call.
* Tensors modified *outside* the optimizer step would be copied in whatever
  state they are in when their chunk is copied. Buffers updated in the
  forward pass (BatchNorm running statistics) are the common case: pass
  ``model=`` and the module's buffers are cloned at ``save()`` time (they are
  small). Anything else that writes checkpointed tensors between steps (EMA
  weights, manual ``param.data`` edits) must call ``wait_copied()`` first.
* Containers (dicts, lists) are copied at ``save()`` time, so mutating the
  state-dict structure afterwards is harmless; Python scalars are immutable.
* ``Stateful`` objects at the top level are turned into state dicts at the
  ``save()`` call, in the calling thread.

The bound: ``save(N)`` queues step N only once fewer than ``max_pending`` (default 1) earlier
saves are uncommitted (it waits for their commits, with a deadline), so the newest committed step
at a crash is at most ``max_pending`` older than the last step whose ``save()`` returned.

Errors of a background save are raised by the next ``save()``, ``wait()``,
``wait_copied()`` or ``close()`` (as :class:`AsyncCheckpointError` chained to
the original), never swallowed; every rank fails the same step together,
because the writer exchanges failures before committing. ``save()`` settles a
failure alike on every rank however early each rank learnt of it (see
``_room``): the step after it is queued on no rank.

``dcp.async_save`` works too, with :class:`AsyncGeminiStorageWriter` acting as
DCP's ``AsyncStager`` (its staging is the zero-copy structural snapshot above,
and the guard replaces DCP's staging future); see its docstring for the two
rules DCP leaves to the caller.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Literal

import torch

from ..commit.hooks import NO_HOOKS, SaveHooks
from ..core.config import parse_step
from ..dcp.writer import GeminiStorageWriter
from ..errors import ConfigError
from .handles import AsyncCheckpointError, SnapshotHandle
from .interleave import (
    DEFAULT_ALPHA,
    DEFAULT_MAX_CHUNK,
    DEFAULT_MAX_CV,
    DEFAULT_MIN_GAP_S,
    CollectiveProfiler,
    Pacer,
    Where,
    choose_chunk_bytes,
)
from .replay import PlanReplay
from .structure import StructureCache, buffer_storages

log = logging.getLogger(__name__)

__all__ = ["AsyncCheckpointer", "InterleaveOptions"]

DEFAULT_BANDWIDTH = 4e9  # bytes/s; replaced by the measured copy rate after the first chunks
DEFAULT_NET_BANDWIDTH = 1e9  # bytes/s of the peer replication; replaced by its measured rate likewise
PACE_DEADLINE_ITERATIONS = 1.5  # a copy paced into gaps goes at once this many (longest) iterations after it began
DEFAULT_SPREAD = 0.0  # InterleaveOptions.spread: off (measured no better on a 2-core host: docs/benchmarks.md)


# ---- the checkpointer ------------------------------------------------------------------------
@dataclasses.dataclass
class InterleaveOptions:
    """Knobs of the traffic interleaving (see :mod:`gemini_dcp.snapshot.interleave`)."""

    enabled: bool = True
    warmup: int = 3
    iterations: int = 20
    where: Where = "between"
    alpha: float = DEFAULT_ALPHA
    min_gap_s: float = DEFAULT_MIN_GAP_S
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK
    max_cv: float = DEFAULT_MAX_CV
    bandwidth: float | None = None  # bytes/s of the copy; measured when None
    spread: float = DEFAULT_SPREAD
    """Without profiled gaps, spread the copy over this fraction of the last iteration (the time between
    two ``optimizer.step()`` calls) instead of copying in one burst at full memory bandwidth: the rate is
    the last save's bytes over ``spread`` x that time; the step commits that much later. For hosts where a
    burst's memory traffic is what training feels; off by default (0: the copy goes at once) because on
    two ranks sharing two busy cores it measured worse (docs/async.md). A paced copy still ends well before
    the next ``optimizer.step()``, and the guard ends the cap at once if it does not. Needs ``optimizer=``.
    Must be in [0, 1)."""


_STOP = object()


def _check_options(interleave: Any, max_pending: Any, on_busy: Any, timeout_s: Any) -> None:
    """Refuse bad AsyncCheckpointer arguments with a ConfigError, before anything is created."""
    if not isinstance(interleave, (bool, InterleaveOptions)):
        raise ConfigError(f"interleave={interleave!r}: give True, False or an InterleaveOptions.")
    if isinstance(interleave, InterleaveOptions):
        spread = interleave.spread
        if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not 0 <= spread < 1:
            raise ConfigError(f"InterleaveOptions(spread={spread!r}): give the fraction of an iteration to spread a "
                              "copy over, in [0, 1) (0: copy at once).")
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise ConfigError(f"max_pending={max_pending!r}: the snapshots that may wait at once, an int >= 1.")
    if on_busy not in ("block", "skip"):
        raise ConfigError(f"on_busy={on_busy!r}: choose 'block' (wait for the previous save) or 'skip'.")
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ConfigError(f"timeout_s={timeout_s!r}: give a finite positive number of seconds, or None (the writer's).")


class AsyncCheckpointer:
    """Checkpoint every step into GEMINI memory tiers without stalling training.

    Args:
        writer: a :class:`GeminiStorageWriter` (reused for every save: its slot
            files stay mapped), or a zero-argument factory of one, or None to
            build one from ``writer_kwargs``.
        optimizer: optimizer(s) to guard: a step pre-hook waits for the
            outstanding local copy, a post-hook marks iteration starts for
            interleaving. Without one, call ``wait_copied()`` before
            modifying checkpointed tensors.
        model: module(s) whose buffers are cloned at ``save()`` (they may change
            in the forward pass).
        process_group: ranks that checkpoint together (default WORLD); the
            checkpoint runs on a dedicated gloo group of these ranks.
        interleave: ``True``/``False`` or :class:`InterleaveOptions`; profiling
            needs ``optimizer``.
        max_pending: saves that may be uncommitted at once, the new one
            included. ``save()`` queues a step only once fewer than
            ``max_pending`` earlier saves are uncommitted, so when ``save(N)``
            returns, step ``N - max_pending`` (or a newer one) is committed: with
            the default 1, the newest committed step at a crash is at most one
            older than the last step whose ``save()`` returned (docs/async.md,
            "The bound").
        on_busy: when ``max_pending`` earlier saves are still uncommitted:
            ``"block"`` (default) waits for their commits (at most ``timeout_s``,
            then :class:`AsyncCheckpointError`); ``"skip"`` returns a handle
            marked ``skipped`` (that step is not saved, the bound holds for the
            saves that were not skipped). With ``"skip"`` every ``save()`` runs one
            small all-reduce on a gloo group of its own, so that all ranks skip the
            same steps, and settle an earlier save's failure together (give every rank the same ``on_busy``).
        timeout_s: guard and close timeout (default: the writer's ``timeout_s``).
        planner: a DCP SavePlanner to plan every save with ``dcp.save``. Default
            (None): :class:`gemini_dcp.snapshot.replay.PlanReplay` — the first save
            (and any save whose state-dict structure changed) runs ``dcp.save``
            with ``DefaultSavePlanner``; later saves replay its plan, skipping
            DCP's planning collectives (about half the background CPU per save).
    """

    def __init__(
        self,
        writer: GeminiStorageWriter | Callable[[], GeminiStorageWriter] | None = None,
        *,
        optimizer: Any = None,
        model: Any = None,
        process_group: Any = None,
        interleave: bool | InterleaveOptions = True,
        max_pending: int = 1,
        on_busy: Literal["block", "skip"] = "block",
        timeout_s: float | None = None,
        planner: Any = None,
        **writer_kwargs: Any,
    ) -> None:
        _check_options(interleave, max_pending, on_busy, timeout_s)
        if writer is None:
            writer = GeminiStorageWriter(process_group=process_group, **writer_kwargs)
        elif writer_kwargs:
            raise ConfigError(
                f"writer options {sorted(writer_kwargs)} given with a writer: pass them either to the "
                "GeminiStorageWriter or as keyword arguments of AsyncCheckpointer, not both."
            )
        elif not isinstance(writer, GeminiStorageWriter):
            if not callable(writer):
                raise ConfigError(
                    f"writer={writer!r}: give a GeminiStorageWriter, a zero-argument factory of one, or None."
                )
            writer = writer()
            if not isinstance(writer, GeminiStorageWriter):
                raise ConfigError(f"the writer factory returned {type(writer).__name__}, not a GeminiStorageWriter.")
        if process_group is not None and writer.process_group is None:
            writer.process_group = process_group
        self.writer = writer
        self.timeout_s = float(timeout_s if timeout_s is not None else writer.options.timeout_s)
        # Collective: create the control group now, from the training thread, on every rank.
        from ..transport.comm import get_comm, new_scope  # noqa: PLC0415

        # A scope of its own: the background commit's collectives never share a group with a plain
        # dcp.save / dcp.load of the training thread (or another AsyncCheckpointer's commit).
        writer.comm_scope = new_scope("async")
        comm = get_comm(writer.options.timeout_s, writer.process_group, scope=writer.comm_scope)
        self.group = comm.group
        self._no_dist = not comm.distributed
        self.on_busy = on_busy
        # on_busy="skip": every rank must skip the same steps (a step queued on some ranks only would wait
        # for the others' commit collectives, and their guards for its copy). save() agrees on it with one
        # all-reduce on a group of its own (the training thread's; never the background commit's).
        self._skip_comm = (get_comm(writer.options.timeout_s, writer.process_group, scope=new_scope("async-skip"))
                           if on_busy == "skip" and comm.distributed else None)
        self.opts = interleave if isinstance(interleave, InterleaveOptions) else InterleaveOptions(enabled=bool(interleave))
        self._bandwidth = self.opts.bandwidth or DEFAULT_BANDWIDTH
        self._net_bandwidth = DEFAULT_NET_BANDWIDTH
        self.pacing = True  # False: copy as fast as possible even with a profile (A/B runs)
        self._clone_storages = buffer_storages(model)
        self.structure = StructureCache(self._clone_storages)  # save()'s walk, remembered
        self._model = model
        self._optimizers = [] if optimizer is None else (list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        self._hooks: list[Any] = []
        self._stream: Any = None
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.profiler: CollectiveProfiler | None = None
        if self.opts.enabled and self._optimizers:
            self.profiler = CollectiveProfiler(
                warmup=self.opts.warmup,
                iterations=self.opts.iterations,
                where=self.opts.where,
                min_gap_s=self.opts.min_gap_s,
                max_cv=self.opts.max_cv,
                exclude_groups=[self.group],
            )
            self.profiler.install(self._optimizers[0])
        for opt in self._optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._pre_step))
        if self._optimizers and self.opts.spread > 0:  # the iteration's length, for InterleaveOptions.spread only
            self._hooks.append(self._optimizers[0].register_step_pre_hook(self._iteration_mark))
        self._step_marks: list[float] = []  # perf_counter of the last optimizer.step() calls
        self._paced_bytes = 0  # the last finished save's bytes through the pacer
        self._chunks: dict[tuple[int, bool], int] = {}  # (profiler, replication) -> its pacers' chunk size
        self.max_pending = max_pending
        self._queue: queue.Queue[Any] = queue.Queue()  # bounded by save()'s wait for room (_room)
        # Queued saves not finished, and finished ones whose failure save() has not settled yet (in queue order).
        self._outstanding: list[SnapshotHandle] = []
        # The newest max_pending - 1 queued saves: the ones save(N) need not wait for. The same steps on every
        # rank (every rank queues the same steps), unlike which saves happen to have finished on this rank.
        self._tail: collections.deque[SnapshotHandle] = collections.deque(maxlen=max_pending - 1)
        self._lock = threading.Lock()
        self.history: list[SnapshotHandle] = []
        self.keep_history = 10_000
        self._closed = False
        self.planner = planner
        self.replay = PlanReplay(writer, self.group, no_dist=self._no_dist) if planner is None else None
        self._thread = threading.Thread(target=self._run, name="gemini-snapshot", daemon=True)
        self._thread.start()

    # -- hooks --
    def _pre_step(self, *_: Any) -> None:
        # The guard: wait for the local copy, but let a failed save surface at the next
        # save()/wait() rather than inside optimizer.step().
        with self._lock:
            outstanding = list(self._outstanding)
        pending = [h for h in outstanding if not h.copied.is_set()]
        if pending:
            # Training waits for a copy: an earlier save's replication ahead of it goes at full speed.
            for h in outstanding:
                if h.copied.is_set() and not h.finished.is_set():
                    h.hurry()
        for h in pending:
            h.wait_copied(self.timeout_s, surface=False)

    def _iteration_mark(self, *_: Any) -> None:
        marks = self._step_marks
        marks.append(time.perf_counter())
        if len(marks) > 3:
            del marks[0]

    def iteration_s(self) -> float | None:
        """The shorter of the last two intervals between ``optimizer.step()`` calls (None before two, and
        without ``InterleaveOptions.spread``: only the spread needs it, so only then is the training step timed)."""
        marks = list(self._step_marks)
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        return min(gaps) if gaps else None

    # -- API --
    def save(self, state_dict: dict[str, Any], step: int) -> SnapshotHandle:
        """Snapshot ``state_dict`` as ``step`` and queue its save (see the module docstring).

        Returns at once unless ``max_pending`` earlier saves are still uncommitted: then it first waits
        for the oldest of them to commit (``on_busy="block"``; at most ``timeout_s``, then
        :class:`AsyncCheckpointError`) or returns a handle marked ``skipped`` (``on_busy="skip"``). So
        once ``save(N)`` returned, step ``N - max_pending`` or a newer one is committed.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise AsyncCheckpointError("save() after close()")
        step = parse_step(step)
        handle = SnapshotHandle(step)
        if not self._room(step):
            handle.skipped = True
            self._finish(handle)
            with self._lock:
                self.history.append(handle)
            handle.blocked_s = time.perf_counter() - t0
            return handle
        snap = self.structure.snapshot(state_dict)
        ready = None
        if snap.devices and any(d.type == "cuda" for d in snap.devices):
            # The copy runs on a side stream of the background thread: order it after the
            # work queued so far (the optimizer step that produced this state).
            ready = torch.cuda.Event()
            ready.record()
        sd = snap.state_dict
        job = (handle, sd, ready, snap.generation)
        with self._lock:
            self._outstanding.append(handle)
            self._tail.append(handle)
            self.history.append(handle)
            if len(self.history) > self.keep_history:
                del self.history[: len(self.history) - self.keep_history]
        self._queue.put(job)
        handle.blocked_s = time.perf_counter() - t0
        return handle

    def _room(self, step: int) -> bool:
        """Whether ``step`` may queue: fewer than ``max_pending`` earlier saves uncommitted, after waiting for
        the oldest ones to commit (``on_busy="block"``, at most ``timeout_s``); False: skip it (``"skip"``).

        A failure of an earlier save is raised here, and the new step is not queued after it, on every rank
        alike. Which saves have finished when ``save()`` looks differs between ranks, so a failure is settled
        only where every rank knows that save finished: ``"block"``, the saves it waited for (all but the
        newest ``max_pending - 1``); ``"skip"``, every earlier save, once the all-reduce says some rank holds
        a failure. A rank that raised that failure already (its ``wait_copied()`` found it finished) skips the
        step rather than raise it twice: no rank queues a step the others do not (its commit would wait for
        them until the control group timed out, issue 55)."""
        if self.on_busy == "skip":
            return self._room_skip(step)
        with self._lock:
            tail = {id(h) for h in self._tail}
            older = [h for h in self._outstanding if id(h) not in tail]
            ahead = [h for h in self._outstanding if not h.finished.is_set()]
        if any(not h.finished.is_set() for h in older):
            for h in ahead:  # the caller is blocked on their commits: no reason to pace them
                h.hurry()
        self._wait_finished(step, older)
        return not self._settle(older)

    def _room_skip(self, step: int) -> bool:
        """``on_busy="skip"``: one all-reduce of (room, no unsettled failure) over every rank (alone: this
        rank's); a failure on any rank settles every earlier save on every rank (see :meth:`_room`)."""
        with self._lock:
            self._outstanding = [h for h in self._outstanding if self._kept(h)]  # committed saves: forgotten
            busy = sum(not h.finished.is_set() for h in self._outstanding)
            failed = any(h.finished.is_set() and h.error is not None and not h._settled for h in self._outstanding)
        room, clean = self._agree([int(busy <= self.max_pending - 1), int(not failed)])
        if clean:
            return room == 1
        with self._lock:
            earlier = list(self._outstanding)
        for h in earlier:
            h.hurry()
        self._wait_finished(step, earlier)
        self._settle(earlier)
        return self._no_dist  # alone: every earlier save finished, so there is room; else no rank queues it

    def _agree(self, values: list[int]) -> list[int]:
        """``on_busy="skip"``: ``values`` combined by MIN over every rank (one all-reduce; alone: ``values``)."""
        if self._skip_comm is None:
            return values
        from ..transport.p2p import transport_for  # noqa: PLC0415

        return transport_for(self._skip_comm).all_reduce_ints(values, "min")

    def _wait_finished(self, step: int, handles: list[SnapshotHandle]) -> None:
        """Wait (at most ``timeout_s`` in all) until ``handles`` finished (saves finish in queue order)."""
        deadline = time.perf_counter() + self.timeout_s
        for h in handles:
            if not h.finished.wait(max(0.0, deadline - time.perf_counter())):
                raise AsyncCheckpointError(
                    f"save of step {step}: step {h.step} did not commit within {self.timeout_s:g} s, and at most "
                    f"max_pending={self.max_pending} saves may be uncommitted at once (the bound on how far back a "
                    "crash can set the job). A rank stopped checkpointing, or the tier is too slow for this rate: "
                    "check every rank's log, or raise timeout_s / max_pending.")

    def _settle(self, handles: list[SnapshotHandle]) -> bool:
        """Settle the failures of the finished ``handles``: raise the first one not raised yet (log the
        others). Returns True where the new step must be skipped: some failed, every one of them was raised
        before (by ``wait_copied()``), and other ranks raise or skip this step."""
        with self._lock:
            failed = [h for h in handles if h.finished.is_set() and h.error is not None and not h._settled]
            for h in failed:
                h._settled = True
            self._outstanding = [h for h in self._outstanding if self._kept(h)]
        self._surface([h for h in failed if not h._surfaced])
        if failed and not self._no_dist:
            log.warning("gemini_dcp: the save after the failed checkpoint of step %s is skipped: every rank "
                        "raises or skips it (this rank raised that failure from wait_copied() already)", failed[0].step)
        return bool(failed) and not self._no_dist

    @staticmethod
    def _kept(h: SnapshotHandle) -> bool:
        """Whether ``_outstanding`` keeps ``h``: not finished, or a failure save() has not settled yet."""
        return not h.finished.is_set() or (h.error is not None and not h._settled)

    def wait_copied(self, timeout: float | None = None) -> None:
        """Block until this rank's bytes of every outstanding save are in the tier (the guard)."""
        with self._lock:
            pending = [h for h in self._outstanding if not h.copied.is_set()]
        for h in pending:
            h.wait_copied(self.timeout_s if timeout is None else timeout)
        self._raise_pending(settle=False)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every outstanding save is committed; raise the first unreported error."""
        with self._lock:
            pending = list(self._outstanding)
        for h in pending:  # the caller is blocked: no reason to pace the copies any more
            h.hurry()
        deadline = None if timeout is None else time.perf_counter() + timeout
        for h in pending:
            h.finished.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        self._raise_pending()
        for h in pending:
            if not h.finished.is_set():
                raise AsyncCheckpointError(f"step {h.step}: the checkpoint did not commit within {timeout} s")

    def close(self) -> None:
        """Wait for all saves, stop the thread, remove the hooks; raises a pending error."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(self.timeout_s)
        finally:
            self._queue.put(_STOP)
            self._thread.join(timeout=self.timeout_s)
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            if self.profiler is not None:
                self.profiler.remove()
            self.writer.hooks = NO_HOOKS
            self.structure.forget()  # the cached walk holds the last state's tensors

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def last_committed_step(self) -> int | None:
        with self._lock:
            done = [h.step for h in self.history if h.finished.is_set() and h.error is None and not h.skipped]
        return max(done) if done else None

    def stats(self) -> dict[str, Any]:
        hs = [h for h in self.history if h.finished.is_set() and not h.skipped]
        out: dict[str, Any] = {"saves": len(hs), "bandwidth": self._bandwidth, "replication_bandwidth": self._net_bandwidth}
        if self.profiler is not None:
            out["profile"] = self.profiler.summary()
        if self.replay is not None:
            out["plans"] = {"planned": self.replay.planned, "replayed": self.replay.replayed}
        return out

    # -- internals --
    def _raise_pending(self, *, settle: bool = True) -> None:
        """Forget finished saves; raise the first failure not reported yet (log the others). ``settle``: the
        caller knows these saves finished on every rank (``wait()``, ``close()``); else (``wait_copied()``)
        a failure stays for the next ``save()`` to settle alike on every rank (see :meth:`_room`)."""
        with self._lock:
            failed = [h for h in self._outstanding if h.finished.is_set() and h.error is not None and not h._surfaced]
            if settle:
                for h in self._outstanding:
                    if h.finished.is_set() and h.error is not None:
                        h._settled = True
            self._outstanding = [h for h in self._outstanding if self._kept(h)]
        self._surface(failed)

    @staticmethod
    def _surface(failed: list[SnapshotHandle]) -> None:
        """Raise the first of ``failed`` (failures not reported yet, oldest first); log the others, so each
        failure reaches the caller once."""
        for h in failed[1:]:
            h._surfaced = True
            log.error("asynchronous checkpoint of step %s also failed: %r", h.step, h.error)
        if failed:
            failed[0]._raise(settle=False)  # the caller settled what it may (save() or wait(); wait_copied() not)

    def _finish(self, handle: SnapshotHandle) -> None:
        handle.copied.set()
        handle.finished.set()

    def _gap_pacer(self, bandwidth: float, *, one_iteration: bool = False) -> Pacer | None:
        """A pacer into the profiled gaps at ``bandwidth``; None without a profile (or pacing off)."""
        prof = self.profiler
        gaps = prof.gaps() if self.pacing and prof is not None and prof.done.is_set() else None
        if not gaps or prof is None:
            return None
        alpha = self.opts.alpha
        # The chunk size is chosen once per profile (at the rate learned by then), not at every save: it is the
        # writer's copy block, and a block that changes (the learned rate moves, the chunk flips between powers of
        # two) rebuilt the save's program and dropped its kept source views — every other save then took the
        # unfused per-item copy, twice the background CPU (measured: 12 -> 26-30 ms per save in torchtitan).
        key = (id(prof), one_iteration)
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = self._chunks[key] = choose_chunk_bytes(gaps.values(), bandwidth, alpha,
                                                           max_chunk_bytes=self.opts.max_chunk_bytes)
        # The guard hurries a copy when the next optimizer step is due; should none come (training ended),
        # the copy stops waiting for gaps after an iteration and a half.
        traces = prof.profile() or []
        deadline = PACE_DEADLINE_ITERATIONS * max(t.deadline for t in traces) if traces else None
        return Pacer(gaps, prof.timeline, where=self.opts.where, bandwidth=bandwidth, alpha=alpha, chunk_bytes=chunk,
                     one_iteration=one_iteration, deadline_s=deadline)

    def _spread_rate(self) -> float | None:
        """The copy's rate cap without gaps (``InterleaveOptions.spread``); None: uncapped."""
        it = self.iteration_s()
        spread = self.opts.spread
        if not (self.opts.enabled and self.pacing and spread > 0 and it and self._paced_bytes > 0):
            return None
        rate = self._paced_bytes / (spread * it)
        return rate if rate < self._bandwidth else None  # a cap above the copy's own rate changes nothing

    def _make_pacer(self) -> Pacer | None:
        # No profile (yet), or no gaps in it: spread over the iteration (or as fast as possible); the pacer
        # also measures the copy rate.
        return self._gap_pacer(self._bandwidth) or Pacer(bandwidth=self._bandwidth,
                                                         chunk_bytes=self.opts.max_chunk_bytes, rate=self._spread_rate())

    def _make_replication_pacer(self) -> Pacer | None:
        """The pacer of the peer replication: only with replicas and a profile (else one message,
        unpaced). Its gaps are the same; its rate is the network's; it uses the gaps of one
        iteration only, since no guard bounds the replication."""
        if (self.writer.options.peer.replicas <= 1 and self.writer.options.peer.parity_group is None) or self._no_dist:
            return None
        return self._gap_pacer(self._net_bandwidth, one_iteration=True)

    def _copy_stream(self, ready: Any) -> Any:
        """CUDA state: copy on a dedicated lowest-priority stream that waits for ``ready``
        (training kernels on other streams are not serialized behind the D2H copies)."""
        if ready is None:
            return contextlib.nullcontext()
        if self._stream is None:
            torch.cuda.set_device(self._device)
            self._stream = torch.cuda.Stream(device=self._device, priority=0)  # 0 = lowest priority
        self._stream.wait_event(ready)
        return torch.cuda.stream(self._stream)

    def _run(self) -> None:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            handle, sd, ready, generation = job
            t_start = time.perf_counter()
            c_start = time.thread_time()
            handle.started_s = t_start - handle.t_submit
            pacer = self._make_pacer()
            rpacer = self._make_replication_pacer()
            handle._pacer, handle._replication_pacer = pacer, rpacer
            if handle._hurry and pacer is not None:
                pacer.hurry()
            if handle._hurry_replication and rpacer is not None:
                rpacer.hurry()

            def copied(_step: int, h: SnapshotHandle = handle) -> None:
                h.copy_s = time.perf_counter() - t_start
                h.copied.set()

            self.writer.hooks = SaveHooks(pace=pacer, replication_pace=rpacer, on_local_copy_done=copied)
            try:
                with self._copy_stream(ready):
                    if self.replay is not None:
                        handle.metadata = self.replay.save(sd, handle.step, generation=generation)
                    else:
                        handle.metadata = dcp.save(
                            sd,
                            storage_writer=self.writer,
                            checkpoint_id=handle.step,
                            planner=self.planner,
                            process_group=self.group,
                            no_dist=self._no_dist,
                        )
            except BaseException as exc:  # surfaced by the next save / wait / close
                handle.error = exc
                log.debug("async save of step %s failed", handle.step, exc_info=True)
            finally:
                self.writer.hooks = NO_HOOKS
                try:  # statistics only: whatever they raise, the handle finishes (the guard waits on it)
                    if rpacer is not None:
                        handle.replication_pacer_stats = rpacer.stats.as_dict()
                        if rpacer.stats.chunks >= 4 and not rpacer.hurried:
                            self._net_bandwidth = rpacer.bandwidth
                    if pacer is not None:
                        st = pacer.stats
                        handle.pacer_stats = st.as_dict()
                        if st.chunks >= 4 and not pacer.hurried:
                            self._bandwidth = pacer.bandwidth
                        if handle.error is None:
                            self._paced_bytes = st.bytes_in_spans + st.bytes_leftover + st.bytes_hurried
                except Exception:  # noqa: BLE001 - a pacer without statistics: logged, not fatal
                    log.warning("gemini_dcp: step %s: the pacer's statistics could not be read", handle.step,
                                exc_info=True)
                finally:
                    handle._pacer = handle._replication_pacer = None
                    handle.total_s = time.perf_counter() - handle.t_submit
                    handle.cpu_s = time.thread_time() - c_start
                    del sd
                    self._finish(handle)
