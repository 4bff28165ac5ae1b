"""The transport seam (gemini_dcp.transport.p2p) with three real gloo processes.

One spawned group of three ranks runs every scenario (spawning is most of the cost):
slot ranges cut into wire messages arrive bit-exact, unpaced and paced (one pacer
call per message); single buffers too; the integer all-reduce by MIN/MAX/SUM; a
receive whose send never comes ends by its deadline in PeerError, or with
``fatal=True`` in RestartRequiredError with the control plane marked broken.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from mp_utils import run_ranks

from gemini_dcp.transport.comm import Comm
from gemini_dcp.transport.p2p import GlooTransport, messages, transport_for

NBYTES = (1 << 20) + 3  # not a multiple of the message size: the last message is short
WIRE_CHUNK = 64 << 10
SHORT_TIMEOUT_S = 1.5
DEADLINE_S = 1.0


def _payload(seed: int, n: int = NBYTES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _scenario(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from gemini_dcp.errors import PeerError, RestartRequiredError
    from gemini_dcp.transport.comm import broken_reason
    from gemini_dcp.transport.p2p import get_transport

    out: dict[str, Any] = {}
    t = get_transport(30.0)
    # Two more control groups (collective to make): one for the deadline, one for the fatal wait.
    short = get_transport(SHORT_TIMEOUT_S)
    fatal = get_transport(SHORT_TIMEOUT_S + 0.25)

    # ---- ranges, unpaced to ranks 1 and 2, then paced to rank 1 only -------------------------------
    src = _payload(7)
    if rank == 0:
        paced: list[int] = []
        works = t.send_ranges(lambda o, n: src[o : o + n], NBYTES, WIRE_CHUNK, [1, 2], "unpaced send")
        out["paced_returned"] = t.send_ranges(
            lambda o, n: src[o : o + n], NBYTES, WIRE_CHUNK, [1], "paced send", pace=paced.append, deadline_s=30.0
        )
        for w in works:
            t.wait(w, deadline_s=30.0)
        out["unpaced_posted"] = len(works)
        out["pace_calls"] = paced
        got = torch.zeros(5, dtype=torch.uint8)
        t.wait(t.post_recv(got, 2, "single receive"))
        out["single_ok"] = bool(torch.equal(got, _payload(9, 5)))
    else:
        dst = torch.zeros(NBYTES, dtype=torch.uint8)
        works = t.recv_ranges(lambda o, n: dst[o : o + n], NBYTES, WIRE_CHUNK, 0, "unpaced receive")
        dst2 = torch.zeros(NBYTES, dtype=torch.uint8)
        if rank == 1:  # posted before the sender's paced sends wait
            works += t.recv_ranges(lambda o, n: dst2[o : o + n], NBYTES, WIRE_CHUNK, 0, "paced receive")
        for w in works:
            t.wait(w, deadline_s=30.0)
        out["unpaced_ok"] = bool(torch.equal(dst, src))
        if rank == 1:
            out["paced_ok"] = bool(torch.equal(dst2, src))
        if rank == 2:
            t.wait(t.post_send(_payload(9, 5), 0, "single send"), deadline_s=30.0)

    # ---- the integer all-reduce ----------------------------------------------------------------------
    vals = [rank, -rank, 10 * rank + 1]
    out["reduced"] = {op: t.all_reduce_ints(vals, op) for op in ("min", "max", "sum")}

    # ---- a receive whose send never comes ---------------------------------------------------------------
    if rank == 1:
        buf = torch.zeros(16, dtype=torch.uint8)
        p = short.post_recv(buf, 2, "receive that never completes")
        t0 = time.monotonic()
        try:
            short.wait(p, deadline_s=DEADLINE_S)
            out["deadline"] = ("returned", "", time.monotonic() - t0, None)
        except PeerError as exc:
            out["deadline"] = (type(exc).__name__, str(exc), time.monotonic() - t0, broken_reason())
        p = fatal.post_recv(buf, 2, "fatal receive that never completes")
        t0 = time.monotonic()
        try:
            fatal.wait(p, fatal=True)  # no deadline: the group's own timeout bounds it
            out["fatal"] = ("returned", "", time.monotonic() - t0, None)
        except RestartRequiredError as exc:
            out["fatal"] = (type(exc).__name__, str(exc), time.monotonic() - t0, broken_reason())
    dist.barrier()  # the default group: rank 2 stays alive (and silent) while rank 1 waits in vain
    del short, fatal
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_scenario, 3, "/tmp", timeout=120)


@pytest.mark.slow
def test_ranges_arrive_bit_exact(results: list[dict[str, Any]]) -> None:
    n_msgs = len(messages(NBYTES, WIRE_CHUNK))
    assert n_msgs == 17
    assert results[0]["unpaced_posted"] == 2 * n_msgs  # one send per message per target
    assert results[1]["unpaced_ok"] and results[2]["unpaced_ok"]
    assert results[1]["paced_ok"]
    assert results[0]["single_ok"]


@pytest.mark.slow
def test_paced_send_calls_the_pacer_once_per_message(results: list[dict[str, Any]]) -> None:
    assert results[0]["paced_returned"] == []  # paced sends are waited for inside send_ranges
    assert results[0]["pace_calls"] == [n for _, n in messages(NBYTES, WIRE_CHUNK)]


@pytest.mark.slow
def test_all_reduce_ints(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["reduced"] == {"min": [0, -2, 1], "max": [2, 0, 21], "sum": [3, -3, 33]}


@pytest.mark.slow
def test_receive_without_send_ends_by_its_deadline_in_peer_error(results: list[dict[str, Any]]) -> None:
    kind, msg, took, broken = results[1]["deadline"]
    assert kind == "PeerError", (kind, msg)
    assert "receive that never completes with rank 2" in msg and "failed on rank 1" in msg, msg
    assert took < DEADLINE_S + 5, took
    assert broken is None  # a recoverable failure leaves the control plane usable


@pytest.mark.slow
def test_fatal_wait_breaks_the_control_plane(results: list[dict[str, Any]]) -> None:
    kind, msg, took, broken = results[1]["fatal"]
    assert kind == "RestartRequiredError", (kind, msg)
    assert "Restart the job" in msg and "fatal receive that never completes" in msg, msg
    assert took < SHORT_TIMEOUT_S + 5, took
    assert broken and "fatal receive" in broken


def test_single_process_transport_is_trivial() -> None:
    t = transport_for(Comm(None))
    assert isinstance(t, GlooTransport) and t.rank == 0
    assert t.all_reduce_ints([3, -1], "min") == [3, -1]
    assert messages(10, 0) == [(0, 10)] and messages(10, 4) == [(0, 4), (4, 4), (8, 2)]
