"""Issue 50 (items 3, 4, 5, 7): timelines that survive eviction and the persistent tier,
``wait_persisted`` after a rollback, readers that leave a live job alone, and ``gc --remove-job``
next to an idle drain server.

The end-to-end tests run real processes: 2 ranks on 2 simulated nodes with a ``file://`` store,
SIGKILLed after a rollback and restarted on the same roots and store (memory intact, then
wiped); a training process with a second process restoring the same job meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import node_root_factory, run_ranks, run_until_death, wipe

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
from gemini_dcp.commit.protocol import repeated_save_message
from gemini_dcp.core.restore_order import NodeView, StepView, decide
from gemini_dcp.core.timelines import ROOT, Lineage, after_restore, job_lineage
from gemini_dcp.errors import ConfigError, find_gemini_error
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.ops.housekeeping import drain_servers, processes_using, remove_job
from gemini_dcp.persistent.drain import Paths
from gemini_dcp.persistent.drain.client import wait_durable
from gemini_dcp.persistent.store import PersistentTier
from gemini_dcp.persistent.store_calls import PersistentTimeoutError

JOB = "tl"


# ---- the rules, without processes ---------------------------------------------------------------
def test_a_lineage_keeps_the_live_history_only() -> None:
    t1 = ROOT.restore(4, "", "launch-a", abandoned=[5, 6])  # roll back to 4: a new timeline owns 5, 6, ...
    assert t1.gen == 1 and t1.owner(4) == "" and t1.owner(5) == t1.tip != ""
    assert t1.live(4, "") and not t1.live(6, "") and t1.live(6, t1.tip)
    assert t1.restore(5, t1.tip, "launch-a", abandoned=[]) is t1  # restoring the newest step changes nothing
    t2 = t1.restore(3, "", "launch-a", abandoned=[5])  # back again, below the first branch: t1's steps go too
    assert t2.gen == 2 and not t2.live(5, t1.tip) and t2.live(5, t2.tip) and t2.live(3, "")
    assert t2.tip != ROOT.restore(3, "", "launch-a", [5]).tip  # another rollback, another id
    assert Lineage.from_json(json.dumps(t2.to_json())) == t2
    for junk in ("[]", '{"gen": -1, "segments": [["", null]]}', '{"gen": 1, "segments": [["", null], ["x", "5"]]}',
                 '{"gen": 1, "segments": [["", 3]]}', '{"gen": 2, "segments": [["", null], ["a", 5], ["b", 4]]}', "nan"):
        assert Lineage.from_json(junk) is None, junk


def _view(rank: int, steps: dict[int, str], lineage: Lineage | None = None) -> NodeView:
    return NodeView(rank, f"n{rank}", tuple(StepView(s, f"fp{s}{t}", 1, (0,), float(s), True, timeline=t)
                                            for s, t in steps.items()),
                    lineage=json.dumps(lineage.to_json()) if lineage is not None else "")


def test_the_decision_never_takes_an_abandoned_step_from_memory_or_the_store() -> None:
    t1 = ROOT.restore(4, "", "L", abandoned=[5, 6])
    # Node 0 knows the rollback (a step of the new timeline committed there); node 1 was replaced.
    views = [_view(0, {4: "", 5: t1.tip}, t1), _view(1, {})]
    lin = job_lineage(views)
    assert lin == t1
    store = {5: "", 6: ""}  # the store still holds the abandoned 5 and 6
    got = decide(views, None, JOB, [4, 5, 6], persistent_timelines=store, lineage=lin)
    assert got.step == 5 and got.fingerprint == f"fp5{t1.tip}"
    # Memory wiped everywhere: the store's own files carry the lineage of the new 5.
    got = decide([_view(0, {})], None, JOB, [4, 5, 6], persistent_timelines={5: t1.tip, 6: ""}, lineage=t1)
    assert got.step == 5 and got.use_persistent
    # Without the rollback's lineage (an older release's store), the newest step wins, as before.
    assert decide([_view(0, {})], None, JOB, [4, 5, 6]).step == 6
    # A restore of the newest live step keeps the history; one of an older step branches it.
    assert after_restore(lin, got, views, [4, 5, 6], {5: t1.tip, 6: ""}, "L2") == t1
    older = decide(views, 4, JOB, [4, 5, 6], persistent_timelines=store, lineage=lin)
    assert after_restore(lin, older, views, [4, 5, 6], {5: t1.tip}, "L2").gen == 2


def test_the_repeated_save_error_names_its_cause(tmp_path: Path) -> None:
    split = repeated_save_message(5, "j", "L", None)
    assert "restored no step since" in split and "one state dict" in split and "GeminiStorageReader" in split
    assert "after its rollback to step 4" in repeated_save_message(5, "j", "L", 4)
    assert "does not go back before step 5" in repeated_save_message(5, "j", "L", 6)


def test_wait_persisted_is_not_satisfied_by_another_save_of_the_step(tmp_path: Path) -> None:
    """The status of the abandoned timeline's drain of step 5 (another fingerprint) and its newer
    step 6 in the store: neither is this save of step 5."""
    p = Paths(tmp_path / "persist")
    p.dir.mkdir(parents=True)
    p.status.write_text(json.dumps({"steps": {"5": {"state": "committed", "committed_unix": 1.0, "fingerprint": "old"}}}))

    class Store:
        url = "file:///nowhere"
        is_local = True

        def committed_steps(self) -> list[int]:
            return [4, 6]

        def live_steps(self, steps: list[int]) -> list[int]:
            return [4]  # 6 is the abandoned timeline's

        def timelines(self, steps: list[int]) -> tuple[dict[int, str], Lineage]:
            return {6: ""}, ROOT.restore(4, "", "L", [5, 6])

    with pytest.raises(PersistentTimeoutError):
        wait_durable(p, Store(), 5, 0.3, expect=("new", "t1"))
    p.status.write_text(json.dumps({"steps": {"5": {"state": "committed", "committed_unix": 2.0, "fingerprint": "new"}}}))
    assert wait_durable(p, Store(), 5, 5.0, expect=("new", "t1")) == 5


# ---- 2 nodes, a store, a rollback, SIGKILL, a restart on the same roots and store ---------------------
def _sd(rank: int, value: float) -> dict[str, torch.Tensor]:
    return {f"w{rank}": torch.full((256,), value + rank)}


def _roll_back_then_die(rank: int, world_size: int, root: str, store: str, out: str) -> None:
    try:
        _roll_back(rank, root, store, out)
    except BaseException:  # noqa: BLE001 - run_until_death reports exit codes only
        import traceback

        persist = Path(root) / JOB / "persist"
        logs = [f.read_text()[-3000:] for f in (persist / "drain.log", persist / "status.json") if f.exists()]
        Path(f"{out}.{rank}.err").write_text(traceback.format_exc() + "\n".join(logs))
        raise
    time.sleep(600)  # killed with rank 0, as torchrun kills a worker group


def _roll_back(rank: int, root: str, store: str, out: str) -> None:
    import torch.distributed as dist

    w = GeminiStorageWriter(root=root, job_id=JOB, keep=3, persistent=store, persist_every=1)
    for step in range(1, 7):
        dcp.save(_sd(rank, step), storage_writer=w, checkpoint_id=step)
    w.wait_persisted(6, timeout_s=180)
    sd = _sd(rank, 0)
    dcp.load(sd, storage_reader=GeminiStorageReader(root=root, job_id=JOB, persistent=store), checkpoint_id=4)
    dcp.save(_sd(rank, 500), storage_writer=w, checkpoint_id=5)  # the new timeline's step 5
    got = w.wait_persisted(5, timeout_s=180)
    mine = LocalTier(root, JOB).record(5)
    stored = PersistentTier(store, JOB).read_index(5)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"waited": got, "same_save": stored is not None and mine is not None
                                         and stored.fingerprint == mine.fingerprint(),
                                         "memory": LocalTier(root, JOB).steps()}))
        os.kill(os.getpid(), signal.SIGKILL)


def _restore(rank: int, world_size: int, root: str, store: str) -> tuple[Any, ...]:
    sd = _sd(rank, 0)
    reader = GeminiStorageReader(root=root, job_id=JOB, persistent=store)
    dcp.load(sd, storage_reader=reader)
    return reader.restored_step, torch.equal(sd[f"w{rank}"], _sd(rank, 500)[f"w{rank}"]), \
        sorted(t for t, n in reader.restored_from.items() if n)


def test_a_restart_never_restores_the_abandoned_timeline_from_memory_or_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEMINI_DCP_DRAIN_IDLE_S", "300")  # the drain servers outlive the trainers (item 7 below)
    make, cleanup = node_root_factory("gemini-tl")
    store = str(tmp_path / "store")
    out = tmp_path / "out.json"
    roots = make(2)
    try:
        codes = run_until_death(_roll_back_then_die, 2, roots, timeout=400, store=store, out=str(out))
        errors = [e.read_text() for e in tmp_path.glob("out.json.*.err")]
        assert codes[0] == -signal.SIGKILL and not errors, (codes, errors)
        seen = json.loads(out.read_text())
        # wait_persisted(5) returned for the new timeline's save of 5, not the abandoned 5 or 6
        assert seen["waited"] == 5 and seen["same_save"], seen
        assert 6 not in seen["memory"], seen

        # gc --remove-job beside the job's idle drain server: named, with when it exits; --stop-drain stops it
        # once no upload is pending (a leftover request of the killed trainer may keep one pending: then the
        # wait is bounded and says so).
        for root in roots:
            persist = Path(root) / JOB / "persist"
            if not drain_servers(persist, processes_using(Path(root) / JOB)):
                continue  # this node's server already went (nothing else holds the files)
            with pytest.raises(ConfigError) as info:
                remove_job(root, JOB, dry_run=True)
            msg = str(info.value)
            assert "drain server" in msg and "300 s idle" in msg and "--stop-drain" in msg, msg
            assert msg.index("--stop-drain") < msg.index("--force"), msg
            if Paths(persist).pending():
                with pytest.raises(ConfigError, match="still has uploads of steps"):
                    remove_job(root, JOB, dry_run=True, stop_drain=True, drain_wait_s=0.5)
                _kill_drains(roots)
            else:
                remove_job(root, JOB, dry_run=True, stop_drain=True, drain_wait_s=120)  # stops it, removes nothing
            assert not drain_servers(persist, processes_using(Path(root) / JOB))

        assert PersistentTier(store, JOB).live_steps(PersistentTier(store, JOB).committed_steps())[-1] == 5
        for r in run_ranks(_restore, 2, roots, store=store):  # memory intact
            assert r[:2] == (5, True), r
        for root in roots:
            wipe(root)  # both nodes replaced: only the store is left
        for r in run_ranks(_restore, 2, roots, store=store):
            assert r == (5, True, ["persistent"]), r
    finally:
        _kill_drains(roots)
        cleanup()


def _kill_drains(roots: list[str]) -> None:
    """Stop the drain servers this test's trainers left (their idle timeout is long here)."""
    for root in roots:
        persist = Path(root) / JOB / "persist"
        for pid in drain_servers(persist, processes_using(Path(root) / JOB)):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while drain_servers(persist, processes_using(Path(root) / JOB)) and time.monotonic() < deadline:
            time.sleep(0.1)


