"""Issue 22: XOR parity over node groups, the pure arithmetic (no processes)."""

from __future__ import annotations

import pickle

import pytest
import torch

from gemini_dcp.core.restore_order import NodeView, StepView, decide, parity_rebuild
from gemini_dcp.core.safe_pickle import restricted_loads
from gemini_dcp.errors import ConfigError, ShardUnavailableError
from gemini_dcp.local.parity_record import ParityLayout
from gemini_dcp.peer.parity_groups import (
    check_parity_group,
    encode_transfers,
    parity_groups,
    parity_lanes,
    parity_length,
    rebuild_transfers,
    sigma,
)


def test_groups_merge_the_remainder_into_the_last_group() -> None:
    nodes = [f"n{i}" for i in range(10)]
    assert parity_groups(nodes, 4) == [tuple(nodes[:4]), tuple(nodes[4:])]  # 4 + 6: no group under g
    assert parity_groups(nodes[:8], 4) == [tuple(nodes[:4]), tuple(nodes[4:8])]
    assert parity_groups(nodes[:2], 4) == [tuple(nodes[:2])]  # fewer nodes than g: one group of all


def test_lanes_take_the_lth_rank_of_each_node() -> None:
    rank_nodes = ["a", "a", "b", "b", "c", "c"]
    assert parity_lanes(["a", "b", "c"], rank_nodes, 3) == [(0, 2, 4), (1, 3, 5)]
    # node c holds two ranks: lane 1 would be rank 3 alone; it takes rank 1 (node b) from lane 0
    assert parity_lanes(["a", "b", "c"], ["a", "b", "c", "c"], 3) == [(0, 2), (1, 3)]
    # the soak's layout (4 ranks on 3 nodes, two on the first): every rank protected
    assert parity_lanes(["n0", "n1", "n2"], ["n0", "n0", "n1", "n2"], 3) == [(0, 2), (1, 3)]
    # one node holds more ranks than the others together: its extra rank cannot be protected
    assert parity_lanes(["a", "b", "c"], ["a", "a", "a", "b", "c"], 3) == [(0, 3), (1, 4)]


def test_every_rank_is_protected_where_the_layout_allows_it() -> None:
    import itertools
    import random
    rng = random.Random(7)
    for _ in range(2000):
        nodes = [f"n{i}" for i in range(rng.randint(2, 7))]
        rank_nodes = [rng.choice(nodes) for _ in range(rng.randint(2, 14))]
        g = rng.randint(3, 5)
        lanes = parity_lanes(nodes, rank_nodes, g)
        seen = list(itertools.chain.from_iterable(lanes))
        assert len(seen) == len(set(seen))  # a rank is in one lane at most
        for lane in lanes:
            assert len(lane) >= 2
            assert len({rank_nodes[r] for r in lane}) == len(lane)  # members on distinct nodes
        for group in parity_groups([n for n in nodes if n in rank_nodes], g):
            counts = sorted((rank_nodes.count(n) for n in group), reverse=True)
            members = [r for r, n in enumerate(rank_nodes) if n in group]
            unprotected = [r for r in members if r not in seen]
            if counts[0] <= sum(counts[1:]) and len(counts) >= 2:
                # at most one lane per depth level can be lone; the donors cover it when the
                # biggest node holds no more ranks than the others together
                assert len(unprotected) <= max(0, counts[0] - sum(counts[1:]))


def test_every_member_sends_each_stripe_to_one_other_member() -> None:
    n = 4
    for i in range(n):
        assert sorted(sigma(i, k, n) for k in range(n) if k != i) == list(range(n - 1))


@pytest.mark.parametrize("nbytes", [[1000, 1000, 1000, 1000], [1000, 3, 777, 0], [64, 128, 4096]])
def test_xor_encode_then_rebuild_each_lost_member_bit_exact(nbytes: list[int]) -> None:
    lane = list(range(len(nbytes)))
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in nbytes]
    stripe, transfers = encode_transfers(lane, nbytes)
    plens = [parity_length(k, nbytes, stripe) for k in lane]
    parity = [torch.zeros(p, dtype=torch.uint8) for p in plens]
    for t in transfers:
        parity[t.dst][: t.length].bitwise_xor_(data[t.src][t.offset : t.offset + t.length])
    assert sum(plens) <= sum(nbytes) + 64 * len(lane)  # ~1/(n-1) of each member's bytes
    for lost in lane:
        out = torch.zeros(nbytes[lost], dtype=torch.uint8)
        for t in rebuild_transfers(lane, nbytes, plens, stripe, lost, {r: r for r in lane}, lost):
            src = parity[t.member][: t.length] if t.kind == "parity" else data[t.member][t.offset : t.offset + t.length]
            out[t.into : t.into + t.length].bitwise_xor_(src)
        assert torch.equal(out, data[lost]), lost


