"""XOR parity in peer memory: encode at save, rebuild a lost node's slots at restore.

With ``parity_group=g`` a node keeps its own checkpoint plus about ``1/(g-1)`` of one in
parity, instead of a full copy per extra replica; any one node of each group can be lost
and rebuilt bit-exact. The arithmetic (groups, lanes, stripes, which message goes where) is
pure, in :mod:`gemini_dcp.peer.parity_groups`; this module moves the bytes through the
:class:`~gemini_dcp.transport.p2p.Transport` and XORs them with ``torch.bitwise_xor_`` on
uint8 views (never a Python loop over bytes).

Why pairwise sends, not a ``reduce``/``reduce_scatter`` with ``BXOR``: a reduce over one
parity group needs a process group per group (created collectively by every rank of the
world, again whenever a node is replaced), while the tier's control group already carries
point-to-point transfers; and with pairwise sends every member sends exactly its ``S``
bytes once and receives ``S`` bytes (``n - 1`` stripes), which is what ``replicas=2`` puts on
the wire, with the XOR done as the stripes arrive. The first stripe lands straight in the
pre-faulted parity slot; only the others pass through a receive buffer.

Save (:func:`encode_parity`, collective, step 4 of the commit protocol in place of
replication): every rank posts its receives, sends its stripes (paced like replication
when the async path paces it), XORs, checksums its parity, then every rank agrees on the
outcome (one gather; a transport failure replaces the control group as replication does)
and gathers the parity lengths and checksums into one :class:`ParityLayout` that the step
record carries. The step is committed only after that: data and parity written everywhere.

Restore (:func:`rebuild_lost`, collective, right after the restore decision): the rank
the decision chose rebuilds each lost saving rank's slot from the survivors' stripes and
parity, straight into a slot file of its node. Each parity is verified against its recorded
checksum by the rank that serves it (a flipped byte is named, and nothing decoded from it is
used), and the rebuilt slot is verified against the original shards' checksums before the
restore may read it. The outcome is agreed by every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.checksum import checksum
from ..core.chunk_sink import verify_chunk
from ..errors import GeminiError, PeerError
from ..local.parity_record import ParityLayout, parity_path, rebuilt_path
from ..local.record_types import StepRecord, refs_by_location
from ..local.slots import ReadOnlySlot, SlotFile
from ..transport.comm import Comm
from ..transport.p2p import Pending, Transport
from .parity_groups import Transfer, encode_transfers, parity_groups, parity_lanes, parity_length, rebuild_transfers
from .push import ReplicaTier, agree_on_errors, node_order
from .routes import SlotReport, warn_shared_domains

__all__ = ["Encoded", "ParitySlots", "Rebuilt", "encode_parity", "rebuild_lost", "rebuild_servers"]

log = logging.getLogger(__name__)

_UNPROTECTED_WARNED: set[tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]] = set()


def _warn_unprotected(lanes: Sequence[Sequence[int]], rank_nodes: Sequence[str], me: int) -> None:
    """Log once per layout (on rank 0) which ranks no lane protects (a node holds more ranks than its group's others)."""
    covered = {r for lane in lanes for r in lane}
    lost = [r for r in range(len(rank_nodes)) if r not in covered]
    key = (tuple(rank_nodes), tuple(tuple(lane) for lane in lanes))
    if me != 0 or not lost or key in _UNPROTECTED_WARNED:
        return
    _UNPROTECTED_WARNED.add(key)
    log.warning(
        "parity: ranks %s (on nodes %s) have no parity: their node holds more ranks than the other nodes of its "
        "parity group together, so no lane can pair them with another node. Losing that node loses their shards "
        "from memory (the persistent tier still holds drained steps); spread ranks evenly over nodes or use "
        "replicas=2 for them.", lost, sorted({rank_nodes[r] for r in lost}))


class ParitySlots:
    """This process's open parity slot files (pre-faulted, reused save after save like data slots)."""

    def __init__(self, rank_dir: Callable[[int], Path]) -> None:
        self._rank_dir = rank_dir
        self._open: dict[Path, SlotFile] = {}

    def slot(self, rank: int, idx: int) -> SlotFile:
        path = parity_path(self._rank_dir(rank), idx)
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = SlotFile(path)
        return f


@dataclass(frozen=True, kw_only=True, slots=True)
class Encoded:
    """The outcome of :func:`encode_parity` on this rank (the same ``layout`` on every rank)."""

    layout: ParityLayout | None  # None: degraded (no parity this step)
    stats: dict[str, Any]
    node_order: list[str]


def encode_parity(
    comm: Comm,
    transport: Transport,
    step: int,
    reports: Sequence[SlotReport],
    *,
    group: int,
    tier: ReplicaTier,
    data_slot: Callable[[int, int], Any],
    parity_slots: ParitySlots,
    budget_check: Callable[[int], None],
    algo: str,
    on_peer_failure: str = "raise",
    previous_order: list[str] | None = None,
    pace: Callable[[int], None] | None = None,
) -> Encoded:
    """Collective (all ranks call it, after the commit gather): XOR parity of every lane.

    ``data_slot(rank, idx)`` is this node's data slot (``.view(offset, length)``); the parity
    of this rank lands in ``parity_slots.slot(rank, idx)`` with ``idx`` its data slot's index.
    A transfer failure is agreed by every rank, then raises PeerError everywhere (or, with
    ``on_peer_failure="degrade"``, the step commits without parity and a warning).
    """
    t0 = time.perf_counter()
    def groups_of(n: int) -> list[tuple[int, ...]]:
        return parity_groups(list(range(n)), group)  # type: ignore[arg-type, return-value]

    order = node_order(comm, reports, previous_order, tier, group, groups_of, 2)
    if comm.rank == 0:
        warn_shared_domains(order, reports, parity_groups(order, group), "parity_group")
    me = comm.rank
    rank_nodes = [rep.node_id for rep in reports]
    lanes = parity_lanes(order, rank_nodes, group)
    _warn_unprotected(lanes, rank_nodes, me)
    stripes: list[int] = []
    mine: tuple[int, ...] | None = None
    my_transfers: list[Transfer] = []
    my_stripe = 0
    for lane in lanes:
        stripe, transfers = encode_transfers(lane, [reports[r].nbytes for r in lane])
        stripes.append(stripe)
        if me in lane:
            mine, my_transfers, my_stripe = lane, transfers, stripe
    plen = 0
    digest = 0
    sent = received = 0
    error: str | None = None
    transport_failed = False
    deadline = transport.timeout_s
    try:
        if mine is not None:
            nbytes = [reports[r].nbytes for r in mine]
            plen = parity_length(mine.index(me), nbytes, my_stripe)
            my_slot = reports[me].slot
            pslot = parity_slots.slot(me, my_slot)
            pslot.ensure_capacity(plen, budget_check=budget_check)
            works: list[Pending] = []
            incoming = sorted((t for t in my_transfers if t.dst == me), key=lambda t: -t.length)
            temps: list[tuple[int, torch.Tensor]] = []
            for i, t in enumerate(incoming):  # every receive posted before any (paced, blocking) send
                what = f"parity stripe of rank {t.src} (step {step})"
                if i == 0:  # the longest lands in the parity slot itself; the rest is XORed into it
                    works += transport.recv_ranges(pslot.view, t.length, reports[t.src].wire_chunk, t.src, what)
                else:
                    buf = torch.empty(t.length, dtype=torch.uint8)
                    works += transport.recv_ranges(_range_of(buf), t.length, reports[t.src].wire_chunk, t.src, what)
                    temps.append((t.length, buf))
                received += t.length
            if incoming and incoming[0].length < plen:
                pslot.view(incoming[0].length, plen - incoming[0].length).zero_()
            data = data_slot(me, my_slot)
            chunk = reports[me].wire_chunk
            paced = pace if chunk else None
            for t in (t for t in my_transfers if t.src == me):
                works += transport.send_ranges(
                    _range_of(data.view(t.offset, t.length)), t.length, chunk, [t.dst],
                    f"parity stripe of rank {me} to rank {t.dst} (step {step})", pace=paced, deadline_s=deadline,
                )
                sent += t.length
            for w in works:
                transport.wait(w, deadline_s=deadline)
            out = pslot.view(0, plen)
            for n, buf in temps:
                out[:n].bitwise_xor_(buf)
            digest = checksum(out, algo)
    except PeerError as exc:
        transport_failed = True
        error = str(exc)
    except (OSError, GeminiError) as exc:  # a full tier (TierFullError) or an unwritable parity file
        error = f"rank {me}: {exc}"
    errors = agree_on_errors(comm, step, error, transport_failed)
    dt = time.perf_counter() - t0
    stats = {"sent_bytes": sent, "received_bytes": received, "parity_bytes": plen, "seconds": dt,
             "degraded": bool(errors), "scheme": f"parity g={group}"}
    if errors:
        msg = (
            f"step {step}: could not compute the XOR parity (parity_group={group}): {errors[0]}"
            f"{f' (+{len(errors) - 1} more)' if len(errors) > 1 else ''}. Check that every node is alive and "
            "reachable and has room for its parity slot, or pass on_peer_failure='degrade' to commit without parity."
        )
        if on_peer_failure == "raise":
            raise PeerError(msg)
        log.warning("%s Committing without parity.", msg)
        return Encoded(layout=None, stats=stats, node_order=order)
    gathered = comm.all_gather_object((plen, digest))
    layout = ParityLayout(
        group=group, groups=tuple(parity_groups([n for n in order if n in set(rank_nodes)], group)),
        lanes=tuple(lanes), stripes=tuple(stripes),
        parity_nbytes=tuple(int(p) for p, _ in gathered), checksums=tuple(int(c) for _, c in gathered), algo=algo,
    )
    return Encoded(layout=layout, stats=stats, node_order=order)


def _range_of(buf: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """``buf`` as a :data:`~gemini_dcp.transport.p2p.RangeView`."""

    def view(offset: int, length: int) -> torch.Tensor:
        return buf[offset:offset + length]

    return view


# ---- restore ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Rebuilt:
    """The agreed outcome of :func:`rebuild_lost` (the same on every rank)."""

    ok: dict[int, bool]  # lost saving rank -> rebuilt and verified
    errors: dict[int, str]  # lost saving rank -> why not
    nbytes: int  # bytes rebuilt (all ranks)

    @property
    def unreadable(self) -> list[int]:
        """Lost ranks whose rebuild failed only because a survivor's file was missing or unreadable
        (not a checksum failure): their shards are unavailable, not corrupt."""
        return sorted(r for r, why in self.errors.items() if why.startswith(UNREADABLE))


#: How an error of :class:`Rebuilt` starts when a survivor's data or parity file could not be read.
UNREADABLE = "cannot read "


def rebuild_servers(record: StepRecord, holders: Mapping[int, Sequence[str]], node_ranks: Mapping[str, Sequence[int]]) -> dict[int, int]:
    """Saving rank -> the current rank that serves its slot and parity (the lowest rank of its own
    node, which holds both), for every saving rank whose node is still there with the step."""
    out: dict[int, int] = {}
    for r, node in enumerate(record.rank_nodes):
        if node in holders.get(r, ()) and node_ranks.get(node):
            out[r] = min(node_ranks[node])
    return out


def rebuild_lost(
    comm: Comm,
    transport: Transport,
    record: StepRecord,
    rebuild: Mapping[int, int],
    servers: Mapping[int, int],
    *,
    slot_index: Callable[[int], int | None],
    slot_path: Callable[[int, int], Path],
    rank_dir: Callable[[int], Path],
) -> Rebuilt:
    """Collective (all ranks call it with the same arguments but the node-local callables).

    ``rebuild``: lost saving rank -> the current rank that rebuilds it into
    ``rebuilt_path(rank_dir(lost), step)`` on its node; ``servers``: as :func:`rebuild_servers`;
    ``slot_index(r)``: the data slot of saving rank ``r`` on this node (this node's record),
    ``slot_path(r, idx)`` its file. A rank that cannot read what it serves sends zeros (the
    pairing of messages holds) and reports why; the rebuild of that rank fails on every rank.
    """
    layout = record.parity
    assert layout is not None
    me = comm.rank
    step = record.step
    plan: list[Transfer] = []
    for lost in sorted(rebuild):
        li = layout.lane_index(lost)
        assert li is not None
        lane = layout.lanes[li]
        plan += rebuild_transfers(
            lane, [record.rank_nbytes[r] for r in lane], [layout.parity_nbytes[r] for r in lane], layout.stripes[li],
            lost, servers, rebuild[lost],
        )
    maps: dict[Path, ReadOnlySlot] = {}
    outs: dict[int, SlotFile] = {}
    errors: dict[int, str] = {}
    checked: dict[int, str | None] = {}

    def mapped(path: Path) -> ReadOnlySlot:
        if path not in maps:
            maps[path] = ReadOnlySlot(path)
        return maps[path]

    def source(t: Transfer) -> torch.Tensor:
        idx = slot_index(t.member)
        if idx is None:
            raise FileNotFoundError(f"this node holds no slot of rank {t.member} for step {step}")
        path = slot_path(t.member, idx) if t.kind == "data" else parity_path(rank_dir(t.member), idx)
        try:
            return _source_view(t, path)
        except OSError as exc:
            raise OSError(
                f"{UNREADABLE}the {t.kind} file {path} of saving rank {t.member} on node "
                f"{record.rank_nodes[t.member]!r} (step {step}): {exc.strerror or exc}"
            ) from exc

    def _source_view(t: Transfer, path: Path) -> torch.Tensor:
        if t.kind == "data":
            return mapped(path).view(t.offset, t.length)
        if t.member not in checked:  # the whole parity, once, before any of it leaves this rank
            full = mapped(path).view(0, layout.parity_nbytes[t.member])
            ok = checksum(full, layout.algo) == layout.checksums[t.member]
            checked[t.member] = None if ok else (
                f"the parity slot {path} of rank {t.member} (node {record.rank_nodes[t.member]!r}, step {step}) "
                f"failed its {layout.algo} checksum: it is corrupt and was not decoded"
            )
        return mapped(path).view(0, t.length)

    works: list[Pending] = []
    recvs: list[tuple[Transfer, torch.Tensor]] = []
    local_error: str | None = None
    try:
        for lost, b in sorted(rebuild.items()):
            if b == me:
                out = SlotFile(rebuilt_path(rank_dir(lost), step))
                out.ensure_capacity(record.rank_nbytes[lost])
                outs[lost] = out
        for t in plan:
            if t.dst != me or t.src == me:  # from this rank itself: read in place below, no message
                continue
            what = f"{t.kind} of rank {t.member} to rebuild rank {t.lost} from parity (step {step})"
            buf = outs[t.lost].view(t.into, t.length) if t.kind == "parity" else torch.empty(t.length, dtype=torch.uint8)
            works.append(transport.post_recv(buf, t.src, what))
            recvs.append((t, buf))
        for t in plan:
            if t.src != me:
                continue
            try:
                buf = source(t)
            except (OSError, ValueError) as exc:  # keep the pairing: send zeros, report the error
                text = str(exc)
                local_error = local_error or (text if text.startswith(UNREADABLE)
                                              else f"rank {me} could not read {t.kind} of rank {t.member}: {exc}")
                errors[t.lost] = local_error
                buf = torch.zeros(t.length, dtype=torch.uint8)
            if t.kind == "parity" and checked.get(t.member):
                errors[t.lost] = str(checked[t.member])
            if t.dst == me:
                recvs.append((t, buf))
                continue
            works.append(transport.post_send(buf, t.dst, f"{t.kind} of rank {t.member} for the parity rebuild of rank {t.lost}"))
    except (OSError, GeminiError) as exc:  # no room for the rebuilt slot, an unwritable file
        local_error = f"rank {me}: {exc}"
        for lost in rebuild:
            errors.setdefault(lost, local_error)
    for w in works:
        transport.wait(w, deadline_s=transport.timeout_s, fatal=True)
    for t, buf in recvs:  # a parity (received in place, or this rank's own) first, then the stripes XORed in
        if t.kind == "parity" and t.src == me and t.lost in outs:
            outs[t.lost].view(t.into, t.length).copy_(buf)
    for t, buf in recvs:
        if t.kind == "data" and t.lost in outs:
            outs[t.lost].view(t.into, t.length).bitwise_xor_(buf)
    refs = refs_by_location(record.metadata.storage_data)
    for lost, out in outs.items():
        if lost in errors:
            continue
        bad = [k for k, ref in refs.items() if k[0] == lost and not verify_chunk(out.view(ref.offset, ref.length), ref)]
        if bad:
            errors[lost] = (
                f"rank {lost}'s slot rebuilt from parity does not match {len(bad)} of its shards' checksums "
                f"(first at offset {bad[0][1]}): a survivor's data or parity is damaged; nothing of it was used"
            )
    maps.clear()
    gathered = comm.all_gather_object(errors)
    agreed: dict[int, str] = {}
    for e in gathered:
        for lost, why in e.items():
            agreed.setdefault(int(lost), why)
    for lost, out in outs.items():
        out.close()
        if lost in agreed:
            rebuilt_path(rank_dir(lost), step).unlink(missing_ok=True)
    ok = {lost: lost not in agreed for lost in rebuild}
    return Rebuilt(ok=ok, errors=agreed, nbytes=sum(record.rank_nbytes[r] for r, good in ok.items() if good))
