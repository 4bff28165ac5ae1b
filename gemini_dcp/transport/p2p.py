"""The transport seam: checkpoint bytes between ranks, and the small integer all-reduce.

The peer tier (replication on save, chunk fetches on restore) and the agreements of
a save (the writer's pre-write agreement, plan replay) move data between ranks only
through a :class:`Transport`:

- **post** receives into caller-owned buffers and sends of buffers
  (:meth:`Transport.post_recv`, :meth:`Transport.post_send`), or a slot's byte range
  cut into wire messages (:meth:`Transport.recv_ranges`, :meth:`Transport.send_ranges`,
  sizes from :func:`messages`; a paced send calls its pacer once per message);
- **wait** for a posted transfer with a deadline (:meth:`Transport.wait`): a failure
  ends in the package's error, :class:`~gemini_dcp.errors.PeerError` naming the
  transfer, the peer, the time waited and the bound, which the caller recovers from
  (replication agrees on it and replaces the group), or with ``fatal=True``
  :class:`~gemini_dcp.errors.RestartRequiredError` after marking the control plane
  broken (a restore cannot recover from a lost transfer);
- **all-reduce** a few int64 values by MIN, MAX or SUM (:meth:`Transport.all_reduce_ints`).

The all-reduce sits here rather than beside the object collectives of
:mod:`~gemini_dcp.transport.comm` because it is a tensor collective that another
transport (NCCL, a parity scheme) would run on its own group too; the object
collectives stay pickled gloo calls on the control group whatever moves the bytes.

:class:`GlooTransport` is the default implementation: ``torch.distributed``
point-to-point on the dedicated gloo control group of a :class:`~gemini_dcp.transport.comm.Comm`
(one per (ranks, ``timeout_s``), see :func:`get_transport`). It reads the comm's group at
every call, so after :meth:`Comm.rebuild` it uses the replacement group. Ranks passed to a
transport are *group* ranks; :attr:`Pending.peer` and messages name global ranks.
This is the only module of the package that calls ``torch.distributed`` point-to-point
operations or ``all_reduce``; another transport is another class here, chosen in
:func:`transport_for`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NoReturn, Protocol

import torch
import torch.distributed as dist

from ..errors import ConfigError, PeerError
from . import nixl
from .comm import Comm, get_comm, restart_required, transport_errors
from .nixl import NixlEngine, RecvOp, landed, received

__all__ = [
    "GlooTransport",
    "NixlTransport",
    "Pending",
    "RangeView",
    "ReduceOp",
    "Transport",
    "get_transport",
    "messages",
    "transport_for",
]

log = logging.getLogger(__name__)

_NIXL_POLL_MAX_S = 0.001  # the longest sleep between two progress rounds of a NIXL wait

ReduceOp = Literal["min", "max", "sum"]
RangeView = Callable[[int, int], torch.Tensor]  # (offset, length) -> a uint8 view of that byte range


def messages(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) of the wire messages ``nbytes`` travel in: one, or ``chunk``-sized ones.

    Sender and receiver must cut a range the same way: both call this with the sender's ``chunk``.
    """
    if chunk <= 0 or chunk >= nbytes:
        return [(0, nbytes)]
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


@dataclass(frozen=True, kw_only=True, slots=True)
class Pending:
    """One posted send or receive, waited for with :meth:`Transport.wait`."""

    work: Any  # the transport's handle (a torch Work for gloo)
    what: str  # what the transfer is, for messages ("peer receive of ...")
    peer: int  # the other end, as a global rank
    posted: float  # time.monotonic() when it was posted


