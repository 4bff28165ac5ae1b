"""Issue 4: the persistent tier — background drain to fsspec stores in stock DCP layout, restore fallback.

Real drains (detached drain processes, or the in-process thread for memory://),
real stores (file:// tmp dirs, memory://, s3:// on a loopback moto server),
real stock ``dcp.load`` with no gemini_dcp reader involved.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks, run_until_death
from workloads import COLS, ROWS, MetadataHidingPlanner, dtensor_state, full_weight, plain_state

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, PersistentTierError, find_gemini_error
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.persistent.drain import drain_status, server_pid, wait_idle
from gemini_dcp.persistent.store import PersistentTier


@pytest.fixture(autouse=True)
def _short_lived_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    # Drain processes started by these tests (and by their spawned ranks) exit 3 s after their work.
    monkeypatch.setenv("GEMINI_DCP_DRAIN_IDLE_S", "3")


@pytest.fixture
def root() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-ptest-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    p = tmp_path / "store"
    p.mkdir()
    return p


def _equal_plain(got: dict[str, Any], step: int) -> bool:
    want = plain_state(step)
    return (
        all(torch.equal(got[k], want[k]) for k in ("w", "i", "rng"))
        and got["step"] == step
        and got["meta"] == want["meta"]
    )


def _persist_dir(root: str, job: str) -> Path:
    return LocalTier(root, job).layout.persist_dir


# ---- single process: file:// through the detached drain process --------------------------------
def test_drain_to_file_store_loads_with_stock_dcp(root: str, store: Path) -> None:
    url = f"file://{store}"
    job = "f"
    for step in (1, 2, 3, 4, 6):
        w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=2, persist_keep=2)
        dcp.save(plain_state(step), storage_writer=w, checkpoint_id=step)
        assert wait_idle(_persist_dir(root, job), 180)
    pt = PersistentTier(url, job)
    # every 2nd step drained; persist_keep=2 kept the newest two complete ones
    assert pt.committed_steps() == [4, 6]
    step_dir = store / job / "step-6"
    assert sorted(p.name for p in step_dir.iterdir()) == [".gemini", ".metadata", "__0_0.distcp"]
    # stock DCP, no gemini_dcp reader: a plain path (FileSystemReader) and a file:// URL (FsspecReader)
    for ckpt in (str(step_dir), f"file://{step_dir}"):
        sd = plain_state(0)
        dcp.load(sd, checkpoint_id=ckpt)
        assert _equal_plain(sd, 6)
    status = drain_status(_persist_dir(root, job))["steps"]
    assert status["6"]["state"] == "done" and "1" not in status and "3" not in status
    # the same save of step 6 again by the next launch (a torchrun restart retrying it): the store
    # already has it, nothing is rewritten. (A second save of one step within a launch is refused.)
    mtime = (step_dir / ".metadata").stat().st_mtime_ns
    from gemini_dcp.transport import launch as launch_mod

    restart = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RESTART_COUNT": "1"}
    saved_env = {k: os.environ.get(k) for k in restart}
    os.environ.update(restart)
    launch_mod.cache_clear()
    try:
        w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=2, persist_keep=2)
        dcp.save(plain_state(6), storage_writer=w, checkpoint_id=6)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        launch_mod.cache_clear()
    assert wait_idle(_persist_dir(root, job), 180)
    assert "already holds" in drain_status(_persist_dir(root, job))["steps"]["6"]["detail"]
    assert (step_dir / ".metadata").stat().st_mtime_ns == mtime
    # (how long a save takes beside a drain is a benchmark's question, benchmarks/bench_persistent.py: no
    # wall-clock bound here, a loaded host would fail it)


# ---- kill the drain midway: nothing torn, resumed after "restart" ------------------------------
def _big_state(step: int) -> dict[str, Any]:
    return {f"t{i}": torch.full((64, 1024), float(step * 10 + i)) for i in range(8)}  # 8 x 256 KiB


def _kill_drain_midway(data: Path, pdir: Path, nbytes: int) -> None:
    """SIGKILL the (throttled) drain server once ``data`` has grown past ``nbytes`` in the store."""
    deadline = time.monotonic() + 180
    while not (data.exists() and data.stat().st_size > nbytes):
        assert time.monotonic() < deadline, drain_status(pdir)
        time.sleep(0.05)
    pid = server_pid(pdir)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def test_sigkill_during_drain_then_restart_resumes(root: str, store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"file://{store}"
    job = "k"
    pdir = _persist_dir(root, job)
    monkeypatch.setenv("GEMINI_DCP_DRAIN_THROTTLE_BPS", str(256 << 10))  # ~8 s for the whole step
    monkeypatch.setenv("GEMINI_DCP_DRAIN_BRIDGE", "0")  # the drain process uploads (and is killed), not a bridge
    w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=3, keep=1)
    dcp.save(_big_state(3), storage_writer=w, checkpoint_id=3)
    _kill_drain_midway(store / job / "step-3" / "__0_0.distcp", pdir, 300_000)
    time.sleep(0.2)
    # torn drain: data is there, .metadata is not, so no reader takes it as a checkpoint
    assert not (store / job / "step-3" / ".metadata").exists()
    assert PersistentTier(url, job).committed_steps() == []
    with pytest.raises(BaseException, match="metadata"):  # DCP's CheckpointException is a BaseException
        dcp.load(_big_state(0), checkpoint_id=str(store / job / "step-3"))
    assert drain_status(pdir)["pending"] == [3]
    # training goes on: with keep=1, steps 4 and 5 overwrite step 3's memory slot
    monkeypatch.delenv("GEMINI_DCP_DRAIN_THROTTLE_BPS")
    for step in (4, 5):
        dcp.save(_big_state(step), storage_writer=GeminiStorageWriter(root=root, job_id=job, keep=1), checkpoint_id=step)
    assert LocalTier(root, job).steps() == [5]
    # "restart": a writer constructed again resumes the pending drain from its staged copy
    GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=3, keep=1)
    assert wait_idle(pdir, 180), drain_status(pdir)
    assert PersistentTier(url, job).committed_steps() == [3]
    sd = _big_state(0)
    dcp.load(sd, checkpoint_id=str(store / job / "step-3"))
    assert all(torch.equal(sd[k], v) for k, v in _big_state(3).items())


def _wait_lock_released(pdir: Path, timeout_s: float = 30.0) -> None:
    import fcntl

    deadline = time.monotonic() + timeout_s
    while True:
        fd = os.open(pdir / "daemon.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            assert time.monotonic() < deadline, "the killed drain server still holds its lock"
        finally:
            os.close(fd)
        time.sleep(0.02)


def test_restart_while_the_killed_drain_server_still_holds_its_lock_starts_a_standby(root: str, store: Path) -> None:
    """A SIGKILLed server keeps its flock until the kernel has closed its files, which can
    outlast a torchrun restart. The restarted writer must not leave the pending drain to the
    next due save: a standby server waits for the lock and serves as soon as it is free.
    The dying holder is played by this process, which holds the real lock on the real file."""
    import fcntl

    url = f"file://{store}"
    job = "standby"
    pdir = _persist_dir(root, job)
    pdir.mkdir(parents=True, exist_ok=True)
    held = os.open(pdir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=3)
        dcp.save(_big_state(3), storage_writer=w, checkpoint_id=3)  # requests a drain; the lock is held
        assert drain_status(pdir)["pending"] == [3]
        # "restart": a writer constructed again resumes; with the lock held it starts a standby
        GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=3)
        GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=3)  # a second finds one waiting
        deadline = time.monotonic() + 60
        while not (pdir / "drain.log").exists() or "standing by" not in (pdir / "drain.log").read_text():
            assert time.monotonic() < deadline, "no standby drain server started"
            time.sleep(0.05)
        time.sleep(0.5)
        assert drain_status(pdir)["pending"] == [3]  # nothing is served while the lock is held
    finally:
        os.close(held)  # the dying server is gone
    assert wait_idle(pdir, 180), drain_status(pdir)
    assert PersistentTier(url, job).committed_steps() == [3]
    log = (pdir / "drain.log").read_text()
    assert log.count("standing by") == 1 and "taken over" in log
    sd = _big_state(0)
    dcp.load(sd, checkpoint_id=str(store / job / "step-3"))
    assert all(torch.equal(sd[k], v) for k, v in _big_state(3).items())


def test_drain_of_a_record_completed_in_finish_resumes_after_its_step_was_evicted(
    root: str, store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{store}"
    job = "late"
    pdir = _persist_dir(root, job)
    monkeypatch.setenv("GEMINI_DCP_DRAIN_THROTTLE_BPS", str(256 << 10))
    monkeypatch.setenv("GEMINI_DCP_DRAIN_BRIDGE", "0")  # the drain process uploads (and is killed), not a bridge
    w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=3, keep=1)
    dcp.save(_big_state(3), storage_writer=w, checkpoint_id=3, planner=MetadataHidingPlanner())
    assert LocalTier(root, job).record(3).complete  # type: ignore[union-attr]
    _kill_drain_midway(store / job / "step-3" / "__0_0.distcp", pdir, 100_000)
    _wait_lock_released(pdir)  # a dying server holds its lock until the kernel has closed its files
    monkeypatch.delenv("GEMINI_DCP_DRAIN_THROTTLE_BPS")
    for step in (4, 5):  # keep=1: step 3's record leaves the tier; only the staged copy remains
        dcp.save(_big_state(step), storage_writer=GeminiStorageWriter(root=root, job_id=job, keep=1), checkpoint_id=step)
    assert LocalTier(root, job).steps() == [5]
    GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=3, keep=1)  # restart resumes
    assert wait_idle(pdir, 180), drain_status(pdir)
    assert PersistentTier(url, job).committed_steps() == [3]
    sd = _big_state(0)
    dcp.load(sd, checkpoint_id=str(store / job / "step-3"))
    assert all(torch.equal(sd[k], v) for k, v in _big_state(3).items())


# ---- memory:// (in-process drain thread) + restore with every memory tier wiped --------------------
def _odd_state(step: int) -> dict[str, Any]:
    """plain_state plus the awkward tensors: empty, 0-d bfloat16, bool, non-contiguous."""
    sd = plain_state(step)
    sd["odd"] = {
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(step + 0.5, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, step % 2 == 0]),
        "strided": torch.arange(40, dtype=torch.int16).reshape(5, 8).t() + step,
    }
    return sd


def _equal_odd(got: dict[str, Any], step: int) -> bool:
    want = _odd_state(step)["odd"]
    return _equal_plain(got, step) and all(
        torch.equal(got["odd"][k], want[k]) and got["odd"][k].dtype == want[k].dtype for k in want
    )


def test_memory_store_and_restore_after_memory_wiped(root: str) -> None:
    url = f"memory://gemini-test-{os.getpid()}"
    job = "m"
    for step in (5, 10):
        w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=5)
        dcp.save(_odd_state(step), storage_writer=w, checkpoint_id=step)
        assert w._drainer is not None and w._drainer.mode == "thread"
        assert w._drainer.wait(120)
    pt = PersistentTier(url, job)
    assert pt.committed_steps() == [5, 10]
    sd = _odd_state(0)
    dcp.load(sd, checkpoint_id=pt.step_url(10))  # stock FsspecReader on memory://
    assert _equal_odd(sd, 10)
    LocalTier(root, job).remove_job()  # every memory tier lost
    sd = _odd_state(0)
    r = GeminiStorageReader(root=root, job_id=job, persistent=url)
    dcp.load(sd, storage_reader=r)
    assert r.restored_step == 10 and _equal_odd(sd, 10)
    assert r.restored_from["persistent"] > 0 and r.restored_from["local"] == 0
    # an older step on request, still from the store
    sd = _odd_state(0)
    r = GeminiStorageReader(root=root, job_id=job, persistent=url)
    dcp.load(sd, storage_reader=r, checkpoint_id=5)
    assert r.restored_step == 5 and _equal_odd(sd, 5)


def test_corrupt_object_in_store_is_detected(root: str) -> None:
    url = f"memory://gemini-corrupt-{os.getpid()}"
    w = GeminiStorageWriter(root=root, job_id="c", persistent=url, persist_every=1)
    dcp.save(plain_state(1), storage_writer=w, checkpoint_id=1)
    assert w._drainer is not None and w._drainer.wait(120)
    pt = PersistentTier(url, "c")
    md = pt.read_metadata(1)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    path = f"{pt.step_path(1)}/{info.relative_path}"
    blob = bytearray(pt.fs.cat_file(path))
    pos = bytes(blob).find(plain_state(1)["w"].numpy().tobytes(), info.offset)  # the tensor's data record
    assert info.offset < pos < info.offset + info.length
    blob[pos + 5] ^= 0xFF
    pt.fs.pipe_file(path, bytes(blob))
    LocalTier(root, "c").remove_job()
    with pytest.raises(BaseException) as ei:
        dcp.load(plain_state(0), storage_reader=GeminiStorageReader(root=root, job_id="c", persistent=url))
    err = find_gemini_error(ei.value)
    assert isinstance(err, PersistentTierError) and "checksum" in str(err), ei.value


# ---- retention ---------------------------------------------------------------------------------
def test_retention_keep_last_and_every_nth(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    pt = PersistentTier(url, "r", keep=2, keep_every=4, writable=True)
    for s in range(1, 10):
        pt.step_dir(s).put_bytes("__0_0.distcp", b"x")
        if s != 7:  # step 7: a drain that never completed
            pt.step_dir(s).put_bytes(".metadata", b"m")
    pt.step_dir(12).put_bytes("__0_0.distcp", b"x")  # newer, still being drained
    deleted = pt.apply_retention(protect={3})
    assert sorted(pt.committed_steps()) == [3, 4, 8, 9]
    assert 7 in deleted and 12 not in deleted and pt.all_steps() == [3, 4, 8, 9, 12]
    pt1 = PersistentTier(url, "r", keep=1, writable=True)
    pt1.apply_retention()
    assert pt1.committed_steps() == [9]  # never the newest complete step


# ---- bad configuration fails at construction, not at step 10,000 -----------------------------------
def test_bad_urls_fail_at_construction(root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PersistentTierError, match="protocol 'nope'"):
        GeminiStorageWriter(root=root, job_id="b", persistent="nope://bucket/x")
    with pytest.raises(PersistentTierError, match="persistent="):
        GeminiStorageReader(root=root, job_id="b", persistent="nope://bucket/x")
    # no permission to write
    if os.geteuid() == 0:
        denied = "file:///sys/gemini-dcp-test"  # read-only for everyone, root included
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        denied = f"file://{ro}/ckpt"
    with pytest.raises(PersistentTierError, match="no permission|cannot be created"):
        GeminiStorageWriter(root=root, job_id="b", persistent=denied)
    # missing credentials (s3 through s3fs; the endpoint is a closed loopback port, nothing leaves the host)
    pytest.importorskip("s3fs")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    import fsspec

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{_free_port()}", "skip_instance_cache": True})
    with pytest.raises(PersistentTierError, match="missing credentials"):
        GeminiStorageWriter(root=root, job_id="b", persistent="s3://bucket/ckpt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 2 ranks on 2 simulated nodes: parallel per-node drains, worker group killed, mixed restore -----
def _save_then_die(rank: int, world_size: int, root: str, *, job: str, url: str) -> None:
    for step in (1, 2):
        w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=2)
        dcp.save(dtensor_state(step, world_size), storage_writer=w, checkpoint_id=step)
    os.kill(os.getpid(), signal.SIGKILL)  # torchrun kills the group; the drains must go on


def _restore_checks(rank: int, world_size: int, root: str, *, job: str, url: str, store: str, other_root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from workloads import load_and_check

    out: dict[str, Any] = {}
    # node 1's memory is gone: node 0 serves its shards from memory, node 1 from the store (same step)
    out["mixed"] = load_and_check(rank, world_size, root, job=job, persistent=url)
    dist.barrier()
    if rank == 0:
        LocalTier(root, job).remove_job()  # now every memory copy is gone
    dist.barrier()
    out["persistent"] = load_and_check(rank, world_size, root, job=job, persistent=url)
    # stock DCP reading the drained step into DTensors, no gemini_dcp reader
    target = dtensor_state(0, world_size)
    for v in target["model"].values():
        v.to_local().zero_()
    dcp.load(target, checkpoint_id=f"{store}/{job}/step-2")
    want = dtensor_state(2, world_size)
    out["stock"] = all(torch.equal(target["model"][k].to_local(), want["model"][k].to_local()) for k in ("w", "b"))
    out["stock"] = out["stock"] and target["step"] == 2
    return out


@pytest.mark.slow
def test_two_nodes_drain_in_parallel_and_restore(tmp_path: Path) -> None:
    roots = [tempfile.mkdtemp(prefix=f"gemini-pnode{i}-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None) for i in range(2)]
    store = tmp_path / "store"
    url = f"file://{store}"
    job = "n"
    try:
        codes = run_until_death(_save_then_die, 2, roots, job=job, url=url)
        assert any(c == -signal.SIGKILL for c in codes), codes
        pt = PersistentTier(url, job)
        assert pt.wait_for_step(2, timeout_s=240), [drain_status(_persist_dir(r, job)) for r in roots]
        step_dir = store / job / "step-2"
        # each node wrote its own rank's file and part marker
        assert sorted(p.name for p in step_dir.glob("__*")) == ["__0_0.distcp", "__1_0.distcp"]
        assert len(list((step_dir / ".gemini").glob("part-*.pkl"))) == 2
        assert pt.committed_steps() == [2]
        # stock DCP in a plain process: the sharded save consolidates into plain tensors
        sd = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.float64)}, "step": 0}
        dcp.load(sd, checkpoint_id=str(step_dir))
        assert torch.equal(sd["model"]["w"], full_weight(2)) and sd["step"] == 2
        assert torch.equal(sd["model"]["b"], torch.arange(COLS, dtype=torch.float64) + 2)
        # node 1 loses its memory; then (inside) node 0 too
        LocalTier(roots[1], job).remove_job()
        out = run_ranks(_restore_checks, 2, roots, job=job, url=url, store=str(store), other_root=roots[1])
        for o in out:
            assert o["mixed"]["ok"] and o["mixed"]["step"] == 2, o
            assert o["persistent"]["ok"] and o["persistent"]["step"] == 2, o
            assert o["stock"], o
        mixed, pers = out[0]["mixed"]["from"], out[0]["persistent"]["from"]
        assert mixed["local"] > 0 and mixed["persistent"] > 0, mixed
        assert pers["persistent"] > 0 and pers["local"] == 0 and pers["peer"] == 0, pers
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


# ---- s3:// against a loopback moto server -----------------------------------------------------------
@pytest.fixture
def s3_url(monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "FSSPEC_S3_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)  # the drain process reads these
    import fsspec

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})  # this process (conf read at import)
    fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("ckpt")
    try:
        yield "s3://ckpt/runs"
    finally:
        server.stop()


@pytest.mark.slow
def test_s3_drain_stock_load_and_restore(root: str, s3_url: str) -> None:
    job = "s"
    w = GeminiStorageWriter(root=root, job_id=job, persistent=s3_url, persist_every=1)
    dcp.save(plain_state(7), storage_writer=w, checkpoint_id=7)
    assert wait_idle(_persist_dir(root, job), 180), drain_status(_persist_dir(root, job))
    pt = PersistentTier(s3_url, job)
    assert pt.committed_steps() == [7]
    sd = plain_state(0)
    dcp.load(sd, checkpoint_id=pt.step_url(7))  # stock FsspecReader on s3://
    assert _equal_plain(sd, 7)
    LocalTier(root, job).remove_job()
    sd = plain_state(0)
    r = GeminiStorageReader(root=root, job_id=job, persistent=s3_url)
    dcp.load(sd, storage_reader=r)
    assert r.restored_step == 7 and r.restored_from["persistent"] > 0 and _equal_plain(sd, 7)
    with pytest.raises(PersistentTierError, match="does not exist|cannot be created"):
        GeminiStorageWriter(root=root, job_id=job, persistent="s3://no-such-bucket/x")
