"""What each rank reports at the commit gather, and the compact (checksums-only) form of it.

A :class:`RankReport` is one rank's part of the commit gather (see
:mod:`gemini_dcp.commit.protocol`): where its bytes landed (node, slot, size), its DCP write
results, and what the other ranks need to build the same step record. When a save's chunks
land exactly where a known layout put them, the report sends only the checksums
(:func:`compact`); every rank rebuilds the results from the layout (:func:`expand`), or, when
every report is compact, records the layout plus the checksums (:func:`overlay`).

All functions here are pure: every rank computes the same answer from the same reports.
"""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import ConfigError, UntrustedDataError
from ..local.record_types import ChecksumOverlay, RankSlot, ShardRef

#: A layout split per rank: each rank's (index, chunk location) pairs, in its write order.
RankLayouts = dict[int, list[tuple[MetadataIndex, ShardRef]]]


@dataclasses.dataclass(frozen=True, slots=True)
class RankReport:
    """What each rank tells every other rank when sealing a step."""

    rank: int
    node_id: str
    slot: int
    nbytes: int
    results: Sequence[WriteResult]  # pickled as a tuple
    replica_slots: tuple[RankSlot, ...] = ()  # peer replicas this rank stored for other nodes
    # Rank 0 only, on a planned save: the digest of the planner's global metadata (pickled
    # without storage_data / storage_meta, see records.metadata_shell_blob) and this save's
    # storage_meta. The pickled metadata itself rides inline when small for the world size
    # (all_gather_object pads every rank's part to the largest, so an inline blob costs every
    # rank world_size x its size) and rank 0 did not plan the same metadata last time; else it
    # follows in one broadcast, unless every rank already holds it (``known_metadata``).
    metadata_digest: bytes | None = None
    metadata_blob: bytes | None = None
    storage_meta: StorageMeta | None = None
    # Every rank: the digest of the planned metadata this writer holds from its last save.
    known_metadata: bytes | None = None
    # A save whose results match a known layout (the replayed plan's, or the last committed
    # one) sends only its checksums, in the layout's order for this rank; ``results`` is then
    # empty until :func:`expand` rebuilds it.
    checksums: tuple[int, ...] | None = None
    # The last committed layout this rank's writer holds, as (step that committed it, chunks);
    # None when it holds none. A plain ``dcp.save`` may use the compact form only when every
    # rank reports the same basis (all hold the same layout); else it gathers again in full.
    basis: tuple[int, int] | None = None
    # Bytes per message this rank sends its slot to peers in (0: one message): the wire chunk.
    # Set when the replication is paced (``SaveHooks.replication_pace``); receivers post
    # matching receives.
    wire_chunk: int = 0
    # Who this rank's node is, beyond its node id: two machines configured with the same
    # GEMINI_DCP_NODE_ID (same id, another host or tier root) are refused before the commit.
    host: str = ""
    # The failure domain of this rank's node (GeminiOptions.failure_domain; "": none): placement spreads
    # each node's copies over the domains (gemini_dcp.peer.placement.spread_over_domains).
    failure_domain: str = ""
    root_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the tier root
    # Rank 0 only: (launch_id, description) of its launch, recorded in the step record.
    launch: tuple[str, str] | None = None
    # Incremental saves: (item bytes this rank copied, item bytes its slot already held); None: all copied.
    save_bytes: tuple[int, int] | None = None
    # Delta replication (plain tuples, gemini_dcp.peer.delta): this rank's offer as a sender, and
    # the replica slots its node would receive into with what they hold, as a receiver.
    delta_offer: tuple[Any, ...] | None = None
    replica_bases: tuple[tuple[int, int, str, int], ...] = ()
    # A compact report whose pickled values (ShardRef.dtype None) changed length or place since the layout:
    # (position in this rank's layout, offset in the slot, length). Every other chunk is where the layout has it.
    moved: tuple[tuple[int, int, int], ...] = ()
    # (fqn, count) of this rank's items holding NaN/Inf values (gemini_dcp.health; empty: none, or not counted).
    nonfinite: tuple[tuple[str, int], ...] = ()
    # The newest healthy step this rank knows, with its per-FQN totals (gemini_dcp.health.baseline):
    # every rank judges the step against the newest of all the reports' (None: none known, or not checked).
    health_baseline: tuple[int, tuple[tuple[str, int], ...]] | None = None


# Padding an inline metadata blob may cost each rank at most this much in the report gather.
INLINE_METADATA_PADDING = 16 << 20


def inline_metadata(blob: bytes | None, world_size: int) -> bool:
    """Whether rank 0's pickled metadata goes inline in the report gather (else: one broadcast)."""
    return blob is not None and len(blob) * max(world_size - 1, 1) <= INLINE_METADATA_PADDING


def rank_layouts(layout: Mapping[MetadataIndex, ShardRef]) -> RankLayouts:
    """The recorded save's chunks per rank, in that rank's write order (the commit's dict order)."""
    out: RankLayouts = {}
    for idx, ref in layout.items():
        out.setdefault(ref.rank, []).append((idx, ref))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class SplitLayout:
    """A recorded layout split per rank: computed once per layout, not once per save."""

    source: Mapping[MetadataIndex, ShardRef]  # the layout, kept for identity
    by_rank: RankLayouts
    # The layout lists the ranks' chunks in ascending rank order, each rank's together: the
    # ranks' checksums concatenated in rank order are then in the layout's own order.
    rank_ordered: bool

    @classmethod
    def of(cls, layout: Mapping[MetadataIndex, ShardRef]) -> SplitLayout:
        ranks = [ref.rank for ref in layout.values()]
        return cls(layout, rank_layouts(layout), all(a <= b for a, b in itertools.pairwise(ranks)))


