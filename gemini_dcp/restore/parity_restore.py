"""The reader's side of XOR parity: rebuild lost slots, then restore as from any holder.

After the collective restore decision (:func:`gemini_dcp.core.restore_order.decide`) chose
to rebuild some lost saving ranks from parity, :func:`rebuild_from_parity` runs the rebuild
(:func:`gemini_dcp.peer.parity.rebuild_lost`, collective) and registers each rebuilt slot as
a local slot of the rebuilding node: from then on the restore reads, serves and verifies
those chunks exactly as it does any other copy (every chunk against its shard checksum, in
:mod:`gemini_dcp.core.chunk_sink`). A rank whose rebuild failed (a corrupt parity, a
damaged survivor) goes to the persistent tier when it holds the step, else every rank
raises the same error naming the parity slot and the group.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from ..core.restore_order import RestoreDecision
from ..errors import ChecksumMismatchError, ShardUnavailableError
from ..local.parity_record import rebuilt_path
from ..local.record_types import StepRecord
from ..local.tier import LocalTier
from ..peer.parity import rebuild_lost, rebuild_servers
from ..transport.comm import Comm
from ..transport.p2p import transport_for

__all__ = ["drop_rebuilt", "held_lanes", "rebuild_from_parity", "rebuilt_tier"]

log = logging.getLogger(__name__)


def held_lanes(record: StepRecord) -> tuple[tuple[int, ...], ...]:
    """The parity lanes covering the ranks this node's record holds (for its restore view)."""
    layout = getattr(record, "parity", None)
    if layout is None:
        return ()
    held = set(record.held_ranks())
    return tuple(lane for lane in layout.lanes if held.intersection(lane))


def rebuilt_tier(decision: RestoreDecision | None, rank: int, otherwise: str) -> str:
    """``"parity"`` for a chunk of a saving rank rebuilt from parity in this restore, else ``otherwise``."""
    return "parity" if decision is not None and rank in decision.rebuilt else otherwise


def rebuild_from_parity(
    comm: Comm,
    tier: LocalTier,
    decision: RestoreDecision,
    record: StepRecord,
    mine: StepRecord | None,
    local: dict[int, Path],
    persisted: Sequence[int] | None,
    *,
    peer_transport: str = "gloo",
) -> RestoreDecision:
    """Collective (all ranks, after the record broadcast): rebuild ``decision.rebuilt``'s ranks.

    ``mine``: this node's record of the step (None: this node holds none); ``local``: the reader's
    saving rank -> slot file map of this node, to which the rebuilt slots of this node are added.
    ``peer_transport``: what moves the stripes and parities (:func:`~gemini_dcp.transport.p2p.transport_for`).
    Returns the decision to restore with (a failed rebuild moved to the persistent tier).
    Raises, on every rank, when a rank could not be rebuilt and the persistent tier does not hold
    the step: ShardUnavailableError when a survivor's data or parity file is missing or unreadable
    (naming the file and its node), else ChecksumMismatchError.
    """
    servers = rebuild_servers(record, decision.holders, decision.node_ranks)
    slot_of = {s.rank: s.slot for s in mine.slots} if mine is not None else {}
    layout = tier.layout
    out = rebuild_lost(
        comm, transport_for(comm, peer_transport), record, decision.rebuilt, servers,
        slot_index=slot_of.get, slot_path=tier.slot_path, rank_dir=layout.rank_dir,
    )
    node_of = {r: n for n, rs in decision.node_ranks.items() for r in rs}
    my_node = node_of.get(comm.rank)
    for lost, good in out.ok.items():
        if good and node_of.get(decision.rebuilt[lost]) == my_node:
            local[lost] = rebuilt_path(layout.rank_dir(lost), record.step)
    if not out.errors:
        if comm.rank == 0:
            log.info("step %s: rebuilt saving ranks %s from XOR parity (%d bytes)", record.step,
                     sorted(decision.rebuilt), out.nbytes)
        return decision
    failed = sorted(out.errors)
    why = "; ".join(f"rank {r}: {out.errors[r]}" for r in failed)
    groups = [record.parity.lanes[i] for r in failed if record.parity and (i := record.parity.lane_index(r)) is not None]
    if persisted is not None and record.step in persisted:
        log.warning("step %s: could not rebuild saving ranks %s from parity (%s); reading them from the persistent tier",
                    record.step, failed, why)
        holders = {r: (() if r in out.errors else h) for r, h in decision.holders.items()}
        return dataclasses.replace(
            decision, holders=holders, use_persistent=True,
            missing_ranks=tuple(sorted(set(decision.missing_ranks) | set(failed))),
            rebuilt={r: b for r, b in decision.rebuilt.items() if r not in out.errors},
        )
    if set(failed) <= set(out.unreadable):
        raise ShardUnavailableError(
            f"job {record.job_id!r} step {record.step}: the lost saving ranks {failed} cannot be rebuilt from parity: "
            f"{why}. Nothing was restored. Load an older step, or configure persistent=<url> so that such a loss "
            "falls back to the persistent tier."
        )
    raise ChecksumMismatchError(
        f"job {record.job_id!r} step {record.step}: the lost saving ranks {failed} (parity groups of saving ranks "
        f"{[list(g) for g in groups]}) cannot be rebuilt from parity: {why}. Nothing was restored. Load an older "
        "step, or configure persistent=<url> so that such a loss falls back to the persistent tier."
    )


def drop_rebuilt(tier: LocalTier, decision: RestoreDecision | None, rank: int, step: int) -> None:
    """Remove the slots this rank rebuilt from parity (after every rank staged its chunks: the staged
    views keep their pages mapped; the memory goes back to the tier once they are released)."""
    if decision is None:
        return
    for lost, b in decision.rebuilt.items():
        if b == rank:
            rebuilt_path(tier.layout.rank_dir(lost), step).unlink(missing_ok=True)


class TierBytes(dict):  # type: ignore[type-arg]
    """Bytes restored per tier: ``local``, ``peer``, ``persistent`` always; ``parity`` only once some
    bytes came from a slot rebuilt from parity (reading it otherwise gives 0), so that a restore
    without parity reports exactly the three tiers it always did."""

    def __missing__(self, key: str) -> int:
        if key == "parity":
            return 0
        raise KeyError(key)


def tier_bytes(counts: dict[str, int]) -> TierBytes:
    """``counts`` as :class:`TierBytes` (``parity`` dropped when 0)."""
    return TierBytes({k: v for k, v in counts.items() if k != "parity" or v})
