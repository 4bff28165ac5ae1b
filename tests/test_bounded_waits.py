"""Issue 19, bounded waits and the persistent store's side files.

* A store that accepts connections but never answers (a loopback "black hole" used as the
  s3 endpoint) fails the writer and the reader with PersistentTierError within about
  ``timeout_s``; a drain upload to a store that hangs midway ends with a failed status.
* Planted ``index.pkl`` / ``part-*.pkl`` / ``progress.pkl`` that would run code are refused
  (their marker file is never created) and no load goes on without checksums.
* A peer that stalls inside a save beyond ``timeout_s`` makes the survivor raise
  RestartRequiredError (a PeerError) within the bound; the next save raises it at once; and
  a writer with ``timeout_s=2`` made after one with 300 in the same process honours 2.
"""

from __future__ import annotations

import builtins
import os
import pickle
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.memory import MemoryFileSystem
from mp_utils import run_ranks
from workloads import plain_state

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, find_gemini_error
from gemini_dcp.errors import PeerError, PersistentTierError, RestartRequiredError, UntrustedDataError
from gemini_dcp.persistent.side_files import INDEX, SIDE_DIR
from gemini_dcp.persistent.step_dir import StepDir
from gemini_dcp.persistent.store import PersistentTier
from gemini_dcp.persistent.store_calls import PersistentTimeoutError

SLACK_S = 4.0  # scheduling slack on a loaded 2-core machine


@pytest.fixture
def root() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-bw-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- a store that accepts connections and never answers ---------------------------------------------
@pytest.fixture
def black_hole(monkeypatch: pytest.MonkeyPatch) -> Any:
    """s3:// pointed at a loopback TCP server that accepts and reads, but never answers."""
    pytest.importorskip("s3fs")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)  # kept open, never answered

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    endpoint = f"http://127.0.0.1:{srv.getsockname()[1]}"
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint, "skip_instance_cache": True})
    yield f"s3://bucket-{uuid.uuid4().hex[:8]}/ckpt"
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    srv.close()