class Transport(Protocol):
    """Moves checkpoint bytes between the ranks of one control group (see the module docstring).

    Every method but the all-reduce is point-to-point: a send must meet the matching receive
    (same size, same order between one pair of ranks) on the peer.
    """

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    @property
    def timeout_s(self) -> float:
        """The group's bound on one wait (the deadline replication passes to :meth:`wait`)."""
        ...

    def post_recv(self, buf: torch.Tensor, src: int, what: str) -> Pending:
        """Post a receive of ``buf.numel()`` bytes from group rank ``src`` into ``buf`` (non-blocking)."""
        ...

    def post_send(self, buf: torch.Tensor, dst: int, what: str) -> Pending:
        """Post a send of ``buf`` to group rank ``dst`` (non-blocking; ``buf`` must stay untouched until waited)."""
        ...

    def recv_ranges(self, view: RangeView, nbytes: int, wire_chunk: int, src: int, what: str) -> list[Pending]:
        """Post the receives of ``nbytes`` from ``src`` into ``view``'s bytes, in the sender's ``wire_chunk`` messages."""
        ...

    def send_ranges(
        self,
        view: RangeView,
        nbytes: int,
        wire_chunk: int,
        dsts: Sequence[int],
        what: str,
        *,
        pace: Callable[[int], None] | None = None,
        deadline_s: float | None = None,
    ) -> list[Pending]:
        """Send ``view``'s first ``nbytes`` to every rank of ``dsts`` in ``wire_chunk`` messages.

        Unpaced: every message is posted, and the pending sends are returned. Paced: ``pace(n)``
        is called before each message, whose sends are then waited for (``deadline_s``) before
        the next message; nothing is returned. Every receive a paced send may wait on must be
        posted before it (else two ranks pacing towards each other deadlock).
        """
        ...

    def wait(self, pending: Pending, *, deadline_s: float | None = None, fatal: bool = False) -> None:
        """Wait for ``pending`` at most ``deadline_s`` (None: the group's own timeout).

        A failure raises PeerError (the caller recovers), or with ``fatal`` marks the control
        plane broken and raises RestartRequiredError.
        """
        ...

    def all_reduce_ints(self, values: Sequence[int], op: ReduceOp) -> list[int]:
        """Collective (all ranks of the group, same length and ``op``): ``values`` combined elementwise.

        A transport failure marks the control plane broken and raises RestartRequiredError.
        """
        ...


_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


