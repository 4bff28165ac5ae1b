"""The control group's messages decode without running code (transport/comm.py, transport/wire.py, and
the commit gather, commit/exchange.py).

Two real gloo ranks on gemini_dcp's control group: a message whose pickle names ``os.system`` is refused
on every rank that decodes it (gather, broadcast, the recovering gather, the commit gather) and never runs;
an announced length over ``wire.MAX_OBJECT_BYTES`` / ``exchange.MAX_REPORT_BYTES`` is refused before
anything is allocated, and the group stays usable; real control messages (peer slots, views, tallies,
plain reports) still decode, in group rank order.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
from mp_utils import run_ranks


class _Planted:
    """Pickles as a call of os.system: what a foreign process on the control group could send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _refused(fn: Any) -> str:
    from gemini_dcp.errors import UntrustedDataError

    try:
        fn()
    except UntrustedDataError as exc:
        return str(exc)
    return "decoded"


def _ranks(rank: int, world: int, root: str, marker: str) -> dict[str, Any]:
    from gemini_dcp.core.restore_order import NodeView, StepView
    from gemini_dcp.local.record_types import RankSlot
    from gemini_dcp.peer.fetch import Tally
    from gemini_dcp.transport import wire
    from gemini_dcp.transport.comm import get_comm

    comm = get_comm(60.0)
    planted = _Planted(marker)
    out: dict[str, Any] = {}
    out["gather"] = _refused(lambda: comm.all_gather_object(planted if rank == 1 else rank))
    out["broadcast"] = _refused(lambda: comm.broadcast_object(planted if rank == 1 else None, src=1))
    out["try_gather"] = _refused(lambda: comm.try_all_gather_object(planted if rank == 0 else rank))
    # The commit gather (fixed frames, a second round for a long report): the same refusals.
    import gemini_dcp.commit.exchange as ex

    out["commit_gather"] = _refused(lambda: ex.gather_objects(comm, planted if rank == 1 else {"rank": rank}))
    saved, ex.MAX_REPORT_BYTES = ex.MAX_REPORT_BYTES, ex.frame_bytes(world) * 2
    out["commit_long"] = _refused(lambda: ex.gather_objects(comm, os.urandom(ex.MAX_REPORT_BYTES + 10) if rank == 0 else b""))
    ex.MAX_REPORT_BYTES = saved
    out["commit_real"] = [g["rank"] for g in ex.gather_objects(comm, {"rank": rank})]
    wire.MAX_OBJECT_BYTES = 4096  # a "huge" announcement, cheap to send for real
    out["long"] = _refused(lambda: comm.all_gather_object(os.urandom(8192) if rank == 0 else b"x"))
    wire.MAX_OBJECT_BYTES = 1 << 30
    view = NodeView(rank, f"node{rank}", (StepView(step=3, fingerprint="f", world_size=world, held_ranks=(rank,),
                                                   created_unix=1.0, complete=True, parity_lanes=()),))
    msg = (view, RankSlot(rank, 1, 10), Tally([], [], {"local": rank}, True))
    got = comm.all_gather_object(msg)
    out["real"] = [g == (NodeView(r, f"node{r}", g[0].steps), RankSlot(r, 1, 10), Tally([], [], {"local": r}, True))
                   for r, g in enumerate(got)]
    out["bcast_real"] = comm.broadcast_object(msg if rank == 0 else None, src=0) == msg if rank == 0 else \
        comm.broadcast_object(None, src=0)[1] == RankSlot(0, 1, 10)
    return out


@pytest.mark.timeout(120)
def test_control_messages_never_run_code_and_real_ones_decode() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "ran")
        out = run_ranks(_ranks, 2, tmp, timeout=90, marker=marker)
        assert not os.path.exists(marker), "a planted control message ran"
    for rank, res in enumerate(out):
        assert "system" in res["gather"] and "group rank 1" in res["gather"], res
        if rank == 0:
            assert "system" in res["broadcast"], res  # rank 1 sent it: it holds its own object
        assert "system" in res["try_gather"] and "group rank 0" in res["try_gather"], res
        assert "group ranks [0] announced" in res["long"], res
        assert res["real"] == [True, True] and res["bcast_real"], res
        assert "system" in res["commit_gather"] and "group rank 1" in res["commit_gather"], res
        assert "group ranks [0] announced" in res["commit_long"] and res["commit_real"] == [0, 1], res
