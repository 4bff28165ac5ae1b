"""Issue 43: the NIXL transport of the peer tier (gemini_dcp.transport.nixl), real processes on CPU.

Needs NIXL (``scripts/nixl_venv.sh`` builds a venv with it; run this file with that venv's
python): skipped where it is absent. UCX runs over shared memory and TCP on loopback
(``UCX_TLS=sm,tcp``) and over TCP alone (``tcp``), ``UCX_NET_DEVICES=lo``. The option
plumbing (keyword, options field, environment) is tested without NIXL.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import mp_utils
import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import node_root_factory, run_ranks, wipe
from workloads import dtensor_state, load_and_check, save_steps

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.errors import ConfigError
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.options import GeminiOptions
from gemini_dcp.transport.nixl import NIXL_MODULES

HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES)
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed (scripts/nixl_venv.sh builds a venv with it)")

NBYTES = (1 << 20) + 3
WIRE_CHUNK = 64 << 10


@pytest.fixture
def nodes():  # noqa: ANN201 - a pytest fixture (generator)
    make, cleanup = node_root_factory("gemini-nixl")
    yield make
    cleanup()


@pytest.fixture(params=["sm,tcp", "tcp"])
def ucx(request, monkeypatch):  # noqa: ANN001, ANN201 - a pytest fixture
    monkeypatch.setenv("UCX_TLS", request.param)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.delenv("UCX_MEM_EVENTS", raising=False)  # the engine's own default applies
    return request.param


# ---- option plumbing (no NIXL needed) ------------------------------------------------------------------
def test_peer_transport_option_keyword_env_and_tree(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    assert GeminiOptions().peer_transport == "gloo"
    assert GeminiOptions.from_env({"GEMINI_DCP_PEER_TRANSPORT": "NIXL"}).peer_transport == "nixl"
    with pytest.raises(ConfigError, match="GEMINI_DCP_PEER_TRANSPORT"):
        GeminiOptions.from_env({"GEMINI_DCP_PEER_TRANSPORT": "rdma"})
    with pytest.raises(ConfigError, match="peer_transport"):
        GeminiOptions(peer_transport="ucx")  # type: ignore[arg-type]
    w = GeminiStorageWriter(root=tmp_path, job_id="a", peer_transport="auto")
    assert w.options.peer_transport == "auto"
    monkeypatch.setenv("GEMINI_DCP_PEER_TRANSPORT", "nixl")
    assert GeminiStorageWriter(root=tmp_path, job_id="b").options.peer_transport == "nixl"
    assert GeminiStorageReader(root=tmp_path, job_id="b").options.peer_transport == "nixl"
    opts = GeminiOptions(peer_transport="auto")
    assert GeminiStorageWriter(root=tmp_path, job_id="c", options=opts).options.peer_transport == "auto"
    with pytest.raises(ConfigError, match="conflicts"):
        GeminiStorageWriter(root=tmp_path, job_id="d", options=opts, peer_transport="nixl")


def _choose(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import gemini_dcp.transport.nixl as nixl
    from gemini_dcp.transport.comm import get_comm
    from gemini_dcp.transport.p2p import GlooTransport, transport_for

    if rank == 1:  # this rank cannot start NIXL: every rank must fall back (auto) or refuse (nixl)
        nixl.probe = lambda: (False, "no NIXL on this rank")
    comm = get_comm(30.0)
    out: dict[str, Any] = {"auto": type(transport_for(comm, "auto")).__name__,
                           "gloo": isinstance(transport_for(comm, "gloo"), GlooTransport)}
    try:
        transport_for(comm, "nixl")
        out["nixl"] = "chosen"
    except ConfigError as exc:
        out["nixl"] = str(exc)
    return out


def test_auto_falls_back_to_gloo_on_every_rank_when_one_cannot_start_nixl(tmp_path: Path) -> None:
    out = run_ranks(_choose, 2, str(tmp_path))
    assert [o["auto"] for o in out] == ["GlooTransport", "GlooTransport"] and all(o["gloo"] for o in out)
    assert ("another rank could not start NIXL" if HAVE_NIXL else "NIXL is not installed") in out[0]["nixl"]
    assert "no NIXL on this rank" in out[1]["nixl"]


@pytest.mark.slow  # with NIXL installed, doctor probes it in a child process
def test_doctor_reports_nixl(monkeypatch) -> None:  # noqa: ANN001
    from gemini_dcp.ops import doctor as doc

    monkeypatch.setenv("UCX_TLS", "sm,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    check = doc._nixl_check()
    if HAVE_NIXL:
        assert check.status == "pass" and "would pick nixl" in check.detail and "UCX_TLS=sm,tcp" in check.detail
        assert "tcp" in check.detail and "cma" in check.detail
    else:
        assert check.status == "info" and "would pick gloo" in check.detail and "--no-deps" in check.fix
    monkeypatch.setattr(doc.importlib.util, "find_spec", lambda name: None)
    assert doc._nixl_check().status == "info"


# ---- the transport itself --------------------------------------------------------------------------------
def _payload(seed: int, n: int = NBYTES) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _transfers(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from gemini_dcp.errors import PeerError
    from gemini_dcp.transport.comm import get_comm
    from gemini_dcp.transport.p2p import NixlTransport, transport_for

    out: dict[str, Any] = {}
    t = transport_for(get_comm(30.0), "nixl")
    out["nixl"] = isinstance(t, NixlTransport)
    out["mem_events"] = os.environ.get("UCX_MEM_EVENTS")  # the engine's default: UCX's memory hooks off
    src = _payload(7)
    if rank == 0:
        paced: list[int] = []
        works = t.send_ranges(lambda o, n: src[o : o + n], NBYTES, WIRE_CHUNK, [1, 2], "unpaced send")
        t.send_ranges(lambda o, n: src[o : o + n], NBYTES, WIRE_CHUNK, [1], "paced send", pace=paced.append,
                      deadline_s=30.0)
        for w in works:
            t.wait(w, deadline_s=30.0)
        out["pace_calls"] = len(paced)
        got = torch.zeros(5, dtype=torch.uint8)
        t.wait(t.post_recv(got, 2, "single receive"))
        out["single_ok"] = bool(torch.equal(got, _payload(9, 5)))
    else:
        dst = torch.zeros(NBYTES, dtype=torch.uint8)
        works = t.recv_ranges(lambda o, n: dst[o : o + n], NBYTES, WIRE_CHUNK, 0, "unpaced receive")
        dst2 = torch.zeros(NBYTES, dtype=torch.uint8)
        if rank == 1:
            works += t.recv_ranges(lambda o, n: dst2[o : o + n], NBYTES, WIRE_CHUNK, 0, "paced receive")
        for w in works:
            t.wait(w, deadline_s=30.0)
        out["unpaced_ok"] = bool(torch.equal(dst, src))
        if rank == 1:
            out["paced_ok"] = bool(torch.equal(dst2, src))
        if rank == 2:
            t.wait(t.post_send(_payload(9, 5), 0, "single send"), deadline_s=30.0)
    out["reduced"] = t.all_reduce_ints([rank], "sum")
    if rank == 1:  # a receive whose send never comes: PeerError by its deadline
        t0 = time.monotonic()
        try:
            t.wait(t.post_recv(torch.zeros(16, dtype=torch.uint8), 2, "orphan receive"), deadline_s=1.0)
            out["orphan"] = "no error"
        except PeerError as exc:
            out["orphan"] = str(exc)
        out["orphan_s"] = time.monotonic() - t0
    return out


@needs_nixl
def test_ranges_paced_and_single_transfers_bit_exact(ucx: str, tmp_path: Path) -> None:
    out = run_ranks(_transfers, 3, str(tmp_path))
    assert all(o["nixl"] for o in out), out
    assert all(o["mem_events"] == "no" for o in out), out
    assert out[0]["pace_calls"] == -(-NBYTES // WIRE_CHUNK) and out[0]["single_ok"]
    assert out[1]["unpaced_ok"] and out[1]["paced_ok"] and out[2]["unpaced_ok"]
    assert all(o["reduced"] == [3] for o in out)
    assert "orphan receive" in out[1]["orphan"] and "deadline" in out[1]["orphan"], out[1]
    assert out[1]["orphan_s"] < 5.0


# ---- the peer tier over NIXL -----------------------------------------------------------------------------
@needs_nixl
def test_replication_and_wiped_node_restore_bit_exact(ucx: str, nodes) -> None:  # noqa: ANN001
    n = nodes(2)
    roots = [n[0], n[0], n[1], n[1]]
    run_ranks(save_steps, 4, roots, job="p", steps=[1, 2], replicas=2, peer_transport="nixl")
    rec = LocalTier(n[0], "p").record(2)
    assert rec is not None and set(rec.held_ranks()) == {0, 1, 2, 3}
    wipe(n[0])
    out = run_ranks(load_and_check, 4, roots, job="p", expect=2, peer_transport="nixl")
    assert all(o.get("ok") for o in out), out
    assert out[0]["from"]["peer"] > 0


@needs_nixl
def test_four_nodes_auto_picks_nixl_and_restores_a_wiped_node(nodes, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("UCX_TLS", "sm,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("GEMINI_DCP_PEER_TRANSPORT", "auto")
    roots = nodes(4)
    run_ranks(save_steps, 4, roots, job="q", steps=[1], replicas=2)
    wipe(roots[2])
    out = run_ranks(load_and_check, 4, roots, job="q", expect=1)
    assert all(o.get("ok") for o in out), out
    assert out[2]["rank_from"]["peer"] > 0


def _corrupt_on_arrival(rank: int, world_size: int, root: str, *, job: str) -> str:
    import gemini_dcp.peer.push as push

    real = push._verify_items
    if rank == 1:  # flip a byte of what arrived, then verify it as the writer does
        def flipped(slot: Any, results: Any) -> list[str]:
            slot.view(0, 1).bitwise_xor_(torch.tensor([0x5A], dtype=torch.uint8))
            return real(slot, results)
        push._verify_items = flipped
    try:
        save_steps(rank, world_size, root, job=job, steps=[1], replicas=2, peer_transport="nixl")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return type(find_gemini_error(exc)).__name__
    return "committed"


@needs_nixl
def test_corrupt_byte_on_arrival_is_caught(nodes, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("UCX_TLS", "sm,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    roots = nodes(2)
    assert run_ranks(_corrupt_on_arrival, 2, roots, job="c") == ["PeerError", "PeerError"]
    assert LocalTier(roots[0], "c").steps() == []


def _parity_save(rank: int, world_size: int, root: str, *, steps: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for step in steps:
        w = GeminiStorageWriter(root=root, job_id="par", parity_group=4, peer_transport="nixl")
        dcp.save(dtensor_state(step, world_size), storage_writer=w, checkpoint_id=step)
        out = dict(w.last_replication)
    return out


@needs_nixl
def test_parity_rebuild_over_nixl(nodes, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("UCX_TLS", "sm,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    n = nodes(4)
    stats = run_ranks(_parity_save, 4, n, steps=[1])
    assert all(s["scheme"] == "parity g=4" and not s["degraded"] for s in stats), stats
    wipe(n[2])
    out = run_ranks(load_and_check, 4, n, job="par", expect=1, peer_transport="nixl")
    assert all(o.get("ok") for o in out), out
    assert out[0]["from"]["parity"] > 0


@needs_nixl
def test_incremental_deltas_over_nixl(nodes, monkeypatch) -> None:  # noqa: ANN001
    """tests/test_incremental.py's two-node scenario with every peer byte over NIXL: the peer gets
    only the changed run, verified; a wiped node restores from the delta-built replica bit-exact."""
    from test_incremental import _train_and_save

    monkeypatch.setenv("UCX_TLS", "sm,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("GEMINI_DCP_PEER_TRANSPORT", "nixl")
    roots = nodes(2)
    first = run_ranks(_train_and_save, 2, roots, timeout=180, steps=[0, 1, 2, 3, 4], load_first=False)
    for res in first:
        rep = res["replication"]
        assert rep["delta_pairs"] == 1 and rep["sent_bytes"] == rep["delta_sent_bytes"] == 4 * 64 * 4, rep
        assert res["restored_ok"] and res["verify_ok"]
    wipe(roots[1])
    second = run_ranks(_train_and_save, 2, roots, timeout=180, steps=[5], load_first=True)
    for r, res in enumerate(second):
        assert torch.equal(res["loaded_head"], first[r]["head"]) and res["restored_ok"]


def _killed_mid_transfer(rank: int, world_size: int, root: str, *, job: str, flag: str) -> None:
    import gemini_dcp.core.faults as faults

    if rank == 1:  # the sender dies with its transfers posted, not delivered
        real = faults.fault_point

        def die(name: str, *a: Any, **k: Any) -> Any:
            if name == "replicate.mid_send":
                os.kill(os.getpid(), signal.SIGKILL)
            return real(name, *a, **k)
        import gemini_dcp.peer.push as push
        push.fault_point = die
    t0 = time.monotonic()
    try:
        save_steps(rank, world_size, root, job=job, steps=[1], replicas=2, peer_transport="nixl", timeout_s=4.0)
        Path(flag).write_text("committed")
    except BaseException:  # noqa: BLE001 - reported to the test
        from gemini_dcp.transport.comm import broken_reason

        # The survivor's own reason (DCP's gather on the training group may fail first, and then
        # wraps a gloo error): the NIXL wait that timed out, which broke the control group.
        Path(flag).write_text(f"{time.monotonic() - t0:.1f} {broken_reason()}")
    os._exit(0)  # the survivor leaves without tearing down a group whose peer is dead


@needs_nixl
def test_peer_killed_mid_transfer_ends_in_a_bounded_error(nodes, monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    monkeypatch.setenv("UCX_TLS", "sm,tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    roots = nodes(2)
    flag = tmp_path / "outcome"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as out_dir:  # the survivor is left alone (not killed with its peer)
        ctx = mp_utils._start(_killed_mid_transfer, 2, roots, out_dir, {"job": "k", "flag": str(flag)})
        for p in ctx.processes:
            p.join(60)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in ctx.processes]
    assert codes == [0, -signal.SIGKILL], codes
    text = flag.read_text() if flag.exists() else "no outcome"
    secs, _, reason = text.partition(" ")
    assert "NIXL transfer not completed within the deadline of 4 s" in reason, text
    assert "receive of rank 1's slot" in reason, text
    assert float(secs) < 30.0 and time.monotonic() - t0 < 60
    assert LocalTier(roots[0], "k").steps() == []
