"""The commit gather decodes what other ranks send without running it (commit/exchange.py).

Two real gloo ranks: a frame naming a callable outside the report allow-list is refused on
every rank with UntrustedDataError (the callable never runs), an announced length beyond
MAX_REPORT_BYTES is refused before anything is allocated, and real reports still decode.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
from mp_utils import run_ranks

MARKER_ENV = "GEMINI_TEST_EXCHANGE_MARKER"


class _Planted:
    """Pickles as a call of os.system: what a foreign process on the control group could send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _planted_frame(rank: int, world: int, root: str, marker: str) -> str:
    from gemini_dcp.commit.exchange import gather_objects
    from gemini_dcp.errors import UntrustedDataError
    from gemini_dcp.transport.comm import get_comm

    sent: Any = _Planted(marker) if rank == 1 else {"rank": rank}
    try:
        gather_objects(get_comm(60.0), sent)
    except UntrustedDataError as exc:
        return str(exc)
    return "decoded"


def _oversized_length(rank: int, world: int, root: str) -> tuple[str, list[int]]:
    import gemini_dcp.commit.exchange as ex
    from gemini_dcp.errors import UntrustedDataError
    from gemini_dcp.transport.comm import get_comm

    ex.MAX_REPORT_BYTES = ex.frame_bytes(world) * 2  # a "huge" announcement, cheap to send for real
    comm = get_comm(60.0)
    try:
        ex.gather_objects(comm, os.urandom(ex.MAX_REPORT_BYTES + 10) if rank == 0 else b"small")
        first = "decoded"
    except UntrustedDataError as exc:
        first = str(exc)
    # The group is still usable, and plain data of the same size limit decodes.
    again = ex.gather_objects(comm, {"rank": rank})
    return first, [g["rank"] for g in again]


@pytest.mark.timeout(120)
def test_planted_global_in_a_frame_is_refused_on_every_rank_and_never_runs() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "ran")
        out = run_ranks(_planted_frame, 2, tmp, timeout=90, marker=marker)
        assert not os.path.exists(marker), "the planted callable ran"
        for msg in out:
            assert "posix.system" in msg or "os.system" in msg, msg
            assert "group rank 1" in msg, msg


@pytest.mark.timeout(120)
def test_announced_length_over_the_bound_is_refused_before_allocation() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_oversized_length, 2, tmp, timeout=90)
        for first, ranks in out:
            assert "announced" in first and "group ranks [0]" in first, first
            assert ranks == [0, 1]
