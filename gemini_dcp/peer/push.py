"""The save side of the peer tier: copy each rank's slot into peer memory, verify what arrived.

Replication sends each rank's whole slot (in one message, or in the paced
``wire_chunk`` messages) straight into a pre-faulted slot of the receiving node
(no staging copy), through the :class:`~gemini_dcp.transport.p2p.Transport`.
The receiver verifies every item's checksum before the copy may count as a
replica, so a corrupt replica can never be committed silently. Every rank then
takes the same branch on the outcome (see :func:`replicate`).

The writer passes narrow values (its slot lookup, budget check, options, tier
and reports); it gets back the replicas, the stats and the node order it keeps
for the next save. Nothing here knows the writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ..core.chunk_sink import verify_chunk
from ..core.faults import fault_point
from ..errors import PeerError
from ..local.record_types import RankSlot, ShardRef, StepRecord
from ..options.tree import GeminiOptions
from ..transport.comm import Comm, restart_required
from ..transport.p2p import Pending, Transport
from .delta import ReplicaMemory, merge_runs, packed_rows, pair_runs, row_view, touches
from .placement import place
from .routes import SlotReport, choose_order, replication_routes, warn_shared_domains

__all__ = ["ReplicaTier", "Replicated", "SlotBuffer", "agree_on_errors", "node_order", "replicate"]

log = logging.getLogger(__name__)

_STORE_AGREEMENTS = 0  # agreements over the store so far (the same count on every rank)


class SlotBuffer(Protocol):
    """A slot of the local tier, as replication writes and reads it (``gemini_dcp.local.slots.SlotFile``)."""

    def ensure_capacity(self, nbytes: int, *, budget_check: Callable[[int], None] | None = None) -> None: ...

    def view(self, offset: int, length: int) -> torch.Tensor: ...


class ReplicaTier(Protocol):
    """What replication asks of this node's tier (``gemini_dcp.local.tier.LocalTier``)."""

    def choose_slot(self, rank: int, keep: int) -> int: ...

    def steps(self) -> list[int]: ...

    def record(self, step: int) -> StepRecord | None: ...


class Replicated(NamedTuple):
    """The outcome of :func:`replicate` on this rank."""

    replica_slots: tuple[RankSlot, ...]  # the replicas of other ranks' slots this rank stored
    stats: dict[str, Any]  # sent_bytes, received_bytes, seconds, degraded
    node_order: list[str]  # the placement's node positions: pass it back as ``previous_order`` next save


def node_order(comm: Comm, reports: Sequence[SlotReport], previous: list[str] | None, tier: ReplicaTier,
               window: int = 2, sets_for: Callable[[int], Sequence[Sequence[int]]] | None = None,
               lost_at: int | None = None) -> list[str]:
    """Collective: positions of nodes in the placement, stable for surviving nodes (decided on rank 0),
    spread over the nodes' failure domains by windows of ``window`` (replicas, or the parity group size).

    ``previous`` is the order of this writer's last save; without one, rank 0 takes the nodes of
    the newest step on its node (a restarted job keeps its positions).
    """
    order: list[str] = []  # decided on rank 0 only
    if comm.rank == 0:
        if previous is None:
            steps = tier.steps()
            rec = tier.record(steps[-1]) if steps else None
            previous = list(rec.nodes) if rec is not None else None
        order = choose_order(previous, reports, window, sets_for, lost_at)
    return comm.broadcast_object(order, src=0)


