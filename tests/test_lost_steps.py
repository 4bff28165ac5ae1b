"""Issue 19, "Lost steps" and robustness: no committed step is lost to eviction, to another
launch of the same job id, to a second save of a step, to a large step number, to two
machines sharing a node id, to a full tmpfs at the record write, or to an odd file.

Multi-node cases run real gloo ranks (tests/mp_utils.run_ranks), each rank its own tier root
(one simulated node each). Single-process cases tell launches apart through the environment
that ``gemini_dcp.transport.launch.current_launch`` reads.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks
from workloads import plain_state

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.errors import ConfigError, InvalidStepError, JobConflictError
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.transport import launch as launch_mod
from gemini_dcp.transport.launch import current_launch


@pytest.fixture
def root() -> Iterator[str]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-lost-", dir=base)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``launch(n)`` makes this process launch number ``n`` (as a torchrun restart would)."""

    def switch(n: int) -> None:
        gc.collect()  # writers of the previous launch are gone: their launch lock with them
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.9")
        monkeypatch.setenv("MASTER_PORT", str(20000 + n))
        launch_mod.cache_clear()

    yield switch
    gc.collect()
    launch_mod.cache_clear()


def _save(root: str, job: str, step: int, sd: dict[str, Any] | None = None, **kw: Any) -> None:
    dcp.save(sd if sd is not None else plain_state(step), storage_writer=GeminiStorageWriter(root=root, job_id=job, **kw),
             checkpoint_id=step)


def _load(root: str, job: str, step: int | None = None) -> tuple[int | None, dict[str, Any]]:
    target = plain_state(0)
    reader = GeminiStorageReader(root=root, job_id=job)
    dcp.load(target, storage_reader=reader, checkpoint_id=step)
    return reader.restored_step, target


def _gemini(exc: BaseException) -> BaseException:
    return find_gemini_error(exc) or exc


