"""gemini_dcp.peer.placement: placement shapes, exact recovery probabilities, stable positions (pure, fast)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from gemini_dcp.errors import GeminiError
from gemini_dcp.peer.placement import (
    Placement,
    PlacementError,
    _survival_fraction,
    assign_positions,
    group_formula,
    place,
    recovery_probability,
)

SIZES = [(n, m) for n in range(1, 13) for m in range(1, n + 1)]
CASES = [(n, m, s) for n, m in SIZES for s in ("mixed", "group", "ring") if s != "group" or n % m == 0]


# ---- shapes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "m", "strategy"), CASES)
def test_invariants(n: int, m: int, strategy: str) -> None:
    pl = place(n, m, strategy)  # type: ignore[arg-type]
    assert (pl.num_nodes, pl.replicas, pl.strategy) == (n, m, strategy)
    assert sorted(i for g in pl.groups for i in g) == list(range(n))
    for i, hs in enumerate(pl.holders):
        assert i in hs and len(hs) == m and list(hs) == sorted(set(hs))
        assert pl.peers_of(i) == tuple(h for h in hs if h != i)
    # Every node stores exactly m checkpoints (load is balanced), and stored_on inverts holders.
    for j in range(n):
        assert len(pl.stored_on(j)) == m
        assert all(j in pl.holders[i] for i in pl.stored_on(j))


def test_group() -> None:
    pl = place(6, 2, "group")
    assert pl.groups == ((0, 1), (2, 3), (4, 5))
    assert pl.holders == ((0, 1), (0, 1), (2, 3), (2, 3), (4, 5), (4, 5))
    assert place(6, 3, "group").holders[4] == (3, 4, 5)


def test_group_needs_divisor() -> None:
    with pytest.raises(PlacementError, match="mixed.*ring"):
        place(5, 2, "group")


def test_ring() -> None:
    pl = place(5, 3, "ring")
    assert pl.groups == ((0, 1, 2, 3, 4),)
    assert pl.holders[0] == (0, 1, 2)
    assert pl.holders[4] == (0, 1, 4)  # 4 -> 0, 1
    assert pl.peers_of(3) == (0, 4)
    assert pl.stored_on(0) == (0, 3, 4)


def test_mixed_paper_example() -> None:
    pl = place(5, 2)
    assert pl.strategy == "mixed"
    assert pl.groups == ((0, 1), (2, 3, 4))
    assert pl.holders == ((0, 1), (0, 1), (2, 3), (3, 4), (2, 4))  # ring 2 -> 3 -> 4 -> 2


def test_mixed_small_is_ring() -> None:
    assert place(3, 2).holders == place(3, 2, "ring").holders


@pytest.mark.parametrize(("n", "m"), [(n, m) for n, m in SIZES if n % m == 0])
def test_mixed_equals_group_when_divisible(n: int, m: int) -> None:
    assert place(n, m, "mixed").holders == place(n, m, "group").holders
    assert place(n, m, "mixed").groups == place(n, m, "group").groups


@pytest.mark.parametrize("strategy", ["mixed", "group", "ring"])
def test_single_replica(strategy: str) -> None:
    pl = place(4, 1, strategy)  # type: ignore[arg-type]
    assert pl.holders == ((0,), (1,), (2,), (3,))
    assert all(pl.peers_of(i) == () for i in range(4))


@pytest.mark.parametrize(
    ("n", "m", "strategy", "match"),
    [(0, 1, "mixed", "num_nodes"), (3, 0, "ring", "replicas"), (2, 3, "mixed", "replicas must be <="),
     (4, 2, "star", "choose"), (True, 1, "mixed", "num_nodes")],
)
def test_bad_arguments(n: int, m: int, strategy: str, match: str) -> None:
    with pytest.raises(PlacementError, match=match) as info:
        place(n, m, strategy)  # type: ignore[arg-type]
    assert isinstance(info.value, GeminiError)


def test_accessors_and_table() -> None:
    pl = place(5, 2)
    rows = pl.table()
    assert rows[3] == {"node": 3, "holders": [3, 4], "peers": [4], "stores": [2, 3], "group": 1}
    assert [r["group"] for r in rows] == [0, 0, 1, 1, 1]
    with pytest.raises(PlacementError, match="out of range"):
        pl.peers_of(5)
    with pytest.raises(PlacementError, match="include the node itself"):
        Placement(num_nodes=2, replicas=1, strategy="ring", holders=((1,), (1,)), groups=((0, 1),))


# ---- recovery probability -----------------------------------------------------------------------
def test_paper_figure() -> None:
    assert round(group_formula(16, 2, 2), 4) == 0.9333
    assert round(recovery_probability(place(16, 2, "group"), 2), 4) == 0.9333


@pytest.mark.parametrize(("n", "m", "strategy"), CASES)
def test_count_matches_enumeration(n: int, m: int, strategy: str) -> None:
    pl = place(n, m, strategy)  # type: ignore[arg-type]
    for k in range(n + 2):
        exact = _survival_fraction(pl, k, method="enumerate")
        assert _survival_fraction(pl, k, method="count") == exact
        assert recovery_probability(pl, k) == float(exact)


@pytest.mark.parametrize(("n", "m"), SIZES)
def test_edges(n: int, m: int) -> None:
    pl = place(n, m, "ring")
    assert recovery_probability(pl, 0) == 1.0
    assert recovery_probability(pl, n) == 0.0
    assert recovery_probability(pl, n + 3) == 0.0
    for k in range(1, min(m, n)):
        assert recovery_probability(pl, k) == 1.0  # fewer failures than copies: always recoverable


@pytest.mark.parametrize(("n", "m"), [(n, m) for n in range(1, 41) for m in range(1, min(n, 8) + 1) if n % m == 0])
def test_group_formula(n: int, m: int) -> None:
    pl = place(n, m, "group")
    for k in range(n + 1):
        p, bound = recovery_probability(pl, k), group_formula(n, m, k)
        if k < m:
            assert p == bound == 1.0
        elif k == m:
            assert p == bound
        else:
            assert p >= bound


def test_group_formula_errors() -> None:
    with pytest.raises(PlacementError, match="divide"):
        group_formula(5, 2, 2)
    with pytest.raises(PlacementError, match="failures"):
        group_formula(4, 2, 5)


def test_large_placements_are_exact_and_fast() -> None:
    # C(1000, 10) is far beyond enumeration; counting is exact.
    pl = place(1000, 2, "group")
    k = 10
    # Survive iff no group of 2 fully fails: choose k groups, one member each (2^k ways).
    assert _survival_fraction(pl, k) == Fraction(math.comb(500, k) * 2**k, math.comb(1000, k))
    ring = place(1001, 3)
    for k in (3, 50, 400, 1000):
        p = recovery_probability(ring, k)
        assert 0.0 <= p <= 1.0
    assert recovery_probability(ring, 2) == 1.0
    assert recovery_probability(place(997, 2, "ring"), 600) == 0.0  # pigeonhole: two adjacent failures


def test_mixed_beats_ring() -> None:
    # At k = m only a whole window of m holders loses data: mixed has fewer distinct windows than ring.
    for n in range(2, 40):
        for m in range(2, n // 2 + 1):
            mixed, ring = recovery_probability(place(n, m), m), recovery_probability(place(n, m, "ring"), m)
            assert mixed > ring


def test_hand_built_placement_is_enumerated() -> None:
    # Not groups/rings: node 0's copy is on 2, node 1's on 0, node 2's on 1, node 3's on 1.
    holders = ((0, 2), (0, 1), (1, 2), (1, 3))
    pl = Placement(num_nodes=4, replicas=2, strategy="custom", holders=holders, groups=())
    # Pairs that lose data: {0,2}, {0,1}, {1,2}, {1,3} -> 2 of 6 survive.
    assert recovery_probability(pl, 2) == pytest.approx(2 / 6)
    with pytest.raises(PlacementError, match="failures"):
        recovery_probability(pl, -1)


# ---- positions ------------------------------------------------------------------------------------
def test_first_assignment_is_sorted() -> None:
    assert assign_positions(None, ["c", "a", "b"]) == ["a", "b", "c"]


def test_same_nodes_keep_positions() -> None:
    prev = ["n3", "n1", "n2"]
    assert assign_positions(prev, ["n1", "n2", "n3"]) == prev


def test_replacements_fill_vacated_positions() -> None:
    prev = ["a", "b", "c", "d"]
    assert assign_positions(prev, ["d", "x", "a", "w"]) == ["a", "w", "x", "d"]


def test_size_change_compacts_and_appends() -> None:
    prev = ["d", "a", "c", "b"]
    assert assign_positions(prev, ["b", "d", "c"]) == ["d", "c", "b"]
    assert assign_positions(prev, ["b", "z", "d", "c", "a", "y"]) == ["d", "a", "c", "b", "y", "z"]
    assert assign_positions(prev, ["q", "d"]) == ["d", "q"]


def test_duplicates_rejected() -> None:
    with pytest.raises(PlacementError, match="repeat"):
        assign_positions(None, ["a", "a"])
    with pytest.raises(PlacementError, match="previous"):
        assign_positions(["a", "b", "a"], ["a"])


def test_stability_properties_random() -> None:
    rng = random.Random(7)
    universe = [f"node-{i:02d}" for i in range(30)]
    order = assign_positions(None, rng.sample(universe, 8))
    for _ in range(300):
        survivors = rng.sample(order, rng.randint(0, len(order)))
        fresh = rng.sample([u for u in universe if u not in order], rng.randint(0, 4))
        current = survivors + fresh
        rng.shuffle(current)
        new = assign_positions(order, current)
        assert sorted(new) == sorted(current)
        assert assign_positions(new, list(reversed(current))) == new  # idempotent, input order irrelevant
        if len(current) == len(order):
            assert all(new[i] == x for i, x in enumerate(order) if x in survivors)
        else:
            kept = [x for x in order if x in survivors]
            assert new[: len(kept)] == kept
            assert new[len(kept):] == sorted(fresh)
        order = new
