"""The peer CPU-memory tier: replicate each node's shards to peers, serve them back.

Transfers run over the checkpoint control group (gloo; never the training
group). Replication sends each rank's whole slot, in one message, straight
into a pre-faulted slot of the receiving node (no staging copy); the receiver
verifies every item's checksum before the copy may count as a replica, so a
corrupt replica can never be committed silently.

Restore-side routing is decided by the coordinator (``assign_sources``) from
the collective restore decision; chunks whose copy fails verification are
re-fetched from another holder in further collective rounds.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ..core.checksum import checksum
from ..core.chunk_sink import corrupt_error
from ..transport.comm import Comm, RESTART_HINT, _transport_errors, mark_broken
from ..errors import GeminiError, PeerError, RestartRequiredError, ShardUnavailableError
from ..core.faults import fault_point
from ..local.records import RankSlot, ShardRef, StepRecord, refs_by_location
from ..core.restore_order import RestoreDecision

if TYPE_CHECKING:
    from ..dcp.reader import GeminiStorageReader, ItemKey
    from ..dcp.writer import GeminiStorageWriter, _RankReport

log = logging.getLogger(__name__)

MAX_REPAIR_ROUNDS = 4
_STORE_AGREEMENTS = 0  # agreements over the store so far (the same count on every rank)


# ---- save side -------------------------------------------------------------------------------
def node_order(writer: "GeminiStorageWriter", comm: Comm, reports: list["_RankReport"]) -> list[str]:
    """Positions of nodes in the placement, stable for surviving nodes (decided on rank 0)."""
    current = list(dict.fromkeys(rep.node_id for rep in reports))
    order: list[str] | None = None
    if comm.rank == 0:
        from .placement import assign_positions  # noqa: PLC0415

        previous = getattr(writer, "_node_order", None)
        if previous is None:
            steps = writer.tier.steps()
            rec = writer.tier.record(steps[-1]) if steps else None
            previous = list(rec.nodes) if rec is not None else None
        order = assign_positions(previous, current)
    order = comm.broadcast_object(order, src=0)
    writer._node_order = order  # type: ignore[attr-defined]
    return order  # type: ignore[return-value]


def replication_routes(order: list[str], reports: list["_RankReport"], replicas: int, strategy: str) -> list[tuple[int, int]]:
    """(sender rank, receiver rank) pairs: each rank's slot goes to one rank of every peer node."""
    ranks_of: dict[str, list[int]] = {}
    for rep in reports:
        ranks_of.setdefault(rep.node_id, []).append(rep.rank)
    from .placement import place  # noqa: PLC0415

    m = min(replicas, len(order))
    placement = place(len(order), m, strategy)  # type: ignore[arg-type]
    pos = {n: i for i, n in enumerate(order)}
    routes: list[tuple[int, int]] = []
    for rep in reports:
        for peer in placement.peers_of(pos[rep.node_id]):
            targets = ranks_of[order[peer]]
            routes.append((rep.rank, targets[rep.rank % len(targets)]))
    return routes