# ---- eviction only after a global commit -------------------------------------------------------
def _fail_record_write_on_rank1(rank: int, world_size: int, root: str, *, job: str) -> dict[str, Any]:
    """Save 1 and 2 (keep=1), then step 3 with node 1's tmpfs full at the record write."""
    import errno

    import gemini_dcp.local.job_dir as layout_mod

    for step in (1, 2):
        _save(root, job, step, plain_state(step, rank), keep=1)
    before = LocalTier(root, job).steps()
    if rank == 1:
        def full(fd: int, data: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        layout_mod._write_all = full  # type: ignore[attr-defined]
    err = None
    try:
        _save(root, job, 3, plain_state(3, rank), keep=1)
    except BaseException as exc:  # noqa: BLE001 - DCP wraps it; every rank must see it
        err = type(_gemini(exc)).__name__
    steps_dir = Path(root, job, "steps")
    return {"before": before, "after": LocalTier(root, job).steps(), "error": err,
            "tmp": [n for n in os.listdir(steps_dir) if ".tmp" in n]}


def _exact_load(root: str, job: str, rank: int) -> tuple[int | None, bool]:
    got, target = _load(root, job)
    want = plain_state(got or 0, rank)
    return got, torch.equal(target["w"], want["w"]) and torch.equal(target["i"], want["i"]) and target["step"] == got


def _load_save_load(rank: int, world_size: int, root: str, *, job: str, save: int) -> dict[str, Any]:
    got, exact = _exact_load(root, job, rank)
    _save(root, job, save, plain_state(save, rank), keep=1)
    return {"step": got, "exact": exact, "steps": LocalTier(root, job).steps(), "then": _exact_load(root, job, rank)}


def test_record_write_failing_on_one_node_keeps_a_step_restorable_everywhere(tmp_path: Path) -> None:
    roots = [tempfile.mkdtemp(prefix="gemini-lost-n0-", dir="/dev/shm"), tempfile.mkdtemp(prefix="gemini-lost-n1-", dir="/dev/shm")]
    try:
        out = run_ranks(_fail_record_write_on_rank1, 2, roots, job="g")
        # keep=1 still holds the step known committed everywhere (1) next to the newest (2)
        assert [o["before"] for o in out] == [[1, 2], [1, 2]], out
        # the full tmpfs surfaced on every rank, as TierFullError on the node it hit
        assert out[1]["error"] == "TierFullError" and out[0]["error"] is not None, out
        # node 0 committed 3 but kept 2 (not known committed everywhere); node 1 kept 2, no tmp file left
        assert out[0]["after"] == [2, 3] and out[1]["after"] == [2] and out[1]["tmp"] == [], out
        # restart: step 2 is restored bit-exact; saving 3 again abandons node 0's lone 3
        again = run_ranks(_load_save_load, 2, roots, job="g", save=3)
        assert [(o["step"], o["exact"]) for o in again] == [(2, True), (2, True)], again
        assert [o["steps"] for o in again] == [[2, 3], [2, 3]], again
        assert [o["then"] for o in again] == [(3, True), (3, True)], again
    finally:
        import shutil

        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def _replayed_saves_with_a_failed_record(rank: int, world_size: int, root: str, *, job: str) -> dict[str, Any]:
    """Plan replay (no DCP collective after the write): node 1's record write fails at step 4."""
    import errno

    import torch.distributed as dist

    import gemini_dcp.local.job_dir as layout_mod
    from gemini_dcp.snapshot.replay import PlanReplay

    writer = GeminiStorageWriter(root=root, job_id=job, keep=1)
    replay = PlanReplay(writer, dist.group.WORLD, no_dist=False)
    for step in (1, 2, 3):
        replay.save(plain_state(step, rank), step)
    orig = layout_mod._write_all
    if rank == 1:
        def full(fd: int, data: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        layout_mod._write_all = full  # type: ignore[attr-defined]
    err = None
    try:
        replay.save(plain_state(4, rank), 4)
    except BaseException as exc:  # noqa: BLE001
        err = type(_gemini(exc)).__name__
    layout_mod._write_all = orig  # type: ignore[attr-defined]
    at4 = LocalTier(root, job).steps()
    replay.save(plain_state(5, rank), 5)
    return {"error": err, "at4": at4, "at5": LocalTier(root, job).steps(), "replayed": replay.replayed,
            "loaded": _exact_load(root, job, rank)}


def test_replayed_saves_keep_the_step_committed_everywhere() -> None:
    roots = [tempfile.mkdtemp(prefix="gemini-lost-r0-", dir="/dev/shm"), tempfile.mkdtemp(prefix="gemini-lost-r1-", dir="/dev/shm")]
    try:
        out = run_ranks(_replayed_saves_with_a_failed_record, 2, roots, job="rp")
        assert [o["error"] for o in out] == [None, "TierFullError"], out
        assert [o["at4"] for o in out] == [[3, 4], [3]], out  # node 0 did not evict 3 for its lone 4
        assert [o["at5"] for o in out] == [[3, 5], [3, 5]], out
        assert [o["loaded"] for o in out] == [(5, True), (5, True)], out
        assert out[0]["replayed"] >= 3, out  # the agreement rode in plan replay's own all-reduce
    finally:
        import shutil

        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def test_keep_one_on_one_node_holds_just_the_newest(root: str, launch: Any) -> None:
    """One node: its own record is the whole commit, so keep=1 keeps one step (on several
    nodes it keeps the step known committed everywhere too, see the test above)."""
    launch(1)
    for step in (1, 2, 3, 4):
        _save(root, "k1", step, keep=1)
    tier = LocalTier(root, "k1")
    assert tier.steps() == [4]
    assert len(tier.layout.slot_files(0)) == 2  # the ring is keep + 1 slots
    assert _load(root, "k1")[0] == 4


# ---- one live launch per job id ------------------------------------------------------------------
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from gemini_dcp import GeminiStorageWriter
    w = GeminiStorageWriter(root=sys.argv[1], job_id="shared")
    print("ready", flush=True)
    time.sleep(120)
    """
)


def test_second_live_launch_is_refused_and_a_dead_one_never_blocks(root: str, launch: Any) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, root], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        launch(1)
        with pytest.raises(JobConflictError) as info:
            GeminiStorageWriter(root=root, job_id="shared")
        msg = str(info.value)
        assert f"pid {holder.pid}" in msg and "job_id" in msg, msg
        GeminiStorageWriter(root=root, job_id="other")  # another job id is no conflict
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    w = GeminiStorageWriter(root=root, job_id="shared")  # the killed launch no longer blocks
    dcp.save(plain_state(1), storage_writer=w, checkpoint_id=1)
    assert sorted(os.listdir(Path(root, "shared", "launches"))) == [f"{current_launch().launch_id}.lock"]


def test_default_job_id_warns_once(root: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import gemini_dcp.core.config as config

    monkeypatch.setattr(config, "_warned_default_job", False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with caplog.at_level(logging.WARNING, logger="gemini_dcp.core.config"):
        LocalTier(root)
        LocalTier(root)
    warned = [r for r in caplog.records if "job id 'none'" in r.getMessage()]
    assert len(warned) == 1 and "--rdzv-id" in warned[0].getMessage()


def test_newer_steps_survive_a_new_launch_unless_a_restore_abandoned_them(root: str, launch: Any) -> None:
    launch(1)
    for step in (200, 300):
        _save(root, "t", step)
    launch(2)  # a new run with the same job id, started without restoring
    _save(root, "t", 1)
    assert LocalTier(root, "t").steps() == [1, 200, 300]
    launch(3)  # a run that restores step 1 on purpose: the newer steps belong to an abandoned timeline
    assert _load(root, "t", step=1)[0] == 1
    _save(root, "t", 2)
    assert LocalTier(root, "t").steps() == [1, 2]
    launch(4)  # a restart that restores the newest step abandons nothing
    assert _load(root, "t")[0] == 2
    _save(root, "t", 3)
    assert LocalTier(root, "t").steps() == [2, 3]
    launch(5)  # go back to 2 and skip ahead: the abandoned 3 must not stay as a step to fall back to
    assert _load(root, "t", step=2)[0] == 2
    _save(root, "t", 5)
    assert LocalTier(root, "t").steps() == [2, 5]
    _save(root, "t", 3)  # this launch's own save of the number 3 is not abandoned
    _save(root, "t", 4)
    assert LocalTier(root, "t").steps() == [3, 4, 5]


# ---- a step saved twice -----------------------------------------------------------------------------
def test_same_step_twice_in_one_launch_is_refused_and_replaced_across_launches(
    root: str, launch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    launch(1)
    _save(root, "s", 5, {"model": torch.ones(4)})
    with pytest.raises(BaseException) as info:
        _save(root, "s", 5, {"optim": torch.zeros(4)})
    err = _gemini(info.value)
    assert isinstance(err, InvalidStepError) and "one state dict" in str(err), err
    launch(2)  # after a restart the step may be saved again: the new save replaces the old, logged
    with caplog.at_level(logging.WARNING, logger="gemini_dcp.dcp.writer"):
        _save(root, "s", 5, {"model": torch.full((4,), 2.0)})
    assert any("saved by another launch" in r.getMessage() and "replaces it" in r.getMessage() for r in caplog.records)
    target = {"model": torch.zeros(4)}
    dcp.load(target, storage_reader=GeminiStorageReader(root=root, job_id="s"), checkpoint_id=5)
    assert torch.equal(target["model"], torch.full((4,), 2.0))
    rec = LocalTier(root, "s").record(5)
    assert rec is not None and rec.launch_id == current_launch().launch_id


# ---- step numbers ---------------------------------------------------------------------------------
def test_a_step_beyond_twelve_digits_is_saved_and_found(root: str, launch: Any) -> None:
    launch(1)
    big = 10**13 + 7  # a millisecond timestamp
    _save(root, "big", 5)
    _save(root, "big", big)
    assert LocalTier(root, "big").steps() == [5, big]
    got, target = _load(root, "big")
    assert got == big and target["step"] == big
    assert _load(root, "big", step=big)[0] == big
    from gemini_dcp.ops.housekeeping import collect_garbage

    assert collect_garbage(root, "big", keep=1).kept_steps == [big]
    w = GeminiStorageWriter(root=root, job_id="big")
    with pytest.raises(InvalidStepError, match="64-bit"):
        w.reset(2**63)
    assert not GeminiStorageWriter.validate_checkpoint_id(2**63)
    w.reset(2**63 - 1)


# ---- node identities ------------------------------------------------------------------------------
def _same_node_id(rank: int, world_size: int, root: str, *, job: str) -> dict[str, Any]:
    os.environ["GEMINI_DCP_NODE_ID"] = "node-a"
    try:
        _save(root, job, 1, plain_state(1, rank))
    except BaseException as exc:  # noqa: BLE001
        err = _gemini(exc)
        return {"error": type(err).__name__, "message": str(err), "steps": LocalTier(root, job).steps()}
    return {"error": None, "steps": LocalTier(root, job).steps()}


def test_two_machines_with_one_node_id_are_refused_before_the_commit() -> None:
    roots = [tempfile.mkdtemp(prefix="gemini-lost-a-", dir="/dev/shm"), tempfile.mkdtemp(prefix="gemini-lost-b-", dir="/dev/shm")]
    try:
        out = run_ranks(_same_node_id, 2, roots, job="dup")
        assert all(o["error"] == "ConfigError" and "GEMINI_DCP_NODE_ID" in o["message"] for o in out), out
        assert all(o["steps"] == [] for o in out), out
    finally:
        import shutil

        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


# ---- robustness ---------------------------------------------------------------------------------------
def test_odd_entries_in_steps_do_not_block_saves_or_loads(root: str, launch: Any, caplog: pytest.LogCaptureFixture) -> None:
    launch(1)
    _save(root, "odd", 1)
    steps = Path(root, "odd", "steps")
    (steps / "step-000000000007.rec").mkdir()  # a directory named like a record
    (steps / "step-000000000009.rec").write_bytes(b"not a record")  # an unreadable record
    with caplog.at_level(logging.WARNING, logger="gemini_dcp.local.tier"):
        _save(root, "odd", 2)
        _save(root, "odd", 3)
        assert _load(root, "odd")[0] == 3
    assert sum("step-000000000007.rec" in r.getMessage() for r in caplog.records) == 1
    from gemini_dcp.ops.housekeeping import collect_garbage

    collect_garbage(root, "odd", keep=1)  # gc leaves the odd entries, without a traceback


def test_gc_skips_a_stray_rank_directory(root: str, launch: Any) -> None:
    from gemini_dcp.ops.housekeeping import collect_garbage

    launch(1)
    for step in (1, 2, 3):
        _save(root, "gc", step)
    Path(root, "gc", "ranks", "rank-xyz").mkdir()
    Path(root, "gc", "ranks", "rank-00003").write_text("not a directory")
    report = collect_garbage(root, "gc", keep=1, exclude_pids=[os.getpid()])
    assert report.kept_steps == [3] and report.evicted_steps == [2]


def test_a_rank_that_writes_nothing_needs_no_slot_ring(root: str, launch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import gemini_dcp.commit.slot_pool as wmod  # the space check lives in the slot pool

    launch(1)
    monkeypatch.setattr(wmod, "free_bytes", lambda path: 1 << 20)  # 1 MiB left: less than one 4 MiB slot
    _save(root, "zero", 1, {}, capacity_bytes=1 << 20)
    assert LocalTier(root, "zero").steps() == [1]


def test_replicas_above_the_node_count_warn(root: str, launch: Any, caplog: pytest.LogCaptureFixture) -> None:
    launch(1)
    with caplog.at_level(logging.WARNING, logger="gemini_dcp.dcp.writer"):
        _save(root, "rep", 1, replicas=3)
    assert any("replicas=3 but the job runs on 1 node" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, 0, True, "10"])
def test_timeout_must_be_positive_and_finite(root: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        GeminiStorageWriter(root=root, job_id="to", timeout_s=bad)


@pytest.mark.parametrize("kw", [{"persist_every": 0}, {"persist_every": 2.5}, {"persist_keep": 0}, {"keep": 0}])
def test_bad_options_create_no_directory(root: str, tmp_path: Path, kw: dict[str, Any]) -> None:
    store = tmp_path / "store"
    with pytest.raises(ConfigError):
        GeminiStorageWriter(root=root, job_id="p", persistent=str(store), **kw)
    assert not store.exists() and not Path(root, "p").exists()


def test_no_checkpoint_message_does_not_claim_a_persistent_tier(root: str) -> None:
    from gemini_dcp.errors import CheckpointNotFoundError

    with pytest.raises(BaseException) as info:
        _load(root, "nothing")
    err = _gemini(info.value)
    assert isinstance(err, CheckpointNotFoundError) and "persistent tier included" not in str(err), err


def test_a_writer_collected_while_the_launch_lock_is_taken_does_not_deadlock(root: str, launch: Any) -> None:
    """A writer in a reference cycle is finalized by whatever garbage collection comes next,
    which may run inside hold_launch_lock with its guard held (it hung the suite once)."""
    import gemini_dcp.local.launch_lock as lt

    launch(1)
    w = GeminiStorageWriter(root=root, job_id="cyc")
    w.cycle = w  # type: ignore[attr-defined]
    del w
    with lt._held_guard:
        gc.collect()  # the finalizer runs here, with the guard held by this thread
    w2 = GeminiStorageWriter(root=root, job_id="cyc")  # applies the queued release
    job_dir = Path(root, "cyc")
    assert lt._held[job_dir].users == 1
    del w2
    assert job_dir not in lt._held  # the last writer gone: the lock is dropped