def base_layout(layout: Mapping[MetadataIndex, ShardRef]) -> Mapping[MetadataIndex, ShardRef]:
    """The chunk locations under ``layout``: an overlay's shared layout (every save of one
    structure has the same one), else ``layout`` itself. Checksums aside, the two agree."""
    return layout.layout if isinstance(layout, ChecksumOverlay) else layout


def agreed_basis(reports: list[RankReport]) -> bool:
    """Every rank holds the same last committed layout (same commit step, same chunk count)."""
    first = reports[0].basis
    return first is not None and all(rep.basis == first for rep in reports)


def check_move(rank: int, mine: list[tuple[MetadataIndex, ShardRef]], k: int, offset: int, n: int) -> None:
    """UntrustedDataError unless a report's move ``(k, offset, n)`` names a pickled value of ``mine``
    (the rank's recorded layout) and a place: only pickled values change length between saves."""
    if not (0 <= k < len(mine)) or mine[k][1].dtype is not None or offset < 0 or n < 0:
        raise UntrustedDataError(f"rank {rank}'s commit report moves item {k}, which is not a pickled value: "
                                 "not a gemini_dcp report; nothing was committed")


def overlay(split: SplitLayout, reports: list[RankReport]) -> ChecksumOverlay | None:
    """This save's storage_data as the layout plus checksums (and the new places of the pickled
    values that moved), when every report is compact and holds its rank's chunks of the layout."""
    if not split.rank_ordered or any(rep.checksums is None for rep in reports):
        return None
    ordered = sorted(reports, key=lambda rep: rep.rank)
    sums = array("Q")
    moved: dict[int, tuple[int, int]] = {}
    for rep in ordered:
        mine = split.by_rank.get(rep.rank, [])
        if len(rep.checksums) != len(mine):  # type: ignore[arg-type]
            return None  # (expanded, then refused, by expand_report)
        base = len(sums)
        sums.extend(rep.checksums)  # type: ignore[arg-type]
        for k, offset, n in rep.moved:
            check_move(rep.rank, mine, k, offset, n)
            moved[base + k] = (offset, n)
    return ChecksumOverlay(split.source, sums, moved) if len(sums) == len(split.source) else None


def compact(report: RankReport, mine: list[tuple[MetadataIndex, ShardRef]]) -> RankReport:
    """``report`` with its results replaced by their checksums when they match ``mine``
    (the recorded layout of this rank) in everything but the checksums and the places (offset,
    length) of pickled values (those ride in ``moved``); else unchanged."""
    res = report.results
    if len(res) != len(mine):
        return report
    moved: list[tuple[int, int, int]] = []
    for k, (wr, (idx, ref)) in enumerate(zip(res, mine)):
        got = wr.storage_data.with_checksum(ref.checksum)
        if wr.index != idx:
            return report
        if got != ref:
            if ref.dtype is None and got.dtype is None and got._replace(offset=ref.offset, length=ref.length) == ref:
                moved.append((k, got.offset, got.length))
            else:
                return report
    return dataclasses.replace(report, results=(), checksums=tuple(wr.storage_data.checksum for wr in res),
                               moved=tuple(moved))


def moved_values(byte_spans: tuple[tuple[int, int, int], ...],
                 mine: list[tuple[MetadataIndex, ShardRef]]) -> tuple[tuple[int, int, int], ...]:
    """The (position, offset, length) of ``byte_spans`` that are not where ``mine`` (the layout) has them."""
    return tuple((k, o, n) for k, o, n in byte_spans if (mine[k][1].offset, mine[k][1].length) != (o, n))


def expand(report: RankReport | None, layouts: RankLayouts) -> RankReport | None:
    """Rebuild the results of a compact report from the recorded layout of its rank."""
    return None if report is None else expand_report(report, layouts)


def expand_report(report: RankReport, layouts: RankLayouts) -> RankReport:
    """:func:`expand` of a report that is there (a full report comes back unchanged)."""
    if report.checksums is None:
        return report
    mine = layouts.get(report.rank, [])
    results = [
        WriteResult(
            index=idx,
            size_in_bytes=ref.length,
            storage_data=ref.with_checksum(cs),
        )
        for (idx, ref), cs in zip(mine, report.checksums, strict=True)
    ]
    for k, offset, n in report.moved:  # pickled values of another length or place
        check_move(report.rank, mine, k, offset, n)
        wr = results[k]
        results[k] = WriteResult(index=wr.index, size_in_bytes=n, storage_data=wr.storage_data._replace(offset=offset, length=n))
    return dataclasses.replace(report, results=tuple(results), checksums=None, moved=())


def check_node_identities(reports: list[RankReport]) -> None:
    """ConfigError when one node id names two machines (or two tier roots): their records
    would claim each other's slots, and no restore could ever find the step."""
    seen: dict[str, dict[tuple[str, tuple[int, int]], list[int]]] = {}
    for rep in reports:
        seen.setdefault(rep.node_id, {}).setdefault((rep.host, rep.root_id), []).append(rep.rank)
    clashes = {node: places for node, places in seen.items() if len(places) > 1}
    if clashes:
        node, places = next(iter(clashes.items()))
        where = "; ".join(
            f"ranks {ranks} on host {host} (root device/inode {rid[0]}/{rid[1]})" for (host, rid), ranks in places.items()
        )
        raise ConfigError(
            f"node id {node!r} is used by more than one machine or tier root: {where}. Nothing was committed. "
            "Every node needs its own GEMINI_DCP_NODE_ID (or leave it unset: the default is <hostname>:<root>)."
        )