def replicate(
    writer: "GeminiStorageWriter",
    comm: Comm,
    step: int,
    reports: list["_RankReport"],
    expand: Callable[["_RankReport"], "_RankReport | None"] | None = None,
) -> tuple[tuple[RankSlot, ...], dict[str, Any]]:
    """Collective: copy every rank's slot into its peers' memory; returns the replicas this rank stored.

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
    """
    t0 = time.perf_counter()
    order = node_order(writer, comm, reports)
    routes = replication_routes(order, reports, writer.options.replicas, writer.options.placement)
    me = comm.rank
    works: list[tuple[Any, str, int]] = []  # (work, what, peer global rank)
    received: list[tuple[int, int, Any]] = []
    sent = recv_bytes = 0
    error: str | None = None
    transport = False  # the error is a transport failure (the group must be replaced)
    what, who = "posting transfers", None
    t_xfer = time.monotonic()
    # Every transfer wait names its deadline (the group's own timeout bounds it too, as a backstop).
    deadline = timedelta(seconds=float(comm.timeout_s or 300.0))
    try:
        # Every receive is posted before any send waits, so paced (blocking) sends cannot deadlock.
        for src, dst in sorted(routes):
            nbytes = reports[src].nbytes
            if dst != me or nbytes == 0:
                continue
            idx = writer.tier.choose_slot(src, writer.options.keep)
            slot = writer._slot(src, idx)
            slot.ensure_capacity(nbytes, budget_check=writer._budget_check)
            peer = comm.global_rank(src)
            for off, n in _messages(nbytes, reports[src].wire_chunk):
                works.append((dist.irecv(slot.view(off, n), src=peer, group=comm.group), f"receive of rank {src}'s slot", peer))
            received.append((src, idx, slot))
            recv_bytes += nbytes
        targets = [comm.global_rank(dst) for src, dst in sorted(routes) if src == me]
        nbytes = reports[me].nbytes
        if targets and nbytes:
            slot = writer._slot(me, reports[me].slot)
            pace = writer.replication_pace if reports[me].wire_chunk else None
            for off, n in _messages(nbytes, reports[me].wire_chunk):
                chunk = slot.view(off, n)
                if pace is None:
                    works.extend((dist.isend(chunk, dst=t, group=comm.group), f"send of rank {me}'s slot", t) for t in targets)
                    continue
                pace(n)  # into the next idle span of training communication (gemini_dcp.snapshot.interleave)
                for w, t in [(dist.isend(chunk, dst=t, group=comm.group), t) for t in targets]:
                    what, who = f"paced send of rank {me}'s slot", t
                    w.wait(deadline)
            sent = nbytes * len(targets)
        fault_point("replicate.mid_send")  # sends posted, not all delivered
        for w, what, who in works:
            w.wait(deadline)
    except _transport_errors() as exc:  # gloo timeout / peer gone
        transport = True
        error = comm.failure(f"peer transfer ({what})", exc, time.monotonic() - t_xfer, peer=who)
    replica_slots: list[RankSlot] = []
    if error is None:
        for src, idx, slot in received:
            rep = expand(reports[src]) if expand is not None else reports[src]
            bad = _verify_items(slot, rep.results if rep is not None else ())
            if bad:
                error = f"replica of rank {src} received by rank {me} failed checksum for {bad}"
                break
            replica_slots.append(RankSlot(src, idx, reports[src].nbytes))
    outcomes, why = comm.try_all_gather_object((error, transport))
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
            mark_broken(reason)
            raise RestartRequiredError(f"{reason}. {RESTART_HINT}")
        outcomes = [(e, bool(t)) for e, t in agreed]
    errors = [e for e, _ in outcomes if e]
    if any(t for _, t in outcomes):
        comm.rebuild(errors[0])  # every rank saw the same outcomes: all replace the group together
    if errors:
        msg = (
            f"step {step}: could not place {writer.options.replicas} replicas in peer memory: {errors[0]}"
            f"{f' (+{len(errors) - 1} more)' if len(errors) > 1 else ''}. "
            "Check that every node is alive and reachable, or pass on_peer_failure='degrade' to commit with fewer copies."
        )
        if writer.options.on_peer_failure == "raise":
            raise PeerError(msg)
        log.warning("%s Committing with fewer replicas.", msg)
    dt = time.perf_counter() - t0
    stats = {"sent_bytes": sent, "received_bytes": recv_bytes, "seconds": dt, "degraded": bool(errors)}
    return tuple(replica_slots), stats


