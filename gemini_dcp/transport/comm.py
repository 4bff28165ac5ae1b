"""The control plane: a dedicated gloo process group for checkpoint traffic.

Checkpoint collectives never run on the training group, so they cannot
deadlock with, or reorder, training collectives (even when training uses NCCL
or its own gloo group). One group is created per (rank set, ``timeout_s``, scope) and
shared by every writer and reader with those settings (the scope separates threads:
an ``AsyncCheckpointer``'s background commit has one of its own, see :func:`get_comm`): **all ranks must reach
the first save/load with a given ``timeout_s`` together**, as
``torch.distributed.new_group`` is collective. Every operation on the group
waits at most its ``timeout_s`` (gloo's timeout, fixed when the group is made,
which is why a writer with another ``timeout_s`` gets a group of its own).

**Failures.** A transport error on the group (a peer that timed out, died or
closed its connection) is raised as :class:`~gemini_dcp.errors.RestartRequiredError`
(a ``PeerError``) naming the collective, the ranks, the time waited and what to
do. Such a group is left in an unknown state (messages of the failed operation
may still arrive), so the process marks its control plane *broken*: every later
checkpoint operation raises ``RestartRequiredError`` at once instead of hanging
or failing obscurely. The job must restart (torchrun restarts the worker group
when a worker exits with an error). The one exception is a failed peer transfer
that every rank then agreed on: all ranks replace the group together
(:meth:`Comm.rebuild`) and go on (``on_peer_failure="degrade"``).

The bound on a save's wait is *not* ``timeout_s`` alone: DCP's own planning
gathers run on the process group passed to ``dcp.save`` (the training group)
and wait that group's timeout (``init_process_group(timeout=...)``, or pass
``process_group=`` a gloo group with a short timeout). See docs/failure-semantics.md.

Without an initialized process group everything degrades to a single process.

**Messages are not code.** The object collectives send pickles, as torch's do, but decode them
with the restricted unpickler and the control messages' allow-list (:mod:`gemini_dcp.transport.wire`),
never torch's unrestricted ``pickle.Unpickler``; an announced length over the bound is refused before
anything is allocated (:class:`~gemini_dcp.errors.UntrustedDataError`).

This module holds the group cache, the object collectives (gather, broadcast, the
store agreement) and the broken-control-plane state; the point-to-point byte
transfers and the small integer all-reduce are the transport's
(:mod:`gemini_dcp.transport.p2p`), the only other module that calls ``torch.distributed``.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from ..errors import RestartRequiredError
from . import exit_guard, wire

T = TypeVar("T")

log = logging.getLogger(__name__)

_GROUPS: dict[tuple[tuple[int, ...], float, str], dist.ProcessGroup] = {}
_LOCK = threading.Lock()
_SCOPE_COUNT = itertools.count(1)
# Why this process's control plane is unusable (None: it is usable); set on the first transport failure.
_BROKEN: str | None = None
# Groups replaced by rebuild(): kept alive, as their failed operations may still hold buffers.
_RETIRED: list[Any] = []
# A store agreement is abandoned after this many timeout_s (its own store waits take at most 1.5 x).
AGREE_DEADLINE_FACTOR = 2.0
# Making a control group is abandoned after this many timeout_s, plus GROUP_DEADLINE_SLACK_S (gloo's own
# connect waits timeout_s for the last peer to arrive).
GROUP_DEADLINE_FACTOR = 2.0
GROUP_DEADLINE_SLACK_S = 5.0
# ... or after this many, if this rank's first post to the store is still unanswered (a stalled host).
POST_GIVE_UP = 1.25
_PHASE_CONNECT = "connecting to the store"
_PHASE_POST = "posting this rank's outcome"
_PHASE_PROBE = "checking that the store answers"

RESTART_HINT = (
    "The checkpoint control group of this process is unusable from now on: every later save or load "
    "raises RestartRequiredError. Restart the job (torchrun restarts the worker group when a worker exits "
    "with an error, then resumes from the newest committed step). If the peer was merely slow, raise "
    "timeout_s; the training group's timeout (init_process_group(timeout=...)) bounds DCP's own gathers."
)


def broken_reason() -> str | None:
    """Why this process's checkpoint control plane is broken, or None if it is usable."""
    return _BROKEN


