"""XOR parity over groups of nodes (RAID-5 across node memories): the pure arithmetic.

No I/O, no collectives, no torch: which nodes form a parity group, which ranks form a
*lane* (the unit one XOR parity protects), how a member's slot bytes are cut into
stripes, which member holds the parity of which stripes, and the transfers of an
encode or a rebuild. :mod:`gemini_dcp.peer.parity` moves the bytes.

The scheme. Nodes are grouped by the placement's stable positions (the node order the
replication uses, :func:`gemini_dcp.peer.push.node_order`): consecutive runs of ``g``
positions; the last ``N mod g`` nodes join the last full group (so every group has at
least ``g`` members and a node's parity is at most ``1/(g-1)`` of its data); with fewer
than ``g`` nodes, all of them form one group (2 nodes: the parity is a copy).

Inside a group, the ``l``-th rank (by rank number) of every node forms lane ``l``: ``n``
ranks on ``n`` distinct nodes. Each member ``i`` pads its slot bytes (``nbytes_i``) to
the lane's longest and cuts them into ``n - 1`` stripes of ``stripe`` bytes; member ``k``
holds the parity ``P_k = XOR over i != k of stripe sigma(i, k) of member i``, with
``sigma(i, k) = (k - i - 1) mod n`` (each member's ``n - 1`` stripes go to the ``n - 1``
other members, one each). A lost member ``q`` is rebuilt stripe by stripe:
``stripe sigma(q, m) of q = P_m XOR (XOR over i not in {m, q} of stripe sigma(i, m) of i)``.
A lane that loses two members cannot be rebuilt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = [
    "ALIGN",
    "Transfer",
    "check_parity_group",
    "encode_transfers",
    "lane_of",
    "parity_groups",
    "parity_lanes",
    "parity_length",
    "rebuild_transfers",
    "sigma",
    "stripe_range",
    "stripe_size",
]

ALIGN = 64


def parity_groups(order: Sequence[str], g: int) -> list[tuple[str, ...]]:
    """Groups of nodes, in placement order: runs of ``g``; the remainder joins the last group.

    ``g`` must be >= 2 (the writer asks for >= 3). Fewer than ``g`` nodes: one group of all.
    """
    if g < 2:
        raise ValueError(f"a parity group needs at least 2 nodes, got g={g}")
    n = len(order)
    if n == 0:
        return []
    full = max(1, n // g)
    groups = [tuple(order[i * g:(i + 1) * g]) for i in range(full)]
    rest = tuple(order[full * g:])
    if rest:
        groups[-1] = groups[-1] + rest
    return groups


def parity_lanes(order: Sequence[str], rank_nodes: Sequence[str], g: int) -> list[tuple[int, ...]]:
    """Lanes (tuples of saving ranks, one per node of a group, in placement order).

    Lane ``l`` of a group holds the ``l``-th rank of each of its nodes that has one. Where
    nodes hold uneven numbers of ranks, a lane can end with one rank (its node holds more
    ranks than any other): it takes a member from a lane of three or more whose node differs
    (the last such, in placement order), so that it is protected too. A lane left with a
    single rank (no lane can give one: e.g. one node holds more ranks than all the group's
    other nodes together) protects nothing and is left out (its rank has no parity).
    """
    ranks_of: dict[str, list[int]] = {}
    for r, node in enumerate(rank_nodes):
        ranks_of.setdefault(node, []).append(r)
    lanes: list[tuple[int, ...]] = []
    for group in parity_groups([n for n in order if n in ranks_of], g):
        pos = {n: i for i, n in enumerate(group)}
        node_of = {r: n for n in group for r in ranks_of[n]}
        depth = max(len(ranks_of[n]) for n in group)
        built = [[ranks_of[n][lane] for n in group if lane < len(ranks_of[n])] for lane in range(depth)]
        for lone in (ln for ln in built if len(ln) == 1):
            node = node_of[lone[0]]
            donor = next((d for d in built if len(d) >= 3 and any(node_of[r] != node for r in d)), None)
            if donor is None:
                continue
            moved = next(r for r in reversed(donor) if node_of[r] != node)
            donor.remove(moved)
            lone.append(moved)
            lone.sort(key=lambda r: pos[node_of[r]])
        lanes.extend(tuple(ln) for ln in built if len(ln) >= 2)
    return lanes


def lane_of(lanes: Sequence[Sequence[int]], rank: int) -> int | None:
    """Index of the lane holding ``rank`` (None: the rank has no parity)."""
    for i, lane in enumerate(lanes):
        if rank in lane:
            return i
    return None


def stripe_size(nbytes: Sequence[int]) -> int:
    """Bytes per stripe of a lane whose members store ``nbytes``: the longest, cut in ``n - 1``, aligned."""
    n = len(nbytes)
    if n < 2:
        raise ValueError("a lane has at least 2 members")
    longest = max(nbytes) if nbytes else 0
    per = -(-longest // (n - 1))
    return (per + ALIGN - 1) // ALIGN * ALIGN


def sigma(i: int, k: int, n: int) -> int:
    """The stripe of member ``i`` whose parity member ``k`` holds (``i != k``), in ``[0, n - 2]``."""
    if i == k:
        raise ValueError("a member holds no parity of its own stripes")
    return (k - i - 1) % n


def stripe_range(j: int, stripe: int, nbytes: int) -> tuple[int, int]:
    """(offset, length) of stripe ``j`` in a slot of ``nbytes`` (length 0 past the end: padding)."""
    off = j * stripe
    return off, max(0, min(stripe, nbytes - off))


def parity_length(k: int, nbytes: Sequence[int], stripe: int) -> int:
    """Bytes of member ``k``'s parity: the longest stripe it covers (the rest would be zeros)."""
    n = len(nbytes)
    return max((stripe_range(sigma(i, k, n), stripe, nbytes[i])[1] for i in range(n) if i != k), default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """One message of an encode or a rebuild.

    ``src``/``dst``: ranks; ``kind``: ``"data"`` (bytes of saving rank ``member``'s slot at
    ``offset``) or ``"parity"`` (the first ``length`` bytes of ``member``'s parity);
    ``into``: where the bytes are XORed in the destination (parity offset on encode,
    rebuilt-slot offset on rebuild); ``lost``: the saving rank being rebuilt (-1: encode).
    """

    src: int
    dst: int
    kind: str
    member: int
    offset: int
    length: int
    into: int
    lost: int = -1


def encode_transfers(lane: Sequence[int], nbytes: Sequence[int]) -> tuple[int, list[Transfer]]:
    """(stripe, messages) of encoding one lane: member ``i`` sends stripe ``sigma(i, k)`` to member ``k``.

    ``nbytes[i]`` is member ``i``'s slot bytes; ranks are the lane's (saving = current) ranks.
    Empty stripes (padding) are not sent.
    """
    n = len(lane)
    stripe = stripe_size(nbytes)
    out: list[Transfer] = []
    for k in range(n):
        for i in range(n):
            if i == k:
                continue
            off, length = stripe_range(sigma(i, k, n), stripe, nbytes[i])
            if length:
                out.append(Transfer(src=lane[i], dst=lane[k], kind="data", member=lane[i], offset=off, length=length, into=0))
    return stripe, out


def rebuild_transfers(
    lane: Sequence[int], nbytes: Sequence[int], parity_nbytes: Sequence[int], stripe: int, lost: int,
    server: Mapping[int, int], rebuilder: int,
) -> list[Transfer]:
    """The messages that rebuild saving rank ``lost`` of ``lane`` on rank ``rebuilder``.

    ``server[m]``: the current rank that serves saving rank ``m``'s slot and parity (a rank of
    the node holding them). For every other member ``m``: its parity (the stripe of ``lost``
    it covers), then the same stripe index of every other survivor ``i``.
    """
    n = len(lane)
    q = list(lane).index(lost)
    out: list[Transfer] = []
    for m in range(n):
        if m == q:
            continue
        base, length = stripe_range(sigma(q, m, n), stripe, nbytes[q])
        if not length:
            continue
        out.append(Transfer(src=server[lane[m]], dst=rebuilder, kind="parity", member=lane[m], offset=0,
                            length=min(length, parity_nbytes[m]), into=base, lost=lost))
        for i in range(n):
            if i in (m, q):
                continue
            off, ln = stripe_range(sigma(i, m, n), stripe, nbytes[i])
            ln = min(ln, length)
            if ln:
                out.append(Transfer(src=server[lane[i]], dst=rebuilder, kind="data", member=lane[i], offset=off,
                                    length=ln, into=base, lost=lost))
    return out


def check_parity_group(group: object, replicas: int) -> int | None:
    """The writer's ``parity_group`` validated (None: no parity). Raises ConfigError saying what to change."""
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, int) or group < 3:
        raise ConfigError(
            f"parity_group={group!r}: pass an int >= 3 (nodes per XOR parity group; each node then keeps "
            "1/(parity_group-1) of a checkpoint in parity), or leave it None for no parity."
        )
    if replicas > 1:
        raise ConfigError(
            f"parity_group={group} and replicas={replicas} both protect the peer tier: choose one. Set replicas=1 to "
            "use XOR parity (one lost node per group, ~1/(g-1) of a checkpoint per node), or drop parity_group to keep "
            f"{replicas - 1} full peer cop{'y' if replicas == 2 else 'ies'}."
        )
    return group