def test_writer_constructor_fails_on_black_hole_store(root: str, black_hole: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(PersistentTierError) as ei:
        GeminiStorageWriter(root=root, job_id="bh", persistent=black_hole, timeout_s=2)
    waited = time.monotonic() - t0
    assert waited < 2 + SLACK_S, waited
    assert isinstance(ei.value, PersistentTimeoutError)
    msg = str(ei.value)
    assert black_hole in msg and "within 2 s" in msg and "timeout_s" in msg


def test_reader_fails_on_black_hole_store(root: str, black_hole: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(PersistentTierError) as ei:
        GeminiStorageReader(root=root, job_id="bh", persistent=black_hole, timeout_s=2)
    assert time.monotonic() - t0 < 2 + SLACK_S
    assert isinstance(ei.value, PersistentTimeoutError) and black_hole in str(ei.value)


def test_store_calls_after_the_probe_are_bounded(black_hole: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier whose store stops answering after construction: listing and reads overrun, never hang."""
    monkeypatch.setattr(PersistentTier, "_probe", lambda self: None)
    pt = PersistentTier(black_hole, "bh", timeout_s=1.5)
    for call in (pt.committed_steps, lambda: pt.read_metadata(3)):
        t0 = time.monotonic()
        with pytest.raises(PersistentTimeoutError):
            call()
        assert time.monotonic() - t0 < 1.5 + SLACK_S


def test_timeout_must_be_positive_and_finite() -> None:
    from gemini_dcp.errors import ConfigError

    for bad in (0, -1, float("inf"), float("nan"), "5", True):
        with pytest.raises(ConfigError):
            PersistentTier("memory://bw-timeout", "j", timeout_s=bad)


# ---- a drain upload to a store that hangs midway ------------------------------------------------------
class _HangingFS(MemoryFileSystem):
    """memory:// whose data-file uploads block (until released) once ``hang`` is set."""

    protocol = "gemhang"
    hang = threading.Event()
    release = threading.Event()

    def open(self, path: str, mode: str = "rb", **kw: Any) -> Any:  # type: ignore[override]
        f = super().open(path, mode, **kw)
        if "w" in mode and path.endswith(".distcp") and self.hang.is_set():
            return _HangingFile(f, self.release)
        return f


class _HangingFile:
    def __init__(self, f: Any, release: threading.Event) -> None:
        self._f, self._release = f, release

    def write(self, data: Any) -> int:
        self._release.wait()
        return self._f.write(data)

    def close(self) -> None:
        self._release.wait()
        self._f.close()

    def discard(self) -> None:
        pass


def test_drain_upload_to_hanging_store_ends_failed(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gemini_dcp.persistent.drain import drain_status

    fsspec.register_implementation("gemhang", _HangingFS, clobber=True)
    monkeypatch.setenv("GEMINI_DCP_DRAIN_MODE", "thread")  # the store lives in this process
    monkeypatch.setenv("GEMINI_DCP_DRAIN_ATTEMPTS", "1")
    url = f"gemhang://bw-{uuid.uuid4().hex[:8]}"
    _HangingFS.hang.clear()
    _HangingFS.release.clear()
    try:
        w = GeminiStorageWriter(root=root, job_id="hang", persistent=url, persist_every=1, timeout_s=2)
        _HangingFS.hang.set()  # the probe went through; the upload will not
        t0 = time.monotonic()
        dcp.save(plain_state(1), storage_writer=w, checkpoint_id=1)
        assert w._drainer is not None
        assert w._drainer.wait(2 + 3 * SLACK_S), "the drain hung on the store"
        waited = time.monotonic() - t0
        entry = drain_status(w.tier.layout.persist_dir)["steps"]["1"]
        assert entry["state"] == "abandoned", entry
        assert "did not finish within 2 s" in entry["reason"] and url in entry["reason"], entry
        assert waited < 2 + 3 * SLACK_S
        assert PersistentTier(url, "hang").committed_steps() == []
    finally:
        _HangingFS.release.set()


# ---- planted side files -----------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates ``path`` (stands for arbitrary code)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> Any:
        return (builtins.open, (self.path, "w"))


def _drained_step(root: str, url: str, job: str, step: int, monkeypatch: pytest.MonkeyPatch) -> PersistentTier:
    monkeypatch.setenv("GEMINI_DCP_DRAIN_MODE", "thread")
    w = GeminiStorageWriter(root=root, job_id=job, persistent=url, persist_every=1)
    dcp.save(plain_state(step), storage_writer=w, checkpoint_id=step)
    assert w._drainer is not None and w._drainer.wait(60)
    pt = PersistentTier(url, job)
    assert pt.committed_steps() == [step]
    return pt


def test_planted_index_is_refused_and_load_does_not_go_on_unverified(
    root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"memory://bw-{uuid.uuid4().hex[:8]}"
    pt = _drained_step(root, url, "idx", 4, monkeypatch)
    assert pt.read_index(4) is not None  # ours: readable
    marker = tmp_path / "index-ran"
    pt.fs.pipe_file(f"{pt.step_path(4)}/{SIDE_DIR}/{INDEX}", pickle.dumps(_Payload(marker)))
    fresh = PersistentTier(url, "idx")
    with pytest.raises(UntrustedDataError) as ei:
        fresh.read_index(4)
    assert isinstance(ei.value, PersistentTierError) and INDEX in str(ei.value)
    # A restore that falls back to the store (this node's memory is empty) fails; it never loads unverified.
    empty = tempfile.mkdtemp(prefix="gemini-bw-empty-", dir=os.path.dirname(root))
    try:
        sd = plain_state(0)
        with pytest.raises(BaseException) as ei2:  # noqa: PT011 - DCP wraps ours (CheckpointException)
            dcp.load(sd, storage_reader=GeminiStorageReader(root=empty, job_id="idx", persistent=url))
        assert isinstance(find_gemini_error(ei2.value), UntrustedDataError), ei2.value
        assert torch.equal(sd["w"], plain_state(0)["w"])
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    assert not marker.exists()
    # Garbage (not a pickle) is an error too, never "no checksums".
    pt.fs.pipe_file(f"{pt.step_path(4)}/{SIDE_DIR}/{INDEX}", b"\x00not a pickle")
    with pytest.raises(PersistentTierError):
        PersistentTier(url, "idx").read_index(4)


def test_planted_part_marker_is_refused(tmp_path: Path) -> None:
    from gemini_dcp.persistent.stock_format import try_finalize

    store = tmp_path / "store"
    sd = StepDir.from_url(str(store / "job" / "step-9"))
    marker = tmp_path / "part-ran"
    sd.put_bytes(f"{SIDE_DIR}/part-deadbeef.pkl", pickle.dumps(_Payload(marker)))
    with pytest.raises(UntrustedDataError) as ei:
        sd.read_markers()
    assert "part-deadbeef.pkl" in str(ei.value)
    with pytest.raises(UntrustedDataError):
        try_finalize(sd, 9, None, "fp", [], "job")  # type: ignore[arg-type]
    assert not marker.exists()
    assert not sd.is_complete()


def test_planted_progress_is_refused_and_abandons_the_drain(tmp_path: Path) -> None:
    from gemini_dcp.persistent.drain.server import classify
    from gemini_dcp.persistent.drain.upload import load_legacy_progress

    d = tmp_path / "stage" / "step-000000000001"
    d.mkdir(parents=True)
    marker = tmp_path / "progress-ran"
    (d / "progress.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UntrustedDataError) as ei:
        load_legacy_progress(d)
    assert not marker.exists()
    assert classify(ei.value)[0] == "abandon"
    (d / "progress.pkl").write_bytes(pickle.dumps(["not", "a", "dict"]))
    with pytest.raises(UntrustedDataError):
        load_legacy_progress(d)
    (d / "progress.pkl").unlink()
    assert load_legacy_progress(d) == {"begun": False, "files": {}}


# ---- peers: bounded and clear -----------------------------------------------------------------------
def _stall_scenario(rank: int, world_size: int, root: str, stall_s: float) -> dict[str, Any]:
    sd = {f"w{rank}": torch.full((64, 8), float(rank)), "step": 0}
    # First a writer with a long timeout makes its control group (timeout 300 s) ...
    w300 = GeminiStorageWriter(root=root, job_id="stall", replicas=2, timeout_s=300)
    dcp.save(sd, storage_writer=w300, checkpoint_id=1)
    # ... then one with timeout_s=2 must get a group of its own, which waits 2 s, not 300.
    w2 = GeminiStorageWriter(root=root, job_id="stall", replicas=2, timeout_s=2)
    if rank == 1:
        inner = w2._write_local

        def stalled(*args: Any, **kw: Any) -> Any:
            time.sleep(stall_s)  # a peer stuck inside the save (GC pause, slow disk, hung kernel)
            return inner(*args, **kw)

        w2._write_local = stalled  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for name, step in (("stalled", 2), ("next", 3)):
        t0 = time.monotonic()
        try:
            dcp.save(sd, storage_writer=w2, checkpoint_id=step)
            out[name] = ("no error", "", time.monotonic() - t0)
        except BaseException as exc:  # noqa: BLE001 - classified by the test (DCP raises CheckpointException)
            gem = find_gemini_error(exc)
            out[name] = (type(gem).__name__ if gem else type(exc).__name__, str(gem or exc), time.monotonic() - t0)
        if rank == 1 and name == "stalled":
            w2._write_local = inner  # type: ignore[method-assign]
    from gemini_dcp.transport.comm import broken_reason

    out["own_reason"] = broken_reason()  # what broke this rank's control group, in its own words
    return out


@pytest.fixture(scope="module")
def stall_results() -> list[dict[str, Any]]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    roots = [tempfile.mkdtemp(prefix=f"gemini-bw-node{i}-", dir=base) for i in range(2)]
    try:
        yield run_ranks(_stall_scenario, 2, roots, timeout=120, stall_s=6.0)
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def test_stalled_peer_raises_restart_required_within_bound(stall_results: list[dict[str, Any]]) -> None:
    kind, msg, took = stall_results[0]["stalled"]  # rank 0: the survivor
    assert kind == "RestartRequiredError", (kind, msg)
    assert issubclass(RestartRequiredError, PersistentTierError.__mro__[1])  # a GeminiError ...
    assert "restart" in msg.lower() and "all_gather_object" in msg, msg
    # Bound: the stall (DCP's own gather waits for the stalled rank on the training group) + timeout_s.
    assert took < 6.0 + 2 + SLACK_S, took
    kind1, msg1, _ = stall_results[1]["stalled"]
    assert kind1 == "RestartRequiredError", (kind1, msg1)


def test_next_save_after_broken_group_raises_at_once(stall_results: list[dict[str, Any]]) -> None:
    for r in stall_results:
        kind, msg, took = r["next"]
        assert kind == "RestartRequiredError", (kind, msg)
        assert "broke earlier" in msg and "Restart the job" in msg, msg
        assert took < SLACK_S, took


def test_writer_timeout_honoured_after_longer_one(stall_results: list[dict[str, Any]]) -> None:
    msg = stall_results[0]["own_reason"]  # the survivor timed out waiting for the stalled rank
    assert msg and "timeout_s=2" in msg, stall_results
    waited = float(re.search(r"after ([0-9.]+) s", msg).group(1))  # type: ignore[union-attr]
    assert 1.5 <= waited < 2 + SLACK_S, msg


def _degrade_scenario(rank: int, world_size: int, root: str, stall_s: float) -> dict[str, Any]:
    import gemini_dcp.peer.push as peer

    sd = {f"w{rank}": torch.full((64, 8), float(rank)), "step": 0}
    w = GeminiStorageWriter(root=root, job_id="degrade", replicas=2, timeout_s=3, on_peer_failure="degrade")
    dcp.save(sd, storage_writer=w, checkpoint_id=1)
    out: dict[str, Any] = {"1": w.commit.last_replication.get("degraded")}
    routes = peer.replication_routes
    if rank == 1:

        def stalled(*args: Any, **kw: Any) -> Any:
            time.sleep(stall_s)  # stuck inside the replication, past the receiver's timeout_s
            return routes(*args, **kw)

        peer.replication_routes = stalled  # type: ignore[assignment]
    t0 = time.monotonic()
    try:
        dcp.save(sd, storage_writer=w, checkpoint_id=2)
        out["2"] = (w.commit.last_replication.get("degraded"), w.commit.last_committed_step, time.monotonic() - t0)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out["2"] = (repr(find_gemini_error(exc) or exc), None, time.monotonic() - t0)
    peer.replication_routes = routes  # type: ignore[assignment]
    try:
        dcp.save(sd, storage_writer=w, checkpoint_id=3)  # on the replaced group: replicated in full again
        out["3"] = (w.commit.last_replication.get("degraded"), w.commit.last_committed_step)
    except BaseException as exc:  # noqa: BLE001
        out["3"] = (repr(find_gemini_error(exc) or exc), None)
    return out


def test_degrade_commits_on_every_rank_after_a_peer_transfer_timeout() -> None:
    """on_peer_failure="degrade": a transfer that timed out (gloo then closes the group) is agreed
    over the store, the step commits on every rank with fewer replicas, and the next save runs
    on a fresh control group with full replication."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    roots = [tempfile.mkdtemp(prefix=f"gemini-bw-deg{i}-", dir=base) for i in range(2)]
    try:
        res = run_ranks(_degrade_scenario, 2, roots, timeout=120, stall_s=4.5)
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
    for r in res:
        assert r["1"] is False, res
        degraded, committed, took = r["2"]
        assert degraded is True and committed == 2, res
        assert took < 4.5 + 3 + SLACK_S, res
        assert r["3"] == (False, 3), res


# ---- the store's host frozen mid-replication ------------------------------------------------------
FROZEN_TIMEOUT_S = 3.0


def _frozen_store_host_rank(rank: int, world_size: int, port: int, root: str, out_dir: str,
                            on_peer_failure: str) -> None:
    """One rank of the frozen-store-host scenario (a spawned process): step 1 saves normally;
    at step 2 rank 0, which also serves the default TCPStore, SIGSTOPs itself mid-replication.
    Ranks 1 and 2 write what step 2 raised, and how long it took, to ``<out_dir>/<rank>.json``."""
    import datetime
    import json

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", GEMINI_DCP_FAULT="replicate.mid_send@2:SIGSTOP/0",
    )
    torch.set_num_threads(1)
    # The training group waits timeout_s too (DCP's own gathers run on it), as in the soak.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=FROZEN_TIMEOUT_S))
    sd = {f"w{rank}": torch.full((256, 16), float(rank)), "step": 0}
    w = GeminiStorageWriter(root=root, job_id="frozen-host", replicas=2, timeout_s=FROZEN_TIMEOUT_S,
                            on_peer_failure=on_peer_failure)
    result: dict[str, Any] = {}
    dcp.save(sd, storage_writer=w, checkpoint_id=1)
    t0 = time.monotonic()
    try:
        dcp.save(sd, storage_writer=w, checkpoint_id=2)  # rank 0 stops inside this one
        result.update(error="no error", message="")
    except BaseException as exc:  # noqa: BLE001 - classified by the test (DCP raises CheckpointException)
        gem = find_gemini_error(exc)
        result.update(error=type(gem).__name__ if gem else type(exc).__name__, message=str(gem or exc),
                      peer_error=isinstance(gem, PeerError))
    from gemini_dcp.transport.comm import broken_reason

    # DCP's own gather on the training group follows write_data: with rank 0 frozen it fails with
    # that group's raw timeout, which then hides the writer's error; the reason stays on record here.
    result.update(seconds=time.monotonic() - t0, committed=w.commit.last_committed_step, own_reason=broken_reason())
    tmp = Path(out_dir, f"{rank}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, Path(out_dir, f"{rank}.json"))
    # No destroy_process_group: the process serving the store is frozen (the soak covers teardown).
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_peer_failure", ["raise", "degrade"])
def test_store_host_frozen_mid_replication_ends_in_bounded_time(on_peer_failure: str) -> None:
    """Soak finding (seed 20261185783989): rank 0 frozen (SIGSTOP) mid-replication while it also
    serves the default TCPStore. The store agreement that follows the failed transfer used to
    block ranks 1 and 2 forever (a store client call on a stalled server does not honour its
    timeout). Now they raise RestartRequiredError (a PeerError) within a few timeout_s, naming
    the phase, and neither commits step 2 (all-or-nothing)."""
    import json

    import torch.multiprocessing as mp
    from mp_utils import free_port

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    roots = [tempfile.mkdtemp(prefix=f"gemini-bw-frozen{i}-", dir=base) for i in range(3)]
    out_dir = tempfile.mkdtemp(prefix="gemini-bw-frozen-out-")
    ctx = mp.start_processes(_run_frozen_rank, args=(3, free_port(), roots, out_dir, on_peer_failure),
                             nprocs=3, join=False, start_method="spawn")
    # transfer wait + store agreement (2 x) + DCP's gather on the training group, plus start-up
    bound = 60.0
    results: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and len(results) < 2:
            for r in (1, 2):
                f = Path(out_dir, f"{r}.json")
                if r not in results and f.exists():
                    results[r] = json.loads(f.read_text())
            dead = [r for r in (1, 2) if r not in results and not ctx.processes[r].is_alive()]
            assert not dead, f"ranks {dead} died without a result (exit codes {[p.exitcode for p in ctx.processes]})"
            time.sleep(0.2)
    finally:
        for p in ctx.processes:  # rank 0 is stopped: wake it so the kill is delivered, then kill all
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in ctx.processes:
            p.join(10)
        for d in (*roots, out_dir):
            shutil.rmtree(d, ignore_errors=True)
    assert len(results) == 2, f"ranks {sorted({1, 2} - set(results))} still blocked {bound:.0f} s after rank 0 froze"
    for r, res in results.items():
        assert res["error"] != "no error", (r, res)
        # Our RestartRequiredError (a PeerError), unless DCP's gather on the training group (rank 0
        # frozen) raised its own timeout over it (docs/failure-semantics.md, "Bounded waits").
        assert res["peer_error"] or res["error"] == "RuntimeError", (r, res)
        assert res["committed"] == 1, (r, res)  # step 2 committed on no surviving node
        # transfer (1 x) + agreement (<= 2 x) + DCP's gather (1 x), plus scheduling slack
        assert res["seconds"] < 4 * FROZEN_TIMEOUT_S + 2 * SLACK_S, (r, res)
        reason = res["own_reason"] or ""
        assert "step 2" in reason and "not committed" in reason, (r, res)
        assert "over the default store" in reason and "stalled or gone" in reason, (r, res)


def _run_frozen_rank(rank: int, world_size: int, port: int, roots: list[str], out_dir: str, on_peer_failure: str) -> None:
    """torch.multiprocessing entry: rank ``rank`` of the frozen-store-host scenario on node ``roots[rank]``."""
    _frozen_store_host_rank(rank, world_size, port, roots[rank], out_dir, on_peer_failure)


def test_a_control_group_whose_store_host_is_stopped_ends_in_restart_required(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making the package's control group waits for its peers through the default store; once a store
    wait timed out, torch's TCPStore client waits for the answer to its cancel with no deadline (the
    soak: three ranks in ``new_group`` 96 s after rank 0, the store's host, was stopped). The making
    is given up after its bound, on the caller's thread, with RestartRequiredError."""
    from gemini_dcp.transport import comm

    forever = threading.Event()
    monkeypatch.setattr(comm.dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(comm.dist, "new_group", lambda **kw: forever.wait(60))  # a recv that never returns
    monkeypatch.setattr(comm, "GROUP_DEADLINE_FACTOR", 0.0)
    monkeypatch.setattr(comm, "GROUP_DEADLINE_SLACK_S", 0.2)
    try:
        with pytest.raises(RestartRequiredError, match="control group of ranks \\[0, 1\\].*stopped answering"):
            comm._new_group((0, 1), 1.0)
        assert comm.broken_reason() is not None  # every later save or load raises it at once
    finally:
        forever.set()
        comm.reset_groups()