def mark_broken(reason: str) -> None:
    """Mark the control plane of this process broken (first reason kept); later uses raise RestartRequiredError."""
    global _BROKEN
    with _LOCK:
        if _BROKEN is None:
            _BROKEN = reason
            log.error("checkpoint control group broken: %s", reason)


def restart_required(reason: str) -> RestartRequiredError:
    """Mark the control plane broken for ``reason`` and return the error to raise (reason + what to do)."""
    mark_broken(reason)
    return RestartRequiredError(f"{reason}. {RESTART_HINT}")


def check_usable() -> None:
    """Raise RestartRequiredError if an earlier transport failure broke the control plane."""
    reason = _BROKEN
    if reason is not None:
        raise RestartRequiredError(f"The checkpoint control group broke earlier in this process ({reason}). {RESTART_HINT}")


def transport_errors() -> tuple[type[BaseException], ...]:
    """What torch raises for a gloo timeout / lost peer (DistBackendError derives from RuntimeError)."""
    return (RuntimeError, ConnectionError, TimeoutError)


class Comm:
    """Collectives over the checkpoint control group; a trivial one for a single process."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float | None = None) -> None:
        self.group = group
        self.timeout_s = timeout_s
        # Why the last agree_via_store returned None ("" when it did not).
        self.agreement_failure = ""
        if group is None:
            self.rank, self.world_size = 0, 1
            self.ranks: tuple[int, ...] = (0,)
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.ranks = tuple(dist.get_process_group_ranks(group))

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def failure(self, what: str, exc: BaseException, waited_s: float, *, peer: int | None = None) -> str:
        """The reason text of a transport failure of ``what`` on this group (for messages)."""
        who = f"with rank {peer}" if peer is not None else f"among ranks {list(self.ranks)}"
        bound = f"timeout_s={self.timeout_s:g}" if self.timeout_s is not None else "its timeout"
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return (
            f"{what} {who} failed on rank {self.global_rank(self.rank)} after {waited_s:.1f} s ({bound}): "
            f"{type(exc).__name__}: {first}"
        )

    def run(self, what: str, fn: Callable[..., T], *args: Any, peer: int | None = None, **kwargs: Any) -> T:
        """Run one operation on the group; a transport failure marks the control plane broken and
        raises RestartRequiredError (what, with whom, after how long, what to do)."""
        check_usable()
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        except transport_errors() as exc:
            raise restart_required(self.failure(what, exc, time.monotonic() - t0, peer=peer)) from exc

    def all_gather_object(self, obj: T) -> list[T]:
        """Collective over the control group: every rank's ``obj``, in group rank order (decoded with the
        control plane's allow-list, :mod:`gemini_dcp.transport.wire`: UntrustedDataError for anything else)."""
        if not self.distributed:
            return [obj]
        return self._gather_objects(obj, self.run)

    def broadcast_object(self, obj: T, src: int) -> T:
        """Broadcast ``obj`` from group rank ``src`` to all ranks (collective); decoded as
        :meth:`all_gather_object`'s on the other ranks, ``obj`` itself on ``src``."""
        if not self.distributed:
            return obj
        root = self.global_rank(src)
        what = f"broadcast_object from rank {root}"
        mine = self.rank == src
        blob = wire.encode(obj) if mine else b""
        size = torch.tensor([len(blob)], dtype=torch.int64)
        self.run(what, dist.broadcast, size, src=root, group=self.group)
        n = wire.checked_length(what, [int(size.item())], wire.MAX_OBJECT_BYTES)
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if mine else torch.empty(n, dtype=torch.uint8)
        self.run(what, dist.broadcast, buf, src=root, group=self.group)
        if mine:
            return obj
        decoded: T = wire.decode(buf.numpy().tobytes(), f"{what} (its control message)")
        return decoded

    def try_all_gather_object(self, obj: T) -> tuple[list[T] | None, str]:
        """Like :meth:`all_gather_object`, but a transport failure returns ``(None, reason)``
        without marking the control plane broken (the caller recovers, see :meth:`agree_via_store`)."""
        if not self.distributed:
            return [obj], ""
        check_usable()
        t0 = time.monotonic()

        def run(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        try:
            return self._gather_objects(obj, run), ""
        except transport_errors() as exc:
            return None, self.failure("all_gather_object", exc, time.monotonic() - t0)

    def _gather_objects(self, obj: Any, run: Callable[..., Any]) -> list[Any]:
        """Every rank's pickle of ``obj`` (sizes first, then the pickles padded to the longest), decoded."""
        what = "all_gather_object"
        blob = wire.encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        run(what, dist.all_gather, sizes, torch.tensor([len(blob)], dtype=torch.int64), group=self.group)
        lengths = [int(s.item()) for s in sizes]
        longest = wire.checked_length(what, lengths, wire.MAX_OBJECT_BYTES)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        run(what, dist.all_gather, out, mine, group=self.group)
        return [wire.decode(o[:n].numpy().tobytes(), f"{what}: group rank {r}'s control message")
                for r, (o, n) in enumerate(zip(out, lengths))]

    def agree_via_store(self, topic: str, obj: Any) -> list[Any] | None:
        """Collective, over the default group's key-value store (not the gloo connections,
        which a gloo timeout closes): every rank's ``obj`` (JSON-able), or None.

        Rank 0 proposes every rank's value once all arrived within ``timeout_s``, else
        "abort"; a rank that waited ``1.5 * timeout_s`` for the decision in vain proposes
        "abort". The first proposal wins (an atomic compare-and-set), so every rank that
        returns returns the same answer: all ranks get the values, or all get None.
        ``topic`` must be the same on every rank and unique per agreement.

        **Every wait is bounded.** The store is served by one process (rank 0's without
        torchrun's agent): when that process is stalled (SIGSTOP, a hung host) its socket
        still accepts requests but never answers, and a store client call may then block
        far beyond any timeout it was given (the client waits for the answer to its
        cancelled wait without a deadline). So the whole exchange runs on a helper thread
        that this rank abandons after ``2 * timeout_s`` (:data:`AGREE_DEADLINE_FACTOR`), or
        after ``1.25 * timeout_s`` while its post (and a check that the store took it) is
        unanswered (:data:`POST_GIVE_UP`):
        it then returns None, and :attr:`agreement_failure` says why (which phase, after
        how long). All-or-nothing is kept across such a give-up: every rank posts the wall
        clock times until which it will accept a decision (its entry plus ``1.5 * timeout_s``)
        and by which its post must have been taken (its entry plus ``timeout_s``), and rank 0
        proposes the values only before the earliest of the former (less ``0.25 * timeout_s``)
        and of the latter (else "abort"), so a rank that gave up can never be the only one not
        to commit.
        """
        self.agreement_failure = ""
        if not self.distributed:
            return [obj]
        timeout = float(self.timeout_s or 300.0)
        limit = AGREE_DEADLINE_FACTOR * timeout
        state: dict[str, str] = {"phase": _PHASE_CONNECT}
        t0 = time.monotonic()
        result: dict[str, Any] = {}

        def exchange() -> None:
            try:
                result["value"] = self._store_exchange(topic, obj, timeout, state)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
                result["error"] = exc

        worker = threading.Thread(target=exchange, name=f"gemini-dcp-agree-{topic}", daemon=True)
        worker.start()
        # A running store host answers at once (its server thread, not its main thread): a post
        # and probe still unanswered after POST_GIVE_UP x timeout_s mean the host is stalled.
        worker.join(POST_GIVE_UP * timeout)
        if worker.is_alive() and state["phase"] not in (_PHASE_CONNECT, _PHASE_POST, _PHASE_PROBE):
            worker.join(max(0.0, limit - (time.monotonic() - t0)))
        waited = time.monotonic() - t0
        if worker.is_alive():  # the store (the process serving it) does not answer: give up
            self.agreement_failure = (
                f"agreement {topic!r} over the default store: no answer while {state['phase']} after "
                f"{waited:.1f} s (deadline {AGREE_DEADLINE_FACTOR:g} x timeout_s={timeout:g}); the process "
                f"serving the store (rank 0 without torchrun's agent, else the torchrun agent) is stalled or gone"
            )
            log.error("%s", self.agreement_failure)
            return None
        if "error" in result:
            exc = result["error"]
            self.agreement_failure = (
                f"agreement {topic!r} over the default store failed while {state['phase']} after "
                f"{waited:.1f} s: {type(exc).__name__}: {str(exc).strip()[:300]}"
            )
            log.error("%s", self.agreement_failure)
            return None
        decided = result["value"]
        if decided is None:
            self.agreement_failure = (
                f"agreement {topic!r} over the default store: not every rank reported within "
                f"timeout_s={timeout:g} (decided 'abort' after {waited:.1f} s)"
            )
        return decided

    def _store_exchange(self, topic: str, obj: Any, timeout: float, state: dict[str, str]) -> list[Any] | None:
        """The store protocol of :meth:`agree_via_store` (runs on its helper thread; ``state['phase']``
        names the step under way, for the give-up message). Returns the values, or None for "abort"."""
        store = dist.distributed_c10d._get_default_store()
        prefix = f"gemini_dcp/agree/{'-'.join(map(str, self.ranks))}/{topic}/"
        decision_key = prefix + "decision"
        now = time.time()  # wall clock: comparable across nodes
        # until: this rank accepts a decision only until then; posted_by: its post counts only if
        # the store took it by then (else this rank may have given up on an unanswered post).
        mine = {"value": obj, "until": now + 1.5 * timeout, "posted_by": now + timeout}
        state["phase"] = _PHASE_POST
        store.set(prefix + str(self.rank), json.dumps(mine))
        state["phase"] = _PHASE_PROBE  # a set may return unanswered: a check needs the host's answer
        store.check([prefix + str(self.rank)])
        if self.rank == 0:
            keys = [prefix + str(r) for r in range(self.world_size)]
            state["phase"] = "waiting for every rank's outcome"
            try:
                store.wait(keys, timedelta(seconds=timeout))
                posted = [json.loads(store.get(k)) for k in keys]
                # Values only while every rank still accepts them: one that gave up never commits.
                now = time.time()
                late = (now >= min(float(p["until"]) for p in posted) - 0.25 * timeout
                        or now >= min(float(p["posted_by"]) for p in posted))
                proposal = "abort" if late else json.dumps([p["value"] for p in posted])
            except Exception:  # noqa: BLE001 - a rank did not report in time
                proposal = "abort"
            state["phase"] = "recording the decision"
            decided = store.compare_set(decision_key, "", proposal)
        else:
            state["phase"] = "waiting for rank 0's decision"
            try:
                store.wait([decision_key], timedelta(seconds=1.5 * timeout))
            except Exception:  # noqa: BLE001 - rank 0 did not decide in time: propose abort
                pass
            state["phase"] = "proposing 'abort' (no decision from rank 0)"
            decided = store.compare_set(decision_key, "", "abort")
        text = decided.decode() if isinstance(decided, bytes) else str(decided)
        return None if text == "abort" else json.loads(text)

    def barrier(self) -> None:
        """Collective: wait for every rank of the control group."""
        if self.distributed:
            self.run("barrier", dist.barrier, group=self.group)

    def rebuild(self, reason: str) -> None:
        """Collective over this group's ranks: replace the group by a fresh one after a peer transfer
        failed and every rank agreed on it, so the failed transfer's late messages can never meet a
        later operation. The old group is retired (kept alive, never used). A failure here marks
        the control plane broken (RestartRequiredError)."""
        if not self.distributed:
            return
        check_usable()
        timeout = float(self.timeout_s or 300.0)
        t0 = time.monotonic()
        try:
            fresh = _new_group(self.ranks, timeout)  # bounded: RestartRequiredError on a stalled store host
        except transport_errors() as exc:
            why = self.failure(f"replacing the control group after: {reason};", exc, time.monotonic() - t0)
            raise restart_required(why) from exc
        with _LOCK:
            _RETIRED.append(self.group)
            for key, group in list(_GROUPS.items()):
                if group is self.group:
                    _GROUPS[key] = fresh
        self.group = fresh
        log.warning("checkpoint control group replaced after a failed peer transfer (%s)", reason)


def _bounded(what: str, fn: Callable[[], T], limit_s: float) -> T:
    """``fn()`` on a helper thread, waited for at most ``limit_s``; past that raises TimeoutError
    (the thread is abandoned: it may stay blocked in a call that ignores its own timeout)."""
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=call, name=f"gemini-dcp-bounded: {what}", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise TimeoutError(f"{what}: no answer within {limit_s:g} s (the default store's host is stalled or gone)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def agree_on_default_store(key: str, proposal: str, limit_s: float) -> str | None:
    """The value every rank of the default group gets for ``key``: the first ``proposal`` posted.

    Not collective (no rank waits for another): each rank offers its own proposal with one
    ``compare_set`` on the default group's key-value store, which keeps the first and hands it
    back to everyone, however the group was initialized (torchrun, ``env://``, ``tcp://``,
    ``file://``, a ``Store`` passed in). ``None`` without an initialized group or when the store
    cannot compare-and-set; TimeoutError when its host does not answer within ``limit_s``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = dist.distributed_c10d._get_default_store()

    def offer() -> str | None:
        try:
            got = store.compare_set(key, "", proposal)
        except (NotImplementedError, RuntimeError):  # a Store without compare_set
            return None
        return got.decode() if isinstance(got, bytes) else str(got)

    return _bounded(f"agreeing on {key!r} over the default store", offer, limit_s)


def _new_group(ranks: tuple[int, ...], timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` whose every operation waits at most ``timeout_s``.

    Over all ranks of the default group: ``new_group`` is collective over WORLD. Over a
    subset: only its members take part (``use_local_synchronization``). Made on a helper thread and
    given up after :data:`GROUP_DEADLINE_FACTOR` x ``timeout_s`` (+ a slack): gloo meets its peers through the
    default store, and once a store wait has timed out torch's TCPStore client waits for the
    server's answer to its cancel with no deadline, forever if the store's host is stopped (a hung
    rank 0). Then RestartRequiredError, and this process's control plane is broken.
    """
    timeout = timedelta(seconds=timeout_s)

    def make() -> dist.ProcessGroup:
        if len(ranks) == dist.get_world_size():
            return dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout)
        return dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)

    limit = GROUP_DEADLINE_FACTOR * timeout_s + GROUP_DEADLINE_SLACK_S
    try:
        return _bounded(f"making the checkpoint control group of ranks {list(ranks)}", make, limit)
    except TimeoutError as exc:
        raise restart_required(f"{exc}: a peer or the default store's host stopped answering") from exc


