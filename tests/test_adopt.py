"""A lost node's part of a pending persistent step, uploaded by the peer holding its replicas.

Pure decisions first (which node adopts which ranks), then the real thing: two simulated
nodes drain to a file:// store, one dies (workers and drain server SIGKILLed, tier root
wiped) before its part is written, the job restarts, and the restore hands the lost part to
the survivor's drain; stock DCP then loads the completed step bit-exact.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks, run_until_death
from workloads import COLS, ROWS, dtensor_state, full_weight, load_and_check

from gemini_dcp.core.restore_order import NodeView, StepView
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.ops.inspection import inspect_root
from gemini_dcp.persistent.adopt import Adoption, orphaned_part
from gemini_dcp.persistent.drain import Paths, drain_status, server_pid, wait_idle
from gemini_dcp.persistent.store import PersistentTier

RANK_NODES = ("a", "a", "b", "b", "c", "c")  # 3 nodes x 2 ranks; ring replicas=2: a->b, b->c, c->a


def _view(rank: int, node: str, held: tuple[int, ...], step: int = 8, fp: str = "fp") -> NodeView:
    return NodeView(rank, node, (StepView(step, fp, 6, held, 1.0, True),) if held else ())


def _ring_views(lost: set[str]) -> list[NodeView]:
    held = {"a": (0, 1, 4, 5), "b": (0, 1, 2, 3), "c": (2, 3, 4, 5)}
    return [_view(r, n, () if n in lost else held[n]) for r, n in enumerate(RANK_NODES)]


def test_the_lowest_surviving_holder_adopts_each_lost_rank() -> None:
    views = _ring_views({"b"})  # b's ranks 2, 3 are held by b and c; b lost its memory (replaced, same id)
    assert orphaned_part(views, "c", 8, "fp", RANK_NODES) == Adoption(8, "fp", ("b",), (2, 3))
    assert orphaned_part(views, "a", 8, "fp", RANK_NODES) is None  # a holds no replica of b
    assert orphaned_part(views, "b", 8, "fp", RANK_NODES) is None  # the replacement holds nothing


def test_nobody_adopts_while_every_origin_still_holds_the_step() -> None:
    views = _ring_views(set())
    assert all(orphaned_part(views, n, 8, "fp", RANK_NODES) is None for n in "abc")


def test_a_node_gone_from_the_job_counts_as_lost_and_holders_split_by_rank() -> None:
    # b is not in the job at all; its rank 2 is held by a and c, rank 3 by c only
    views = [_view(0, "a", (0, 1, 2)), _view(1, "c", (2, 3, 4, 5))]
    assert orphaned_part(views, "a", 8, "fp", RANK_NODES) == Adoption(8, "fp", ("b",), (2,))
    assert orphaned_part(views, "c", 8, "fp", RANK_NODES) == Adoption(8, "fp", ("b",), (3,))


def test_another_save_of_the_step_does_not_count_as_holding_it() -> None:
    views = [_view(0, "a", (0, 1, 2, 3, 4, 5)), _view(1, "b", (2, 3), fp="other")]
    got = orphaned_part(views, "a", 8, "fp", RANK_NODES)
    assert got == Adoption(8, "fp", ("b", "c"), (2, 3, 4, 5))


# ---- the real thing: SIGKILL, wipe, restart, restore, stock load ---------------------------------
JOB = "adopt"


def _save_then_die(rank: int, world_size: int, root: str, *, url: str) -> None:
    from gemini_dcp import GeminiStorageWriter

    for step in (1, 2):
        w = GeminiStorageWriter(root=root, job_id=JOB, replicas=2, persistent=url, persist_every=2)
        dcp.save(dtensor_state(step, world_size), storage_writer=w, checkpoint_id=step)
    os.kill(os.getpid(), signal.SIGKILL)  # the whole worker group dies; node 1 is then lost for good


def _restore(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return load_and_check(rank, world_size, root, job=JOB)


def _kill_drain_server_midway(pdir: Path, data: Path) -> None:
    """SIGKILL a node's (throttled) drain server once its data file has begun to grow in the store."""
    deadline = time.monotonic() + 120
    while not (data.exists() and data.stat().st_size > 0):
        assert time.monotonic() < deadline, ("node 1 never began its upload", drain_status(pdir))
        time.sleep(0.02)
    pid = server_pid(pdir)
    assert pid is not None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(autouse=True)