class GlooTransport:
    """:class:`Transport` over ``torch.distributed`` point-to-point on a :class:`Comm`'s gloo group."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def timeout_s(self) -> float:
        return float(self.comm.timeout_s or 300.0)

    def _posted(self, post: Callable[[], Any], what: str, peer: int) -> Pending:
        t0 = time.monotonic()
        try:
            work = post()
        except transport_errors() as exc:
            raise PeerError(self.comm.failure(what, exc, time.monotonic() - t0, peer=peer)) from exc
        return Pending(work=work, what=what, peer=peer, posted=t0)

    def post_recv(self, buf: torch.Tensor, src: int, what: str) -> Pending:
        peer = self.comm.global_rank(src)
        return self._posted(lambda: dist.irecv(buf, src=peer, group=self.comm.group), what, peer)

    def post_send(self, buf: torch.Tensor, dst: int, what: str) -> Pending:
        peer = self.comm.global_rank(dst)
        return self._posted(lambda: dist.isend(buf, dst=peer, group=self.comm.group), what, peer)

    def recv_ranges(self, view: RangeView, nbytes: int, wire_chunk: int, src: int, what: str) -> list[Pending]:
        return [self.post_recv(view(off, n), src, what) for off, n in messages(nbytes, wire_chunk)]

    def send_ranges(
        self,
        view: RangeView,
        nbytes: int,
        wire_chunk: int,
        dsts: Sequence[int],
        what: str,
        *,
        pace: Callable[[int], None] | None = None,
        deadline_s: float | None = None,
    ) -> list[Pending]:
        out: list[Pending] = []
        for off, n in messages(nbytes, wire_chunk):
            chunk = view(off, n)
            if pace is None:
                out.extend(self.post_send(chunk, d, what) for d in dsts)
                continue
            pace(n)  # into the next idle span of training communication (gemini_dcp.snapshot.interleave)
            for p in [self.post_send(chunk, d, what) for d in dsts]:
                self.wait(p, deadline_s=deadline_s)
        return out

    def wait(self, pending: Pending, *, deadline_s: float | None = None, fatal: bool = False) -> None:
        try:
            if deadline_s is None:
                pending.work.wait()
            else:
                pending.work.wait(timedelta(seconds=deadline_s))
        except transport_errors() as exc:  # gloo timeout / peer gone
            reason = self.comm.failure(pending.what, exc, time.monotonic() - pending.posted, peer=pending.peer)
            if fatal:
                raise restart_required(reason) from exc
            raise PeerError(reason) from exc

    def all_reduce_ints(self, values: Sequence[int], op: ReduceOp) -> list[int]:
        if not self.comm.distributed:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        self.comm.run("all_reduce", dist.all_reduce, t, op=_OPS[op], group=self.comm.group)
        return [int(v) for v in t.tolist()]


class NixlTransport:
    """:class:`Transport` over NIXL one-sided WRITEs (:mod:`gemini_dcp.transport.nixl`), descriptors
    and the all-reduce on a :class:`Comm`'s gloo group. A receive is one descriptor per range; every
    wait runs the engine's progress and is bounded by its deadline."""

    def __init__(self, comm: Comm, eng: NixlEngine) -> None:
        self.comm = comm
        self.eng = eng
        self._gloo = GlooTransport(comm)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def timeout_s(self) -> float:
        return float(self.comm.timeout_s or 300.0)

    def _raise(self, pending: Pending, exc: BaseException, fatal: bool) -> NoReturn:
        reason = self.comm.failure(pending.what, exc, time.monotonic() - pending.posted, peer=pending.peer)
        if fatal:
            raise restart_required(reason) from exc
        raise PeerError(reason) from exc

    def _post(self, post: Callable[[int], Any], peer_rank: int, what: str) -> Pending:
        peer = self.comm.global_rank(peer_rank)
        t0 = time.monotonic()
        try:
            op = post(peer)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a gloo or NIXL failure to post
            raise PeerError(self.comm.failure(what, exc, time.monotonic() - t0, peer=peer)) from exc
        return Pending(work=op, what=what, peer=peer, posted=t0)

    def post_recv(self, buf: torch.Tensor, src: int, what: str) -> Pending:
        return self._post(lambda peer: self.eng.post_recv(buf, peer, self.comm.group), src, what)

    def post_send(self, buf: torch.Tensor, dst: int, what: str) -> Pending:
        return self._post(lambda peer: self.eng.post_send(buf, peer, self.comm.group), dst, what)

    def recv_ranges(self, view: RangeView, nbytes: int, wire_chunk: int, src: int, what: str) -> list[Pending]:
        return [self.post_recv(view(0, nbytes), src, what)]  # one descriptor per range, however it is paced

    def send_ranges(
        self,
        view: RangeView,
        nbytes: int,
        wire_chunk: int,
        dsts: Sequence[int],
        what: str,
        *,
        pace: Callable[[int], None] | None = None,
        deadline_s: float | None = None,
    ) -> list[Pending]:
        whole = view(0, nbytes)
        if pace is None:
            return [self.post_send(whole, d, what) for d in dsts]
        sends = [self._post(lambda peer: self.eng.post_send(whole, peer, self.comm.group, auto=False), d, what)
                 for d in dsts]
        eng = self.eng
        for off, n in messages(nbytes, wire_chunk):
            pace(n)  # into the next idle span of training communication (gemini_dcp.snapshot.interleave)
            for p in sends:
                self._until(p, lambda op: op.ready(eng) or op.state == "error", deadline_s, False)
                with eng.lock:
                    try:
                        p.work.write(eng, off, n, notify=off + n == nbytes)  # the last piece notifies
                    except Exception as exc:  # noqa: BLE001 - reported by the wait below
                        p.work.fail(exc)
            end = off + n
            for p in sends:
                self._until(p, lambda op: landed(eng, op, end), deadline_s, False)  # noqa: B023 - used at once
        for p in sends:
            self.wait(p, deadline_s=deadline_s)
        return []

    def _until(self, pending: Pending, done: Callable[[Any], bool], deadline_s: float | None, fatal: bool) -> None:
        """Run the engine's progress until ``done(pending.work)``; the package's error past the deadline
        or when the transfer failed."""
        op = pending.work
        limit = self.timeout_s if deadline_s is None else deadline_s
        t0 = time.monotonic()
        nap = 0.00002
        while True:
            try:
                self.eng.progress()
                with self.eng.lock:
                    finished = done(op)
            except Exception as exc:  # noqa: BLE001 - a gloo failure of a descriptor, a NIXL error
                self.eng.abandon(op)
                self._raise(pending, exc, fatal)
            err = getattr(op, "error", None)
            if err is not None:
                self.eng.abandon(op)
                self._raise(pending, err, fatal)
            if finished:
                return
            if time.monotonic() - t0 > limit:
                self.eng.abandon(op)
                self._raise(pending, TimeoutError(
                    f"NIXL transfer not completed within the deadline of {limit:g} s (the peer is gone, "
                    "stopped or unreachable over UCX)"), fatal)
            time.sleep(nap)
            nap = min(nap * 2, _NIXL_POLL_MAX_S)

    def wait(self, pending: Pending, *, deadline_s: float | None = None, fatal: bool = False) -> None:
        if isinstance(pending.work, RecvOp):
            self._until(pending, lambda r: received(self.eng, r), deadline_s, fatal)
        else:
            self._until(pending, lambda s: s.state == "done", deadline_s, fatal)

    def all_reduce_ints(self, values: Sequence[int], op: ReduceOp) -> list[int]:
        return self._gloo.all_reduce_ints(values, op)