def replicate(
    comm: Comm,
    transport: Transport,
    step: int,
    reports: Sequence[SlotReport],
    *,
    options: GeminiOptions,
    tier: ReplicaTier,
    slot: Callable[[int, int], SlotBuffer],
    budget_check: Callable[[int], None],
    previous_order: list[str] | None = None,
    pace: Callable[[int], None] | None = None,
    expand: Callable[[Any], Any | None] | None = None,
    memory: ReplicaMemory | None = None,
) -> Replicated:
    """Collective: copy every rank's slot into its peers' memory; returns the replicas this rank stored.

    ``slot(rank, idx)`` is the writer's slot ``idx`` of ``rank`` on this node and ``budget_check(delta)``
    raises TierFullError when growing this node's tier by ``delta`` bytes breaks its budget; ``pace``
    (the writer's replication pacer) is called before each message when this rank's report has a
    ``wire_chunk``.

    A transfer error (a peer that timed out or failed, or a replica that fails
    its checksum) is agreed on by every rank in one gather, then raises PeerError
    on every rank, or (``on_peer_failure="degrade"``) is logged and the step
    commits with fewer replicas: every rank takes the same branch, so a step is
    committed on all nodes or on none. A gloo timeout closes every connection of
    the group, so when that gather fails the ranks agree over the default group's
    store instead (``Comm.agree_via_store``: rank 0 decides, atomically). After a
    transport failure all ranks replace the control group together
    (``Comm.rebuild``), so the failed transfer never meets a later save. A peer
    that does not report within ``timeout_s`` (stalled or gone) makes every rank
    raise RestartRequiredError: nothing is committed and the job must restart.
    ``expand`` rebuilds the write results of a compact report (a replayed save):
    only the reports of the slots this rank receives are expanded, to verify them.
    ``memory`` (incremental saves): what this node's replica slots hold; a pair whose
    receiver holds a base the sender's offer has runs against moves only those runs
    (:mod:`gemini_dcp.peer.delta`); every item is verified all the same.
    """
    t0 = time.perf_counter()
    strategy = options.peer.placement

    def holders(n: int) -> Sequence[Sequence[int]]:
        return place(n, min(options.peer.replicas, n), strategy).holders  # type: ignore[arg-type]

    order = node_order(comm, reports, previous_order, tier, options.peer.replicas, holders)
    routes = replication_routes(order, reports, options.peer.replicas, options.peer.placement)
    if comm.rank == 0:
        m = min(options.peer.replicas, len(order))
        pl = place(len(order), m, options.peer.placement)  # type: ignore[arg-type]
        warn_shared_domains(order, reports, [[order[h] for h in hs] for hs in pl.holders], "replicas")
    me = comm.rank
    works: list[Pending] = []
    received: list[tuple[int, int, SlotBuffer, Any]] = []  # (src, slot index, slot, delta runs or None)
    scatter: list[tuple[SlotBuffer, int, int, int, torch.Tensor, torch.Tensor]] = []  # received packed rows
    recv_at = send_at = 0  # bytes of this save's packed rows in the receive / send staging buffers
    delta_sent = delta_pairs = 0
    sent = recv_bytes = 0
    error: str | None = None
    transport_failed = False  # the error is a transport failure (the group must be replaced)
    # Every transfer wait names its deadline (the group's own timeout bounds it too, as a backstop).
    deadline = transport.timeout_s
    try:
        # Every receive is posted before any send waits, so paced (blocking) sends cannot deadlock.
        for src, dst in sorted(routes):
            nbytes = reports[src].nbytes
            if dst != me or nbytes == 0:
                continue
            plan = _pair(reports, src, me) if memory is not None else None
            idx = plan[0] if plan is not None else tier.choose_slot(src, options.local.keep)
            into = slot(src, idx)
            into.ensure_capacity(nbytes, budget_check=budget_check)
            what = f"peer transfer (receive of rank {src}'s slot{' delta' if plan is not None else ''})"
            if memory is not None:
                memory.drop(src, idx)  # a failed receive leaves no base
            if plan is None:
                works += transport.recv_ranges(into.view, nbytes, reports[src].wire_chunk, src, what)
                recv_bytes += nbytes
            else:
                for off, n in plan[1]:
                    works += transport.recv_ranges(_at(into, off), n, reports[src].wire_chunk, src, what)
                    recv_bytes += n
                for off, length, row_bytes, rows in plan[2]:  # table row deltas: packed, scattered on arrival
                    assert memory is not None  # a delta plan needs the receiver's memory
                    staging = memory.staging.take("recv", recv_at, rows.numel() * row_bytes, _recv_total(reports, me, routes))
                    recv_at += _round8(staging.numel())
                    works += transport.recv_ranges(_in(staging), staging.numel(), reports[src].wire_chunk, src,
                                                   f"{what} rows")
                    recv_bytes += staging.numel()
                    scatter.append((into, off, length, row_bytes, rows, staging))
            touched = None if plan is None else merge_runs(sorted([*plan[1], *((o, n) for o, n, _, _ in plan[2])]), 0)
            received.append((src, idx, into, touched))
        targets = [dst for src, dst in sorted(routes) if src == me]
        nbytes = reports[me].nbytes
        if targets and nbytes:
            chunk = reports[me].wire_chunk
            paced = pace if chunk else None
            what = f"peer transfer ({'paced ' if paced else ''}send of rank {me}'s slot)"
            mine = slot(me, reports[me].slot)
            plans = {dst: _pair(reports, me, dst) if memory is not None else None for dst in targets}
            whole = [dst for dst in targets if plans[dst] is None]
            if whole:
                works += transport.send_ranges(mine.view, nbytes, chunk, whole, what, pace=paced, deadline_s=deadline)
                sent = nbytes * len(whole)
            for dst in targets:
                plan = plans[dst]
                if plan is None:
                    continue
                delta_pairs += 1
                for off, n in plan[1]:
                    works += transport.send_ranges(_at(mine, off), n, chunk, [dst], f"{what} delta", pace=paced,
                                                   deadline_s=deadline)
                    sent += n
                    delta_sent += n
                for off, length, row_bytes, rows in plan[2]:  # the table's written rows, packed
                    src_rows = row_view(mine.view(off, length), row_bytes)
                    assert memory is not None
                    packed = memory.staging.take("send", send_at, rows.numel() * row_bytes, _send_total(plans))
                    send_at += _round8(packed.numel())
                    torch.index_select(src_rows, 0, rows, out=packed.view(src_rows.dtype).view(-1, src_rows.shape[1]))
                    works += transport.send_ranges(_in(packed), packed.numel(), chunk, [dst], f"{what} rows",
                                                   pace=paced, deadline_s=deadline)
                    sent += packed.numel()
                    delta_sent += packed.numel()
        fault_point("replicate.mid_send")  # sends posted, not all delivered
        for w in works:
            transport.wait(w, deadline_s=deadline)
        for into, off, length, row_bytes, rows, staging in scatter:
            dst_rows = row_view(into.view(off, length), row_bytes)
            dst_rows.index_copy_(0, rows, staging.view(dst_rows.dtype).view(-1, dst_rows.shape[1]))
    except PeerError as exc:  # gloo timeout / peer gone
        transport_failed = True
        error = str(exc)
    replica_slots: list[RankSlot] = []
    if error is None:
        for src, idx, into, runs in received:
            rep = expand(reports[src]) if expand is not None else reports[src]
            bad = _verify_items(into, _touched(rep.results, runs) if rep is not None else ())
            if bad:
                error = f"replica of rank {src} received by rank {me} failed checksum for {bad}"
                break
            replica_slots.append(RankSlot(src, idx, reports[src].nbytes))
            if memory is not None:
                memory.note(src, idx, getattr(reports[src], "delta_offer", None))
    errors = agree_on_errors(comm, step, error, transport_failed)
    if errors:
        msg = (
            f"step {step}: could not place {options.peer.replicas} replicas in peer memory: {errors[0]}"
            f"{f' (+{len(errors) - 1} more)' if len(errors) > 1 else ''}. "
            "Check that every node is alive and reachable, or pass on_peer_failure='degrade' to commit with fewer copies."
        )
        if options.peer.on_peer_failure == "raise":
            raise PeerError(msg)
        log.warning("%s Committing with fewer replicas.", msg)
    dt = time.perf_counter() - t0
    stats = {"sent_bytes": sent, "received_bytes": recv_bytes, "seconds": dt, "degraded": bool(errors),
             "delta_pairs": delta_pairs, "delta_sent_bytes": delta_sent}
    return Replicated(tuple(replica_slots), stats, order)