# ---- a second process restores the job while training has rolled back ------------------------------
SIDECAR = """
import sys, torch, torch.distributed.checkpoint as dcp
from gemini_dcp import GeminiStorageReader
sd = {"w0": torch.zeros(256)}
r = GeminiStorageReader(root=sys.argv[1], job_id=sys.argv[2])
dcp.load(sd, storage_reader=r)
print(r.restored_step)
"""


def _train_beside_a_reader(rank: int, world_size: int, root: str) -> dict[str, Any]:
    w = GeminiStorageWriter(root=root, job_id="side", keep=3)
    for step in range(1, 7):
        dcp.save(_sd(rank, step), storage_writer=w, checkpoint_id=step)
    dcp.load(_sd(rank, 0), storage_reader=GeminiStorageReader(root=root, job_id="side"), checkpoint_id=4)
    side = subprocess.run([sys.executable, "-c", SIDECAR, root, "side"], capture_output=True, text=True, timeout=300,
                          check=True)
    for step in (5, 6):  # the live job's saves keep working
        dcp.save(_sd(rank, step * 100), storage_writer=w, checkpoint_id=step)
    try:
        dcp.save(_sd(rank, 1), storage_writer=w, checkpoint_id=6)  # a true repeat on the new timeline
        repeat = ""
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        repeat = str(find_gemini_error(exc) or exc)
    sd = _sd(rank, 0)
    reader = GeminiStorageReader(root=root, job_id="side")
    dcp.load(sd, storage_reader=reader)
    return {"side": side.stdout.split()[-1], "repeat": repeat, "restored": reader.restored_step,
            "values": torch.equal(sd[f"w{rank}"], _sd(rank, 600)[f"w{rank}"]), "steps": LocalTier(root, "side").steps(),
            "markers": len(list((Path(root) / "side" / "restores").glob("*.json")))}


def test_a_foreign_reader_leaves_the_live_jobs_rollback_alone() -> None:
    make, cleanup = node_root_factory("gemini-side")
    try:
        (got,) = run_ranks(_train_beside_a_reader, 1, make(1))
        assert got["side"] == "6"  # the reader saw the committed history: the rollback is not committed yet
        assert "after its rollback to step 4" in got["repeat"], got
        assert got["restored"] == 6 and got["values"] and got["steps"][-1] == 6, got
        assert got["markers"] == 1, got  # the reader's marker went with the live job's next commit; its own stays
    finally:
        cleanup()