def test_parity_group_validation_says_what_to_change() -> None:
    assert check_parity_group(None, 2) is None and check_parity_group(4, 1) == 4
    with pytest.raises(ConfigError, match="int >= 3"):
        check_parity_group(2, 1)
    with pytest.raises(ConfigError, match="replicas=1"):
        check_parity_group(4, 2)


def test_layout_round_trips_through_the_restricted_unpickler() -> None:
    layout = ParityLayout(group=3, groups=(("a", "b", "c"),), lanes=((0, 1, 2),), stripes=(64,),
                          parity_nbytes=(64, 64, 3), checksums=(1, 2, 3), algo="xxh3")
    assert restricted_loads(pickle.dumps(layout), source="test") == layout


def _view(rank: int, node: str, held: tuple[int, ...], lanes: tuple[tuple[int, ...], ...]) -> NodeView:
    sv = StepView(step=5, fingerprint="f", world_size=4, held_ranks=held, created_unix=1.0, complete=True,
                  parity_lanes=lanes)
    return NodeView(rank, node, (sv,) if held else ())


def test_decide_rebuilds_one_lost_member_per_lane_and_refuses_two() -> None:
    lane = ((0, 1, 2, 3),)
    views = [_view(0, "a", (0,), lane), _view(1, "b", (1,), lane), _view(2, "c2", (), ()), _view(3, "d", (3,), lane)]
    d = decide(views, None, "job")
    assert d.rebuilt == {2: 2} and d.holders[2] == ("c2",) and not d.use_persistent
    views[1] = _view(1, "b2", (), ())
    with pytest.raises(ShardUnavailableError, match=r"parity group of saving ranks \[0, 1, 2, 3\] lost ranks \[1, 2\]"):
        decide(views, None, "job")
    d = decide(views, None, "job", persistent_steps=[5])
    assert d.use_persistent and set(d.missing_ranks) == {1, 2} and not d.rebuilt
    assert parity_rebuild([3], [(0, 1, 2, 3)], [0, 1, 2]) == ({3: 0}, ())  # no current rank 3: the lowest rebuilds


@pytest.mark.parametrize(("nodes", "g"), [(16, 4), (10, 4), (7, 3), (5, 3)])
def test_plan_probability_is_exact_against_enumeration(nodes: int, g: int) -> None:
    from itertools import combinations

    from gemini_dcp.ops.parity_plan import parity_recovery_probability

    groups = parity_groups([str(i) for i in range(nodes)], g)
    group_of = {int(n): i for i, grp in enumerate(groups) for n in grp}
    for k in range(1, 5):
        sets = list(combinations(range(nodes), k))
        ok = sum(len({group_of[n] for n in s}) == k for s in sets)
        assert parity_recovery_probability(nodes, g, k) == pytest.approx(ok / len(sets))


def test_plan_cli_shows_parity_beside_replicas() -> None:
    from typer.testing import CliRunner

    from gemini_dcp_cli.main import app

    res = CliRunner().invoke(app, ["plan", "--nodes", "16", "--strategy", "parity", "--group", "4", "--json"])
    assert res.exit_code == 0, res.output
    import json

    out = json.loads(res.output)
    assert out["recovery"][1]["p_recover"] == pytest.approx(0.8)  # 4 groups of 4: 96 of C(16, 2) = 120 pairs
    assert out["memory_per_node"] == pytest.approx(3 * 4 / 3) and out["memory_per_node_replicas"] == 6
    assert out["sent_per_node_per_save"] == out["sent_per_node_per_save_replicas"] == 1.0


def test_restored_from_names_parity_only_when_used() -> None:
    from gemini_dcp.restore.parity_restore import tier_bytes

    plain = tier_bytes({"local": 5, "peer": 0, "persistent": 0, "parity": 0})
    assert plain == {"local": 5, "peer": 0, "persistent": 0} and plain["parity"] == 0
    assert tier_bytes({"local": 5, "peer": 0, "persistent": 0, "parity": 7})["parity"] == 7
