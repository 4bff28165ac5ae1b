"""GEMINI replica placement: which nodes keep a copy of each node's checkpoint in CPU memory.

Each of ``N`` nodes keeps ``m`` copies of its checkpoint (its own copy included) in the
CPU memory of ``m`` distinct nodes. GEMINI (SOSP'23, section 4) places them in one of
three ways:

- **group**: ``N/m`` disjoint groups of ``m`` consecutive nodes; every member stores every
  member's checkpoint. Optimal when ``m`` divides ``N``.
- **ring**: node ``i``'s copies go to ``i+1 … i+m-1 (mod N)``.
- **mixed** (default): ``⌊N/m⌋-1`` groups of ``m`` consecutive nodes, then one ring of the
  last ``(N mod m)+m`` nodes. Equals group placement when ``m`` divides ``N``.

Placement works on *positions* ``0 … N-1``; :func:`assign_positions` maps node identities
to positions so that surviving nodes keep theirs across restarts.

**Failure domains.** Consecutive positions are usually neighbours (a rack, a switch, a power
feed): one domain failing would take every copy of a group at once. With each node's failure
domain known, :func:`spread_over_domains` reorders the positions so that the ``m`` consecutive
positions of a group or ring window (and a parity group's members) fall in as many distinct
domains as exist. All nodes in one domain (or none
given): the order is unchanged, which keeps GEMINI's placement; the reordering is idempotent, so
a restarted job whose nodes keep their domains keeps its positions.
:func:`recovery_probability` with ``domains=`` counts whole domains failing instead of nodes.

:func:`recovery_probability` gives the exact probability that ``k`` simultaneous random
node failures leave every checkpoint with a live copy; :func:`group_formula` is the
paper's closed form for group placement.

Pure Python; no torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from ..errors import GeminiError

__all__ = [
    "ENUMERATION_LIMIT",
    "Placement",
    "PlacementError",
    "Strategy",
    "assign_positions",
    "group_formula",
    "place",
    "place_over_domains",
    "recovery_probability",
    "shared_domains",
    "spread_over_domains",
]

Strategy = Literal["mixed", "group", "ring"]
STRATEGIES: tuple[str, ...] = ("mixed", "group", "ring")

#: Largest number of failure sets ``C(N, k)`` that :func:`recovery_probability` will enumerate.
ENUMERATION_LIMIT = 2_000_000


class PlacementError(GeminiError, ValueError):
    """A placement cannot be built or evaluated with the given arguments."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every node's checkpoint copies live.

    Attributes:
        num_nodes: number of nodes ``N`` (positions ``0 … N-1``).
        replicas: copies of each node's checkpoint, its own included (``m``).
        strategy: the strategy asked for (``"mixed"``, ``"group"`` or ``"ring"``).
        holders: ``holders[i]`` is the sorted tuple of nodes whose CPU memory holds a copy of
            node ``i``'s checkpoint; it always contains ``i`` and has exactly ``m`` entries.
        groups: the partition of the nodes into groups and rings, each in ring order
            (for display, and to count failure sets exactly).
    """

    num_nodes: int
    replicas: int
    strategy: str
    holders: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = self.num_nodes
        if len(self.holders) != n:
            raise PlacementError(f"holders has {len(self.holders)} entries for {n} nodes: give one per node.")
        for i, hs in enumerate(self.holders):
            if i not in hs or list(hs) != sorted(set(hs)) or not all(0 <= h < n for h in hs):
                raise PlacementError(
                    f"holders[{i}]={hs!r}: each entry must be sorted, distinct node indices in 0..{n - 1} "
                    f"that include the node itself ({i})."
                )

    def peers_of(self, node: int) -> tuple[int, ...]:
        """The other nodes that store a copy of ``node``'s checkpoint."""
        return tuple(h for h in self.holders[self._check(node)] if h != node)

    def stored_on(self, node: int) -> tuple[int, ...]:
        """The nodes whose checkpoints ``node`` stores in its CPU memory, ``node`` itself included."""
        self._check(node)
        return tuple(i for i, hs in enumerate(self.holders) if node in hs)

    def group_of(self, node: int) -> int | None:
        """Index into :attr:`groups` of the group or ring ``node`` belongs to (None if not listed)."""
        self._check(node)
        return next((g for g, members in enumerate(self.groups) if node in members), None)

    def table(self) -> list[dict[str, Any]]:
        """One JSON-ready row per node: its holders, peers, the checkpoints it stores, its group."""
        return [
            {
                "node": i,
                "holders": list(self.holders[i]),
                "peers": list(self.peers_of(i)),
                "stores": list(self.stored_on(i)),
                "group": self.group_of(i),
            }
            for i in range(self.num_nodes)
        ]

    def _check(self, node: int) -> int:
        if not 0 <= node < self.num_nodes:
            raise PlacementError(f"node {node} is out of range: nodes are numbered 0..{self.num_nodes - 1}.")
        return node