# (global ranks, timeout_s, requested kind) -> the kind every rank of that group agreed on.
_CHOSEN: dict[tuple[tuple[int, ...], float, str], str] = {}


def transport_for(comm: Comm, peer_transport: str = "gloo") -> Transport:
    """The transport of peer-tier bytes over ``comm``'s control group.

    ``peer_transport``: ``"gloo"`` (:class:`GlooTransport`), ``"nixl"``
    (:class:`~gemini_dcp.transport.nixl.NixlTransport`, ConfigError on every rank when a rank
    cannot start NIXL) or ``"auto"`` (NIXL where every rank starts it, else gloo; logged once).
    With ``"nixl"`` or ``"auto"`` the first call per (group, kind) is **collective** (all ranks
    of the group, the same ``peer_transport``): the ranks agree on whether every one of them
    started NIXL (one all-reduce), so the two ends of a transfer always use the same transport.
    """
    if peer_transport == "gloo" or not comm.distributed:
        return GlooTransport(comm)
    key = (tuple(comm.ranks), float(comm.timeout_s or 0.0), peer_transport)
    chosen = _CHOSEN.get(key)
    if chosen is None:
        ok, why = nixl.probe()
        everyone = GlooTransport(comm).all_reduce_ints([int(ok)], "min")[0] == 1
        if not everyone and peer_transport == "nixl":
            raise ConfigError(
                f"peer_transport='nixl': {'this rank: ' + why if not ok else 'another rank could not start NIXL'}. "
                "Install NIXL on every node (docs/deploying.md: `pip install --no-deps nixl-cu12 numpy`), set "
                "UCX_TLS to transports UCX has there, or use peer_transport='gloo' (or 'auto')."
            )
        chosen = "nixl" if everyone else "gloo"
        _CHOSEN[key] = chosen
        if comm.rank == 0 or not ok:
            log.info("peer_transport=%r: peer-tier bytes go over %s (%s)", peer_transport, chosen,
                     why if ok else f"NIXL unavailable: {why}")
    if chosen == "gloo":
        return GlooTransport(comm)
    return NixlTransport(comm, nixl.engine())


def get_transport(timeout_s: float, process_group: dist.ProcessGroup | None = None) -> Transport:
    """The transport of the control group of (the ranks of ``process_group``, ``timeout_s``).

    Collective on first use of that pair, as :func:`~gemini_dcp.transport.comm.get_comm`.
    """
    return transport_for(get_comm(timeout_s, process_group))