def _short_lived_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_DRAIN_IDLE_S", "3")
    monkeypatch.setenv("GEMINI_DCP_DRAIN_BRIDGE", "0")  # the drain processes upload (one is killed), not a bridge


@pytest.mark.slow
def test_survivor_uploads_the_lost_nodes_part_after_the_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    roots = [tempfile.mkdtemp(prefix=f"gemini-adopt{i}-", dir=base) for i in range(2)]
    store = tmp_path / "store"
    url = f"file://{store}"
    pdirs = [LocalTier(r, JOB).layout.persist_dir for r in roots]
    # ~4 s per node's part: node 1's drain is killed midway, long before it can write its marker
    monkeypatch.setenv("GEMINI_DCP_DRAIN_THROTTLE_BPS", "1024")
    try:
        codes = run_until_death(_save_then_die, 2, roots, url=url)
        assert all(c == -signal.SIGKILL for c in codes), codes
        step_dir = store / JOB / "step-2"
        _kill_drain_server_midway(pdirs[1], step_dir / "__1_0.distcp")  # leaves a torn __1_0.distcp
        shutil.rmtree(roots[1])  # node 1 is replaced: a fresh machine with an empty tier root
        os.makedirs(roots[1])
        # node 0 writes its own part, then waits for node 1's, which will never come from node 1
        deadline = time.monotonic() + 120
        while len(list((step_dir / ".gemini").glob("part-*.pkl"))) < 1:
            assert time.monotonic() < deadline, drain_status(pdirs[0])
            time.sleep(0.1)
        assert not (step_dir / ".metadata").exists()
        assert sorted(p.name for p in step_dir.glob("__*")) == ["__0_0.distcp", "__1_0.distcp"]
        assert len(list((step_dir / ".gemini").glob("part-*.pkl"))) == 1

        out = run_ranks(_restore, 2, roots)
        assert all(o["ok"] and o["step"] == 2 for o in out), out
        assert out[0]["from"]["peer"] > 0, out[0]
        assert Paths(pdirs[1]).adopt.pending() == []  # the replacement adopts nothing

        pt = PersistentTier(url, JOB)
        assert pt.wait_for_step(2, timeout_s=120), (drain_status(pdirs[0]), drain_status(Paths(pdirs[0]).adopt.dir))
        assert wait_idle(Paths(pdirs[0]).adopt.dir, 60)
        files = sorted(p.name for p in step_dir.glob("__*"))
        assert files[:2] == ["__0_0.distcp", "__1_0.distcp"] and len(files) == 3 and files[2].startswith("__1_a"), files
        md = dcp.FileSystemReader(str(step_dir)).read_metadata()  # rank 1's items point at the adopted file
        assert {info.relative_path for info in md.storage_data.values()} == {"__0_0.distcp", files[2]}
        assert drain_status(Paths(pdirs[0]).adopt.dir)["steps"]["2"]["state"] == "done"
        (job,) = inspect_root(roots[0]).jobs  # what `gemini-dcp inspect` shows the operator
        assert job.drain is not None and [(e["step"], e["state"]) for e in job.drain["adopt_recent"]] == [(2, "done")]
        # stock DCP, no gemini_dcp reader: the sharded save consolidates into plain tensors
        sd = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.float64)}, "step": 0}
        dcp.load(sd, checkpoint_id=str(step_dir))
        assert torch.equal(sd["model"]["w"], full_weight(2)) and sd["step"] == 2
        assert torch.equal(sd["model"]["b"], torch.arange(COLS, dtype=torch.float64) + 2)
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