# ---- building a placement ---------------------------------------------------------------------
def place(num_nodes: int, replicas: int, strategy: Strategy = "mixed") -> Placement:
    """Place ``replicas`` copies of each of ``num_nodes`` nodes' checkpoints.

    Args:
        num_nodes: ``N >= 1``.
        replicas: ``m``, copies per checkpoint counting the node's own; ``1 <= m <= N``.
        strategy: ``"mixed"`` (default), ``"group"`` (needs ``m`` to divide ``N``) or ``"ring"``.

    Raises:
        PlacementError: on invalid arguments, with what to change.
    """
    _check_sizes(num_nodes, replicas)
    n, m = num_nodes, replicas
    if strategy == "group":
        if n % m:
            raise PlacementError(
                f"group placement needs replicas to divide the number of nodes, but {n} nodes % {m} replicas "
                f"= {n % m}: use strategy 'mixed' (groups plus one ring) or 'ring' instead."
            )
        groups = [tuple(range(s, s + m)) for s in range(0, n, m)]
        rings: list[tuple[int, ...]] = []
    elif strategy == "ring":
        groups, rings = [], [tuple(range(n))]
    elif strategy == "mixed":
        head = (n // m - 1) * m
        groups = [tuple(range(s, s + m)) for s in range(0, head, m)]
        tail = tuple(range(head, n))
        # A ring of exactly m nodes (m divides N) is a group: each member holds every member's copy.
        rings = [tail] if len(tail) > m else []
        groups += [] if rings else [tail]
    else:
        raise PlacementError(f"strategy={strategy!r}: choose 'mixed' (default), 'group' or 'ring'.")

    holders: list[tuple[int, ...]] = [()] * n
    for g in groups:
        for i in g:
            holders[i] = g
    for ring in rings:
        size = len(ring)
        for p, i in enumerate(ring):
            holders[i] = tuple(sorted(ring[(p + t) % size] for t in range(m)))
    partition = tuple(sorted(groups + rings))
    return Placement(num_nodes=n, replicas=m, strategy=strategy, holders=tuple(holders), groups=partition)


def _check_sizes(num_nodes: int, replicas: int) -> None:
    for name, v in (("num_nodes", num_nodes), ("replicas", replicas)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlacementError(f"{name}={v!r}: give an int >= 1.")
    if replicas > num_nodes:
        raise PlacementError(
            f"replicas={replicas} > num_nodes={num_nodes}: replicas must be <= the number of nodes, "
            f"since each copy needs its own node; use at most {num_nodes}."
        )


# ---- recovery probability --------------------------------------------------------------------
def recovery_probability(placement: Placement, failures: int, *, domains: Sequence[str] | None = None) -> float:
    """Exact P(every checkpoint keeps a live copy) when ``failures`` distinct nodes, chosen
    uniformly at random, fail at once.

    With ``domains`` (``domains[i]``: node ``i``'s failure domain), ``failures`` whole domains,
    chosen uniformly at random among the distinct domains, fail at once (every node in them),
    counted by enumerating the ``C(D, k)`` domain sets.

    Placements built by :func:`place` (group, ring or mixed, or any placement whose
    :attr:`Placement.groups` are groups or rings of consecutive windows) are counted exactly
    with a closed-form count per group / ring, for any size. Other hand-built placements are
    counted by enumerating all ``C(N, k)`` failure sets, up to :data:`ENUMERATION_LIMIT`.

    ``failures == 0`` gives 1.0; ``failures >= N`` gives 0.0.

    Raises:
        PlacementError: ``failures`` is negative, or the placement has an unrecognised shape
            and too many failure sets to enumerate.
    """
    if domains is not None:
        return float(_domain_survival(placement, failures, domains))
    return float(_survival_fraction(placement, failures))


def _domain_survival(placement: Placement, failures: int, domains: Sequence[str]) -> Fraction:
    n, k = placement.num_nodes, failures
    if len(domains) != n:
        raise PlacementError(f"domains has {len(domains)} entries for {n} nodes: give one failure domain per node.")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise PlacementError(f"failures={k!r}: give the number of whole domains failing at once (an int >= 0).")
    names = sorted(set(domains))
    if k == 0:
        return Fraction(1)
    if k >= len(names):
        return Fraction(0)
    total = math.comb(len(names), k)
    if total > ENUMERATION_LIMIT:
        raise PlacementError(f"C({len(names)}, {k}) domain sets is more than {ENUMERATION_LIMIT} to enumerate.")
    masks = {sum(1 << h for h in hs) for hs in placement.holders}
    of = {d: sum(1 << i for i in range(n) if domains[i] == d) for d in names}
    ok = 0
    for failed in itertools.combinations(names, k):
        dead = sum(of[d] for d in failed)
        ok += all(mask & ~dead for mask in masks)
    return Fraction(ok, total)


def _survival_fraction(placement: Placement, failures: int, *, method: str = "auto") -> Fraction:
    """The survival probability as an exact fraction; ``method`` is "auto", "count" or "enumerate"."""
    n, k = placement.num_nodes, failures
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise PlacementError(f"failures={k!r}: give the number of simultaneous node failures (an int >= 0).")
    if k == 0:
        return Fraction(1)
    if k >= n:
        return Fraction(0)
    total = math.comb(n, k)
    components = _components(placement) if method in ("auto", "count") else None
    if components is not None:
        return Fraction(_count_by_components(components, k), total)
    if method == "count":
        raise PlacementError("this placement is not made of groups and rings; it cannot be counted in closed form.")
    if total > ENUMERATION_LIMIT:
        raise PlacementError(
            f"C({n}, {k}) = {total} failure sets is more than {ENUMERATION_LIMIT} to enumerate, and this "
            "placement is not made of groups and rings: build it with place() to get an exact count."
        )
    return Fraction(_count_by_enumeration(placement, k), total)


def _components(placement: Placement) -> list[tuple[int, int]] | None:
    """``(size, window)`` per group / ring when the placement has that shape, else None.

    A component is a cycle of ``size`` nodes in which each node's checkpoint is held by the
    ``window`` consecutive nodes starting at it; a group of ``g`` nodes is the cycle ``(g, g)``.
    """
    n = placement.num_nodes
    if sorted(i for g in placement.groups for i in g) != list(range(n)):
        return None
    out: list[tuple[int, int]] = []
    for cycle in placement.groups:
        size = len(cycle)
        window = len(placement.holders[cycle[0]])
        if window > size:
            return None
        for p, i in enumerate(cycle):
            if placement.holders[i] != tuple(sorted(cycle[(p + t) % size] for t in range(window))):
                return None
        out.append((size, window))
    return out


def _count_by_components(components: list[tuple[int, int]], k: int) -> int:
    """Failure sets of size ``k`` that leave every checkpoint a holder (product of generating functions)."""
    poly = [1]
    for size, window in components:
        part = [_cycle_count(size, window, j) for j in range(min(size, k) + 1)]
        merged = [0] * min(len(poly) + len(part) - 1, k + 1)
        for a, x in enumerate(poly):
            if x:
                for b, y in enumerate(part[: k + 1 - a]):
                    merged[a + b] += x * y
        poly = merged
    return poly[k] if k < len(poly) else 0


@functools.lru_cache(maxsize=4096)
def _cycle_count(size: int, window: int, j: int) -> int:
    """Sets of ``j`` failed nodes on a cycle of ``size`` with no ``window`` consecutive failures.

    With ``z = size - j`` survivors, the failures fall into the ``z`` cyclic gaps between
    survivors, each gap holding fewer than ``window``. Each such set, with one of its ``z``
    survivors marked, is one composition of ``j`` into ``z`` bounded parts together with one
    of ``size`` starting positions, hence ``size / z`` times the number of compositions.
    """
    z = size - j
    if z == 0:
        return 0  # every node failed, and window <= size
    return size * _bounded_compositions(j, z, window - 1) // z


def _bounded_compositions(total: int, parts: int, cap: int) -> int:
    """Ways to write ``total`` as an ordered sum of ``parts >= 1`` integers in ``0..cap``.

    Inclusion–exclusion: ``sum_i (-1)^i C(parts, i) C(total - i(cap+1) + parts - 1, parts - 1)``,
    with each binomial updated exactly from the previous one (``math.comb`` on large
    arguments is slow).
    """
    step, r = cap + 1, parts - 1
    top = total + r
    choose_parts, choose_top = 1, math.comb(top, r)  # C(parts, i), C(top, r)
    out = 0
    for i in range(min(parts, total // step) + 1):
        if i:
            choose_parts = choose_parts * (parts - i + 1) // i
            for _ in range(step):  # C(top - 1, r) = C(top, r) (top - r) / top
                choose_top = choose_top * (top - r) // top
                top -= 1
        out += (-1) ** i * choose_parts * choose_top
    return out


def _count_by_enumeration(placement: Placement, k: int) -> int:
    """Failure sets of size ``k`` that leave every checkpoint a holder, by brute force."""
    masks = {sum(1 << h for h in hs) for hs in placement.holders}
    ok = 0
    for failed in itertools.combinations(range(placement.num_nodes), k):
        dead = sum(1 << i for i in failed)
        ok += all(mask & ~dead for mask in masks)
    return ok


def group_formula(num_nodes: int, replicas: int, failures: int) -> float:
    """GEMINI's closed form for P(recover from CPU memory) under group placement.

    With ``N`` nodes in ``N/m`` groups of ``m`` and ``k`` simultaneous random failures:

    - ``k < m``: 1 (every group keeps a member);
    - ``k = m``: ``1 - (N/m)·C(N-m, k-m)/C(N, k)``, exact (only a whole group failing loses data);
    - ``k > m``: the same expression is a *lower bound* (a union bound over groups that counts
      failure sets killing several groups more than once), clamped at 0.

    Raises:
        PlacementError: invalid sizes, ``m`` not dividing ``N``, or ``k`` outside ``0..N``.
    """
    _check_sizes(num_nodes, replicas)
    n, m, k = num_nodes, replicas, failures
    if n % m:
        raise PlacementError(f"group placement needs replicas ({m}) to divide the number of nodes ({n}).")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= n:
        raise PlacementError(f"failures={k!r}: give an int in 0..{n}.")
    if k < m:
        return 1.0
    value = 1 - Fraction(n, m) * Fraction(math.comb(n - m, k - m), math.comb(n, k))
    return float(max(value, Fraction(0)))


# ---- node identities -> positions -------------------------------------------------------------
def assign_positions(previous: Sequence[str] | None, current: Sequence[str]) -> list[str]:
    """Order the current nodes into placement positions, stable for nodes that survive.

    Placement is decided from node identities, not ranks, so that a restart does not move
    the checkpoints of nodes that are still there.

    - ``previous`` is None (first save): ``sorted(current)``.
    - Same number of nodes: survivors keep their positions; newcomers fill the vacated
      positions in ascending order, in sorted order.
    - Different number: survivors keep their relative order, compacted to the front;
      newcomers are appended in sorted order.

    Raises:
        PlacementError: a node id appears twice in ``previous`` or in ``current``.
    """
    for name, ids in (("previous", previous), ("current", current)):
        dupes = sorted(x for x, c in Counter(ids or ()).items() if c > 1)
        if dupes:
            raise PlacementError(f"{name} node ids repeat {dupes}: give each node exactly once.")
    if previous is None:
        return sorted(current)
    present = set(current)
    newcomers = sorted(present - set(previous))
    if len(previous) != len(current):
        return [x for x in previous if x in present] + newcomers
    fill = iter(newcomers)
    return [x if x in present else next(fill) for x in previous]


# ---- failure domains ------------------------------------------------------------------------
def _greedy_spread(order: Sequence[str], domains: Mapping[str, str], window: int) -> list[str]:
    """:func:`spread_over_domains`' greedy order for one ``window`` (the rule is described there)."""
    buckets: dict[str, list[str]] = {}
    first: dict[str, int] = {}
    for i, node in enumerate(order):
        d = domains.get(node, "") or ""
        buckets.setdefault(d, []).append(node)
        first.setdefault(d, i)
    if len(buckets) <= 1:
        return list(order)
    rank = {d: r for r, d in enumerate(sorted(buckets, key=lambda d: (-len(buckets[d]), first[d])))}
    left = {d: len(b) for d, b in buckets.items()}
    taken = dict.fromkeys(buckets, 0)
    recent: list[str] = []
    out: list[str] = []
    w = max(1, int(window))
    for _ in range(len(order)):
        for span in range(w - 1, -1, -1):
            avoid = set(recent[-span:]) if span else set()
            cands = [d for d in buckets if left[d] and d not in avoid]
            if cands:
                break
        d = min(cands, key=lambda x: (-left[x], rank[x]))
        out.append(buckets[d][taken[d]])
        taken[d] += 1
        left[d] -= 1
        recent.append(d)
    return out


def spread_over_domains(
    order: Sequence[str], domains: Mapping[str, str], window: int = 2,
    sets: Sequence[Sequence[int]] | None = None, lost_at: int | None = None,
) -> list[str]:
    """``order`` (nodes by position) reordered so that every ``window`` consecutive positions (a node's
    ``m`` copies in a group or ring window: ``window=m``; a parity group: its size) hold distinct failure
    domains where the domains allow it.

    Greedy: each position takes the domain with the most nodes left among those not used in the last
    ``window - 1`` positions (relaxing to fewer when none is left), ties to the larger domain, then to the
    one whose first node comes first in ``order``; a domain's nodes keep their relative order. A node
    missing from ``domains`` (or mapped to ``""``) counts as one unnamed domain. With a single domain the
    order is returned unchanged.

    ``sets`` (by position: each node's holders, or each parity group) with ``lost_at`` (how many members
    of a set one domain must hold to lose it: ``len`` of the set for copies, 2 for a parity group; None:
    all of them): the greedy order of ``window`` and that of ``window=2`` (plain alternation, which spends
    the smaller domains more slowly: racks of 6, 3 and 3 with 3 copies in groups) are both built, and the
    one leaving fewer sets lost to a single domain is taken (``window``'s on a tie). Either way the result
    is idempotent (both orders depend only on the domains' sizes, their first appearance and each
    domain's own order, which both keep), so the positions a restart hands back
    (:func:`assign_positions`) stay where they were, and a node replaced by one of the same domain takes
    its place.
    """
    first = _greedy_spread(order, domains, window)
    if sets is None or window <= 2:
        return first
    second = _greedy_spread(order, domains, 2)
    return second if _lost_sets(second, domains, sets, lost_at) < _lost_sets(first, domains, sets, lost_at) else first


def _lost_sets(order: Sequence[str], domains: Mapping[str, str], sets: Sequence[Sequence[int]],
               lost_at: int | None) -> int:
    """How many of ``sets`` (positions) some single domain holds ``lost_at`` (default: all) members of."""
    lost = 0
    for members in sets:
        counts = Counter(domains.get(order[i], "") or "" for i in members)
        need = len(members) if lost_at is None else lost_at
        lost += max(counts.values(), default=0) >= need
    return lost


def place_over_domains(domains: Sequence[str], replicas: int, strategy: Strategy = "mixed", *,
                       spread: bool = True) -> Placement:
    """:func:`place` for nodes ``0 … N-1`` whose failure domains are ``domains`` (node ``i``: ``domains[i]``),
    in node numbers: positions follow :func:`spread_over_domains` of the node order (``spread=False``:
    positions are the node numbers, domain-blind, as a job without domains places them)."""
    n = len(domains)
    base = place(n, replicas, strategy)
    ids = [str(i) for i in range(n)]
    order = ([int(x) for x in spread_over_domains(ids, dict(zip(ids, domains)), replicas, base.holders)]
             if spread else list(range(n)))
    holders = [()] * n  # type: list[tuple[int, ...]]
    for pos, hs in enumerate(base.holders):
        holders[order[pos]] = tuple(sorted(order[h] for h in hs))
    groups = tuple(sorted(tuple(order[p] for p in g) for g in base.groups))
    return Placement(num_nodes=n, replicas=base.replicas, strategy=strategy, holders=tuple(holders), groups=groups)


def shared_domains(placement: Placement, domains: Sequence[str]) -> dict[int, list[str]]:
    """Nodes whose copies share a failure domain: ``{node: [domain, ...]}`` (the domains holding two or more
    of its ``m`` copies), empty when every node's copies lie in distinct domains."""
    out: dict[int, list[str]] = {}
    for node, hs in enumerate(placement.holders):
        counts = Counter(domains[h] for h in hs)
        twice = sorted(d for d, c in counts.items() if c > 1)
        if twice:
            out[node] = twice
    return out