def _messages(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) of the messages a slot of ``nbytes`` travels in: one, or ``chunk``-sized ones."""
    if chunk <= 0 or chunk >= nbytes:
        return [(0, nbytes)]
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


def _verify_items(slot: Any, results: tuple[Any, ...]) -> list[str]:
    bad: list[str] = []
    for wr in results:
        ref: ShardRef = wr.storage_data
        if checksum(slot.view(ref.offset, ref.length), ref.algo) != ref.checksum:
            bad.append(wr.index.fqn)
    return bad


# ---- restore side ----------------------------------------------------------------------------
def refs_by_key(record: StepRecord) -> Mapping["ItemKey", ShardRef]:
    return refs_by_location(record.metadata.storage_data)


def assign_sources(
    needs: list[list["ItemKey"]],
    decision: RestoreDecision,
    record: StepRecord,
    exclude: set[tuple[int, "ItemKey", str]],
    local_ok: bool = True,
) -> list[dict[str, Any]]:
    """Routes per group rank: ``{"recv": {key: server}, "serve": [(requester, key)], "none": [key]}``.

    A chunk held by the requester's own node is read locally (no route) unless
    ``local_ok`` is False; otherwise it is assigned to the least-loaded rank of
    a holder node not in ``exclude``; chunks with no holder left go to ``"none"``.
    """
    node_of = {r: n for n, rs in decision.node_ranks.items() for r in rs}
    refs = refs_by_key(record)
    load: dict[int, int] = {}
    routes: list[dict[str, Any]] = [{"recv": {}, "serve": [], "none": []} for _ in needs]
    for requester, keys in enumerate(needs):
        my_node = node_of.get(requester)
        for key in keys:
            holders = decision.holders.get(key[0], ())
            if local_ok and my_node in holders and (requester, key, my_node) not in exclude:
                continue
            candidates = [
                r
                for n in holders
                if n != my_node or not local_ok
                if (requester, key, n) not in exclude
                for r in decision.node_ranks.get(n, ())
                if r != requester
            ]
            if not candidates:
                routes[requester]["none"].append(key)
                continue
            server = min(candidates, key=lambda r: (load.get(r, 0), r))
            load[server] = load.get(server, 0) + refs[key].length
            routes[requester]["recv"][key] = server
            routes[server]["serve"].append((requester, key))
    return routes


class Tally(NamedTuple):
    """What each rank contributes to a restore's agreement all-gathers.

    One shape for the repair rounds (:func:`fetch_remote`) and the reader's final
    gather, so a rank that failed before the rounds still meets the others in a
    single collective and every rank sees every rank's byte counts and outcome.
    """

    pending: list["ItemKey"]  # chunks this rank still needs
    exclude: list[tuple[int, "ItemKey", str]]  # (requester, chunk, node) sources that failed
    counts: dict[str, int]  # bytes restored per tier so far
    ok: bool  # False: this rank failed and raises its own error


_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python exposes it from 3.13 only
_HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) transparent huge page
_CHUNK_ALIGN = 4096  # each chunk starts on a page: aligned for every dtype, and madvise ranges need page starts


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes (which releases the GIL during the call), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


class ReceiveArena:
    """The receive buffers of one restore round: views into a single anonymous mapping.

    A chunk received from a peer is verified in a buffer of its own before any byte of it
    may reach the state dict (``GeminiStorageReader.read_data``). ``torch.empty`` per chunk
    gave fresh anonymous memory that page-faults 4 KiB at a time as gloo writes into it
    (1–2.4 GB/s on the 2-core VM this was measured on, slower than the loopback transfer
    itself). Here all the round's buffers share one mapping, 2 MiB-aligned and advised
    ``MADV_HUGEPAGE`` (faults 2 MiB at a time), and :meth:`start_populate` pre-faults it
    with ``MADV_POPULATE_WRITE`` on a worker thread (GIL released) while gloo already
    receives into it: a page the worker has not reached yet is faulted by gloo as before,
    one the worker did is written without a fault. On kernels without
    ``MADV_POPULATE_WRITE`` (< 5.14) or ``MADV_HUGEPAGE`` the mapping still works, with
    whatever faults the kernel takes.

    Lifetime: the views keep the mapping alive (``torch.frombuffer`` holds it); the reader
    keeps the arena until every staged chunk is applied and releases it with its slot
    mappings (``GeminiStorageReader._release_maps``), so nothing outlives the restore.
    Call :meth:`join` before dropping it on an error path.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        offsets: list[int] = []
        total = 0
        for n in lengths:
            offsets.append(total)
            total += -(-n // _CHUNK_ALIGN) * _CHUNK_ALIGN
        self.nbytes = total
        size = max(total, 1) + _HUGE_PAGE  # room to start the buffers on a huge-page boundary
        self._mm: mmap.mmap | None = mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        skip = (-whole.data_ptr()) % _HUGE_PAGE
        self._addr = whole.data_ptr() + skip
        try:
            self._mm.madvise(_MADV_HUGEPAGE)
        except (OSError, ValueError, AttributeError):  # no THP in this kernel: 4 KiB pages, still one mapping
            pass
        base = whole[skip : skip + total]
        self.views: list[torch.Tensor] = [base[o : o + n] for o, n in zip(offsets, lengths)]
        self._thread: threading.Thread | None = None
        self.populated: bool | None = None  # after join(): whether MADV_POPULATE_WRITE ran

    def start_populate(self) -> None:
        """Pre-fault the whole arena on a worker thread (in receive order: the buffers are laid out so)."""
        if self.nbytes == 0 or self._thread is not None:
            return
        try:
            self._thread = threading.Thread(target=self._populate, name="gemini-dcp-prefault", daemon=False)
            self._thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown": gloo faults the pages itself
            self._thread = None

    def _populate(self) -> None:
        if _madvise is not None:
            self.populated = _madvise(self._addr, self.nbytes, _MADV_POPULATE_WRITE) == 0
            return
        mm = self._mm
        if mm is None:
            return
        try:  # without ctypes: the same call, holding the GIL
            mm.madvise(_MADV_POPULATE_WRITE, self._addr - _address(mm), self.nbytes)
            self.populated = True
        except (OSError, ValueError, AttributeError):
            self.populated = False

    def join(self) -> None:
        """Wait for the pre-fault worker (quick: it only maps zeroed pages)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def release(self) -> None:
        """Drop this arena's own references; the mapping goes when the last view goes too."""
        self.join()
        self.views = []
        self._mm = None


def _address(mm: mmap.mmap) -> int:
    return torch.frombuffer(mm, dtype=torch.uint8).data_ptr()


@dataclass
class Inflight:
    """One round of posted peer transfers (see :func:`start_transfer`)."""

    sends: list[Any] = field(default_factory=list)
    # (key, landing buffer, work or None, (item, dest) when received in place)
    recvs: list[tuple["ItemKey", torch.Tensor, Any, tuple[ReadItem, torch.Tensor] | None]] = field(default_factory=list)
    arena: ReceiveArena | None = None


def start_transfer(
    reader: "GeminiStorageReader",
    comm: Comm,
    route: dict[str, Any],
    by_key: dict["ItemKey", list[ReadItem]],
    planner: LoadPlanner,
    refs: Mapping["ItemKey", ShardRef],
) -> Inflight:
    """Post one round of sends and receives (non-blocking); :func:`finish_transfer` completes it.

    Sends are posted first so that a serving rank feeds its requesters while it
    restores its own shards.
    """
    out = Inflight()
    for requester, key in sorted(route.get("serve", ())):
        ref = refs[key]
        if ref.length == 0:
            continue
        buf = reader._local_bytes(ref)
        if buf is None:  # keep the protocol in step; the receiver's checksum will reject it
            buf = torch.zeros(ref.length, dtype=torch.uint8)
        out.sends.append(dist.isend(buf, dst=comm.global_rank(requester), group=comm.group))
    recv = sorted(route.get("recv", {}).items())
    if recv:
        # Every chunk lands in a buffer of its own, never the destination tensor: the reader
        # verifies it there and copies it into the state dict only once every rank holds a
        # verified copy of every chunk (``GeminiStorageReader.read_data``), so a corrupt or
        # missing chunk leaves the caller's tensors as they were.
        out.arena = ReceiveArena([refs[key].length for key, _ in recv])
        reader._arenas.append(out.arena)  # released with the slot mappings, after the apply
        for (key, server), buf in zip(recv, out.arena.views):
            work = dist.irecv(buf, src=comm.global_rank(server), group=comm.group) if refs[key].length else None
            out.recvs.append((key, buf, work, None))
        out.arena.start_populate()  # pre-faults while gloo already receives into it
    return out


def finish_transfer(
    reader: "GeminiStorageReader",
    inflight: Inflight,
    by_key: dict["ItemKey", list[ReadItem]],
    planner: LoadPlanner,
    refs: Mapping["ItemKey", ShardRef],
) -> dict["ItemKey", bool]:
    """Wait for each received chunk in turn, verifying and applying it as it arrives; key -> ok."""
    ok: dict["ItemKey", bool] = {}
    for key, buf, work, direct in inflight.recvs:
        if work is not None:
            _wait(work, f"peer receive of the chunk at offset {key[1]} of rank {key[0]}'s slot")
        ok[key] = reader._stage(by_key[key], refs[key], buf)  # verified and staged, not yet applied
    for w in inflight.sends:
        _wait(w, "peer send of a chunk")
    if inflight.arena is not None:
        inflight.arena.join()
    return ok


def _wait(work: Any, what: str) -> None:
    """Wait for one restore transfer; a transport failure breaks the control plane (RestartRequiredError)."""
    t0 = time.monotonic()
    try:
        work.wait()
    except _transport_errors() as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        reason = f"{what} failed after {time.monotonic() - t0:.1f} s: {type(exc).__name__}: {first}"
        mark_broken(reason)
        raise RestartRequiredError(f"{reason}. {RESTART_HINT}") from exc


def fetch_remote(
    reader: "GeminiStorageReader",
    comm: Comm,
    planner: LoadPlanner,
    by_key: dict["ItemKey", list[ReadItem]],
    routes: dict[str, Any],
    failed: dict["ItemKey", str],
    counts: dict[str, int],
    refs: Mapping["ItemKey", ShardRef],
    first: Inflight,
) -> list[Tally] | None:
    """Collective: receive the chunks routed to peers, then repair failures round by round.

    ``first`` is the first round, already posted by the caller with
    :func:`start_transfer` so that it overlaps the local restore.
    Every rank runs the same number of rounds (driven by all-gathered failures).
    Chunks no memory copy can serve go to the persistent tier, else raise.

    Returns every rank's :class:`Tally` when no rank had anything to repair:
    the first agreement round carries the byte counts, so the caller needs no
    further gather (the common case costs one collective); None when repairs ran.
    """
    decision, record = reader._decision, reader._record
    assert decision is not None and record is not None
    route = routes or {"recv": {}, "serve": []}
    for key, ok in finish_transfer(reader, first, by_key, planner, refs).items():
        if ok:
            counts["peer"] += refs[key].length
        else:
            failed[key] = f"checksum from rank {route['recv'][key]}"
    node_of = {r: n for n, rs in decision.node_ranks.items() for r in rs}
    exclude: set[tuple[int, "ItemKey", str]] = set()
    for key, srv in route["recv"].items():
        if key in failed:
            exclude.add((comm.rank, key, node_of[srv]))
    for key in failed:
        exclude.add((comm.rank, key, reader.node_id))
    given_up: set["ItemKey"] = set()
    for rnd in range(MAX_REPAIR_ROUNDS):
        # Never raise inside this loop: every rank must run the same rounds.
        pending = sorted(k for k in failed if k not in given_up)
        tallies: list[Tally] = comm.all_gather_object(Tally(pending, sorted(exclude), dict(counts), reader._rank_ok))
        if not any(t.pending for t in tallies):
            if rnd == 0:
                return tallies  # nothing to repair anywhere: these counts are final
            break
        needs = [t.pending for t in tallies]
        excl = {e for t in tallies for e in t.exclude}
        mine = assign_sources(needs, decision, record, excl, local_ok=False)[comm.rank]
        inflight = start_transfer(reader, comm, mine, by_key, planner, refs)
        for key, ok in finish_transfer(reader, inflight, by_key, planner, refs).items():
            if ok:
                counts["peer"] += refs[key].length
                failed.pop(key, None)
            else:
                exclude.add((comm.rank, key, node_of[mine["recv"][key]]))
        if mine["none"]:
            _from_persistent(reader, planner, by_key, set(mine["none"]), failed, counts)
            given_up.update(k for k in mine["none"] if k in failed)
    if failed:
        _raise_unservable(reader, by_key, refs, failed)
    return None


def _from_persistent(
    reader: "GeminiStorageReader",
    planner: LoadPlanner,
    by_key: dict["ItemKey", list[ReadItem]],
    keys: set["ItemKey"],
    failed: dict["ItemKey", str],
    counts: dict[str, int],
) -> None:
    if reader.persistent is None or reader._decision is None:
        return
    for k in keys:
        try:
            counts["persistent"] += reader._stage_from_persistent(LoadPlan(by_key[k]), planner)
        except GeminiError as exc:
            log.warning("persistent copy of %s unusable: %s", by_key[k][0].storage_index.fqn, exc)
            continue
        failed.pop(k, None)


def _raise_unservable(
    reader: "GeminiStorageReader",
    by_key: dict["ItemKey", list[ReadItem]],
    refs: Mapping["ItemKey", ShardRef],
    failed: dict["ItemKey", str],
) -> None:

    step = reader._decision.step if reader._decision else -1
    corrupt = [k for k, why in failed.items() if why != "missing"]
    if corrupt:
        k = corrupt[0]
        raise corrupt_error(by_key[k][0], refs[k], step, f"{failed[k]}; {len(failed)} chunk(s) affected")
    names = sorted({f"{by_key[k][0].storage_index.fqn}@rank{k[0]}" for k in failed})
    raise ShardUnavailableError(
        f"step {step}: no surviving copy of {len(failed)} chunk(s): {names[:20]}"
        f"{' ...' if len(names) > 20 else ''}. Load an older step, or configure persistent=<url>."
    )