def _pair(reports: Sequence[Any], src: int, dst: int) -> tuple[int, Any, list[tuple[int, int, int, torch.Tensor]]] | None:
    """The delta plan of the pair ``src -> dst`` (``peer.delta.pair_runs``), the same at both ends:
    ``(slot index, runs, [(offset, length, row bytes, row indices), ...])``. An offer whose packed rows
    do not fit the slot sends the whole slot (both ends decide so from the same gathered reports)."""
    got = pair_runs(getattr(reports[src], "delta_offer", None), getattr(reports[dst], "replica_bases", ()), src)
    if got is None:
        return None
    idx, runs, packed = got
    try:
        return idx, runs, [packed_rows(spec, reports[src].nbytes) for spec in packed]
    except (ValueError, TypeError) as exc:
        log.warning("rank %d's delta offer is unusable (%s): its whole slot is sent", src, exc)
        return None


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _recv_total(reports: Sequence[Any], me: int, routes: Any) -> int:
    """Bytes of every packed row delta this rank receives in this save (8-byte aligned each)."""
    total = 0
    for src, dst in routes:
        if dst == me and reports[src].nbytes:
            plan = _pair(reports, src, me)
            total += sum(_round8(rows.numel() * rb) for _, _, rb, rows in plan[2]) if plan is not None else 0
    return total


