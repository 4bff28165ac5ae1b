"""The restore decision as a pure function over node views (no processes needed)."""

from __future__ import annotations

import pickle

import pytest

from gemini_dcp.core.restore_order import NodeView, StepView, decide, unrestorable_error
from gemini_dcp.errors import ShardUnavailableError


def _view(rank: int, node: str, held: tuple[int, ...], world: int = 4, step: int = 7, complete: bool = True) -> NodeView:
    return NodeView(rank, node, (StepView(step, "fp", world, held, 1.0, complete),))


def test_newest_step_held_by_the_union_of_nodes() -> None:
    views = [_view(0, "a", (0, 1)), _view(1, "a", (0, 1)), _view(2, "b", (2, 3)), _view(3, "b", (2, 3))]
    d = decide(views, None, "j")
    assert d.step == 7 and d.record_src == 0 and not d.missing_ranks
    assert d.holders == {0: ("a",), 1: ("a",), 2: ("b",), 3: ("b",)}


def test_unrestorable_step_names_lost_nodes_once_details_are_fetched() -> None:
    views = [_view(0, "a", (0, 1)), _view(1, "a", (0, 1))]  # node b (ranks 2, 3) is gone
    with pytest.raises(ShardUnavailableError) as info:
        decide(views, None, "j")
    problems = info.value.problems  # type: ignore[attr-defined]
    assert [(p.step, p.fingerprint, p.src, p.missing) for p in problems] == [(7, "fp", 0, (2, 3))]
    assert "saving ranks [2, 3]" in str(info.value)
    details = {(7, "fp"): (("a", "a", "b", "b"), (1 << 30, 1 << 30, 1 << 29, 1 << 29))}
    msg = str(unrestorable_error("j", problems, False, details))
    assert "saving ranks [2, 3] (1.000 GiB, saved on nodes ['b']) are held by no surviving node" in msg
    assert "configure persistent=<url>" in msg


def test_a_view_does_not_grow_with_the_world_size() -> None:
    """Every rank receives every rank's view: O(world) each, not O(world²) in all."""
    small = len(pickle.dumps(_view(0, "node-0", tuple(range(8)), world=16)))
    large = len(pickle.dumps(_view(0, "node-0", tuple(range(8)), world=1024)))
    assert large - small < 8 and large < 1024


def test_a_node_with_an_incomplete_record_still_holds_its_bytes() -> None:
    """A planner that hides its metadata: only the coordinator's node (a) has a complete record.
    Node b's record has the same fingerprint, so b holds ranks 2 and 3; a broadcasts the record."""
    views = [_view(0, "a", (0, 1)), _view(1, "a", (0, 1)), _view(2, "b", (2, 3), complete=False), _view(3, "b", (2, 3), complete=False)]
    d = decide(views, None, "j")
    assert d.step == 7 and not d.missing_ranks and d.holders[2] == ("b",)
    assert d.record_src == 0  # a holder of the complete record, never rank 2
    views = [_view(0, "b", (2, 3), complete=False), _view(1, "a", (0, 1))]
    assert decide(views, None, "j").record_src == 1


def test_only_incomplete_records_left_names_the_missing_metadata() -> None:
    views = [_view(0, "b", (0, 1, 2, 3), complete=False), _view(1, "b", (0, 1, 2, 3), complete=False)]
    with pytest.raises(ShardUnavailableError, match=r"steps \[7\] are held in memory, but no surviving node has a complete record"):
        decide(views, None, "j")
