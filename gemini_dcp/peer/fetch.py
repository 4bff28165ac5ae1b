"""The restore side of the peer tier: route chunks to holders, fetch them, repair failures.

The coordinator routes every chunk a rank's node does not hold to a rank of a
holder node (:func:`assign_sources`, pure, from the collective restore decision).
Each rank posts its round of sends and receives (:func:`start_transfer`) before
it verifies its local chunks, then waits for them (:func:`finish_transfer`);
a chunk whose copy fails verification is fetched again from another holder in
further collective rounds (:func:`fetch_remote`), then from the persistent tier,
else the restore fails on every rank (:func:`raise_unservable`).

Received bytes land in a :class:`~gemini_dcp.peer.arena.ReceiveArena`, never in
the caller's tensors: the reader verifies and stages them, and copies them into
the state dict only once every rank holds a verified copy of every chunk. The
reader is seen only through :class:`Staging`, a value of narrow callables.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ..core.chunk_sink import corrupt_error
from ..core.restore_order import RestoreDecision
from ..errors import GeminiError, ShardUnavailableError
from ..local.record_types import ShardRef, StepRecord, refs_by_location
from ..transport.comm import Comm
from ..transport.p2p import Pending, Transport
from .arena import ReceiveArena
from .routes import ItemKey

__all__ = [
    "MAX_REPAIR_ROUNDS",
    "Inflight",
    "Staging",
    "Tally",
    "assign_sources",
    "fetch_remote",
    "finish_transfer",
    "raise_unservable",
    "refs_by_key",
    "start_transfer",
]

log = logging.getLogger(__name__)

MAX_REPAIR_ROUNDS = 4


class Staging(Protocol):
    """What the restore side reads from, and hands chunks to, on this rank (the reader's part).

    The transfers call these methods; nothing here reaches into the reader otherwise.
    """

    decision: RestoreDecision
    record: StepRecord
    refs: Mapping[ItemKey, ShardRef]
    """Every stored chunk by location (:func:`refs_by_key` of ``record``)."""
    node_id: str
    has_persistent: bool
    """Whether :meth:`from_persistent` can serve (a persistent tier is configured)."""

    def local_bytes(self, ref: ShardRef) -> torch.Tensor | None:
        """This node's stored bytes of a chunk (None: not held here)."""

    def stage(self, items: list[ReadItem], ref: ShardRef, buf: torch.Tensor) -> bool:
        """Verify ``buf`` and stage it for ``items`` (False: checksum mismatch)."""

    def from_persistent(self, items: list[ReadItem]) -> int:
        """Read and stage ``items`` from the persistent tier; the bytes read."""

    def keep_arena(self, arena: ReceiveArena) -> None:
        """Keep a round's receive buffers alive until the staged chunks are applied."""

    def rank_ok(self) -> bool:
        """False once this rank will raise (it tells the others in the next agreement round)."""


def refs_by_key(record: StepRecord) -> Mapping[ItemKey, ShardRef]:
    """Every chunk of ``record`` by its :data:`~gemini_dcp.peer.routes.ItemKey`."""
    return refs_by_location(record.metadata.storage_data)


def assign_sources(
    needs: list[list[ItemKey]],
    decision: RestoreDecision,
    record: StepRecord,
    exclude: set[tuple[int, ItemKey, str]],
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

    pending: list[ItemKey]  # chunks this rank still needs
    exclude: list[tuple[int, ItemKey, str]]  # (requester, chunk, node) sources that failed
    counts: dict[str, int]  # bytes restored per tier so far
    ok: bool  # False: this rank failed and raises its own error


@dataclass
class Inflight:
    """One round of posted peer transfers (see :func:`start_transfer`)."""

    sends: list[Pending] = field(default_factory=list)
    recvs: list[tuple[ItemKey, torch.Tensor, Pending | None]] = field(default_factory=list)  # (key, landing buffer, receive)
    arena: ReceiveArena | None = None


def start_transfer(staging: Staging, transport: Transport, route: dict[str, Any]) -> Inflight:
    """Post one round of sends and receives (non-blocking); :func:`finish_transfer` completes it.

    Sends are posted first so that a serving rank feeds its requesters while it
    restores its own shards.
    """
    out = Inflight()
    refs = staging.refs
    for requester, key in sorted(route.get("serve", ())):
        ref = refs[key]
        if ref.length == 0:
            continue
        buf = staging.local_bytes(ref)
        if buf is None:  # keep the protocol in step; the receiver's checksum will reject it
            buf = torch.zeros(ref.length, dtype=torch.uint8)
        out.sends.append(transport.post_send(buf, requester, "peer send of a chunk"))
    recv = sorted(route.get("recv", {}).items())
    if recv:
        # Every chunk lands in a buffer of its own, never the destination tensor: the reader
        # verifies it there and copies it into the state dict only once every rank holds a
        # verified copy of every chunk (``GeminiStorageReader.read_data``), so a corrupt or
        # missing chunk leaves the caller's tensors as they were.
        out.arena = ReceiveArena([refs[key].length for key, _ in recv])
        staging.keep_arena(out.arena)  # released with the slot mappings, after the apply
        for (key, server), buf in zip(recv, out.arena.views):
            what = f"peer receive of the chunk at offset {key[1]} of rank {key[0]}'s slot"
            pending = transport.post_recv(buf, server, what) if refs[key].length else None
            out.recvs.append((key, buf, pending))
        out.arena.start_populate()  # pre-faults while gloo already receives into it
    return out


def finish_transfer(
    staging: Staging, transport: Transport, inflight: Inflight, by_key: dict[ItemKey, list[ReadItem]]
) -> dict[ItemKey, bool]:
    """Wait for each received chunk in turn, verifying and staging it as it arrives; key -> ok.

    A transport failure breaks the control plane (RestartRequiredError): a restore cannot recover.
    """
    ok: dict[ItemKey, bool] = {}
    for key, buf, pending in inflight.recvs:
        if pending is not None:
            transport.wait(pending, fatal=True)
        ok[key] = staging.stage(by_key[key], staging.refs[key], buf)  # verified and staged, not yet applied
    for pending in inflight.sends:
        transport.wait(pending, fatal=True)
    if inflight.arena is not None:
        inflight.arena.join()
    return ok


def fetch_remote(
    staging: Staging,
    comm: Comm,
    transport: Transport,
    by_key: dict[ItemKey, list[ReadItem]],
    routes: dict[str, Any],
    failed: dict[ItemKey, str],
    counts: dict[str, int],
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
    decision, record, refs = staging.decision, staging.record, staging.refs
    route = routes or {"recv": {}, "serve": []}
    for key, ok in finish_transfer(staging, transport, first, by_key).items():
        if ok:
            counts["peer"] += refs[key].length
        else:
            failed[key] = f"checksum from rank {route['recv'][key]}"
    node_of = {r: n for n, rs in decision.node_ranks.items() for r in rs}
    exclude: set[tuple[int, ItemKey, str]] = set()
    for key, srv in route["recv"].items():
        if key in failed:
            exclude.add((comm.rank, key, node_of[srv]))
    for key in failed:
        exclude.add((comm.rank, key, staging.node_id))
    given_up: set[ItemKey] = set()
    for rnd in range(MAX_REPAIR_ROUNDS):
        # Never raise inside this loop: every rank must run the same rounds.
        pending = sorted(k for k in failed if k not in given_up)
        tallies: list[Tally] = comm.all_gather_object(Tally(pending, sorted(exclude), dict(counts), staging.rank_ok()))
        if not any(t.pending for t in tallies):
            if rnd == 0:
                return tallies  # nothing to repair anywhere: these counts are final
            break
        needs = [t.pending for t in tallies]
        excl = {e for t in tallies for e in t.exclude}
        mine = assign_sources(needs, decision, record, excl, local_ok=False)[comm.rank]
        inflight = start_transfer(staging, transport, mine)
        for key, ok in finish_transfer(staging, transport, inflight, by_key).items():
            if ok:
                counts["peer"] += refs[key].length
                failed.pop(key, None)
            else:
                exclude.add((comm.rank, key, node_of[mine["recv"][key]]))
        if mine["none"]:
            _from_persistent(staging, by_key, set(mine["none"]), failed, counts)
            given_up.update(k for k in mine["none"] if k in failed)
    if failed:
        raise_unservable(decision.step, by_key, refs, failed)
    return None


def _from_persistent(
    staging: Staging,
    by_key: dict[ItemKey, list[ReadItem]],
    keys: set[ItemKey],
    failed: dict[ItemKey, str],
    counts: dict[str, int],
) -> None:
    """Stage ``keys`` from the persistent tier where it can serve them (dropping them from ``failed``)."""
    if not staging.has_persistent:
        return
    for k in keys:
        try:
            counts["persistent"] += staging.from_persistent(by_key[k])
        except GeminiError as exc:
            log.warning("persistent copy of %s unusable: %s", by_key[k][0].storage_index.fqn, exc)
            continue
        failed.pop(k, None)


def raise_unservable(
    step: int,
    by_key: dict[ItemKey, list[ReadItem]],
    refs: Mapping[ItemKey, ShardRef],
    failed: dict[ItemKey, str],
) -> None:
    """Raise the error of chunks no copy could serve: the corrupt-chunk error if one was corrupt, else
    ShardUnavailableError naming them."""
    corrupt = [k for k, why in failed.items() if why != "missing"]
    if corrupt:
        k = corrupt[0]
        raise corrupt_error(by_key[k][0], refs[k], step, f"{failed[k]}; {len(failed)} chunk(s) affected")
    names = sorted({f"{by_key[k][0].storage_index.fqn}@rank{k[0]}" for k in failed})
    raise ShardUnavailableError(
        f"step {step}: no surviving copy of {len(failed)} chunk(s): {names[:20]}"
        f"{' ...' if len(names) > 20 else ''}. Load an older step, or configure persistent=<url>."
    )