def _send_total(plans: dict[int, Any]) -> int:
    """Bytes of every packed row delta this rank sends in this save (8-byte aligned each)."""
    return sum(_round8(rows.numel() * rb) for p in plans.values() if p is not None for _, _, rb, rows in p[2])




def _in(buf: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """A range view over a flat uint8 staging tensor (packed table rows)."""
    return lambda off, n: buf[off : off + n]


def _at(buf: SlotBuffer, base: int) -> Callable[[int, int], torch.Tensor]:
    """``buf.view`` shifted by ``base`` bytes (one run of a delta)."""
    return lambda off, n: buf.view(base + off, n)


def agree_on_errors(comm: Comm, step: int, error: str | None, transport_failed: bool) -> list[str]:
    """Collective: every rank's replication error (empty: none anywhere), the same on every rank.

    After a transport failure anywhere, every rank replaces the control group (``Comm.rebuild``).
    """
    outcomes, why = comm.try_all_gather_object((error, transport_failed))
    if outcomes is None:
        # A gloo timeout closes every connection of the group: agree over the store instead.
        global _STORE_AGREEMENTS
        _STORE_AGREEMENTS += 1
        agreed = comm.agree_via_store(f"replicate-{step}-{_STORE_AGREEMENTS}", [error or why, True])
        if agreed is None:
            reason = (
                f"step {step}: peer replication failed ({error or why}) and the ranks could not agree on it "
                f"({comm.agreement_failure or f'not every rank reported within timeout_s={comm.timeout_s:g}'}); "
                f"a peer is stalled or gone; the step is not committed on any node"
            )
            raise restart_required(reason)
        outcomes = [(e, bool(t)) for e, t in agreed]
    errors = [e for e, _ in outcomes if e]
    if any(t for _, t in outcomes):
        comm.rebuild(errors[0])  # every rank saw the same outcomes: all replace the group together
    return errors


def _touched(results: tuple[Any, ...], runs: Any) -> tuple[Any, ...]:
    """The results a received delta's ``runs`` touch (all of them for a whole slot: ``runs`` None); the
    others are the base's bytes, verified when they arrived and not written since (``peer.delta``)."""
    if runs is None:
        return results
    return tuple(wr for wr in results if touches(runs, wr.storage_data.offset, wr.storage_data.length))


def _verify_items(slot: SlotBuffer, results: tuple[Any, ...]) -> list[str]:
    """FQNs of the items in a received replica whose bytes do not match their recorded checksum."""
    bad: list[str] = []
    for wr in results:
        ref: ShardRef = wr.storage_data
        if not verify_chunk(slot.view(ref.offset, ref.length), ref):
            bad.append(wr.index.fqn)
    return bad