def new_scope(what: str) -> str:
    """A control-group scope of its own for ``what`` (e.g. one ``AsyncCheckpointer``): see :func:`get_comm`.

    Deterministic across ranks as long as every rank makes its scopes in the same order (the
    objects that take one are made collectively, in the same order on every rank).
    """
    return f"{what}-{next(_SCOPE_COUNT)}"


def get_comm(timeout_s: float, process_group: dist.ProcessGroup | None = None, *, scope: str = "") -> Comm:
    """The control-plane Comm for the ranks of ``process_group`` (default: WORLD), ``timeout_s`` and ``scope``.

    Collective on first use of a (ranks, ``timeout_s``, ``scope``) triple: all ranks of the default
    group (of ``process_group`` when it is a subset) must call it with the same arguments.
    ``scope`` separates the groups of collectives that may run at the same time in different
    threads (an ``AsyncCheckpointer``'s background commit beside a plain ``dcp.save`` or ``dcp.load``
    of the training thread): two threads' collectives on one group could pair up differently on
    different ranks. The default scope ``""`` is shared by every writer and reader of the process.
    Raises RestartRequiredError once an earlier transport failure broke the control plane.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return Comm(None)
    exit_guard.install()  # a rank leaving without destroy_process_group must not abort in gloo's threads
    base = process_group or dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(base))
    if len(ranks) == 1:
        return Comm(None)
    check_usable()
    key = (ranks, float(timeout_s), scope)
    group = _GROUPS.get(key)
    if group is None:
        group = _new_group(ranks, float(timeout_s))
        with _LOCK:
            _GROUPS[key] = group
    return Comm(group, float(timeout_s))


def reset_groups() -> None:
    """Forget cached groups and a broken state (after ``destroy_process_group`` and a new init)."""
    global _BROKEN
    with _LOCK:
        _GROUPS.clear()
        _RETIRED.clear()
        _BROKEN = None
