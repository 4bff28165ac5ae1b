"""CI sample of the fault-injection harness (tests/fault_harness.py; the soak is tests/soak_trials.py, scripts/soak.sh).

Every named save/replicate/commit phase once with SIGKILL on 2 simulated nodes, every load and
drain phase, a SIGTERM, a kill between two nodes' commits with ``keep=1`` and a node lost, a
hung (SIGSTOPped) peer, a few random seeds; and a check that every phase of
:data:`gemini_dcp.core.faults.PHASES` is reached by a clean job (so no fault point is dead code).

Each trial: real rank processes save steps 1..K, one dies at the phase, the rest are killed
(torchrun's reaction), fresh processes restore: the restored step must be bit-exact and not
older than the newest step every rank saw committed (see the harness docstring).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import fault_harness as fh
import pytest

from gemini_dcp.core import faults
from gemini_dcp.core.faults import PHASES
from gemini_dcp.options.faults import fault_settings


def _check(record: dict) -> None:
    assert record["outcome"] == "pass", json.dumps(record, indent=1, default=str)
    if record["phase"] is not None:
        assert record["fired"], f"the fault never fired: {json.dumps(record, default=str)}"


def test_fault_spec_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """``<phase>[@<nth>][:<signal>][/<rank>]`` parses as documented; unset, fault_point is a no-op."""
    monkeypatch.delenv(faults.ENV_FAULT, raising=False)
    monkeypatch.delenv(faults.ENV_FAULT_LOG, raising=False)
    faults.fault_point("save.before_copy")  # nothing happens
    def spec() -> tuple[str, int, int, int | None]:
        s = fault_settings().spec
        return (s.phase, s.nth, s.sig, s.rank)

    monkeypatch.setenv(faults.ENV_FAULT, "commit.after_record@3:SIGTERM/2")
    assert spec() == ("commit.after_record", 3, int(signal.SIGTERM), 2)
    monkeypatch.setenv(faults.ENV_FAULT, "load.mid_copy")
    assert spec() == ("load.mid_copy", 1, int(signal.SIGKILL), None)
    monkeypatch.setenv(faults.ENV_FAULT, "save.mid_copy:9")
    assert spec() == ("save.mid_copy", 1, 9, None)
    monkeypatch.setenv(faults.ENV_FAULT, "save.mid_copy/5")  # another rank: not this process (RANK unset = 0)
    faults.fault_point("save.mid_copy")


def test_fault_point_logs_and_fires_on_the_nth(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The phase log records every reach; the kill comes on the nth reach of the named phase only."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(faults, "_counts", faults.Counter())
    monkeypatch.setenv(faults.ENV_FAULT_LOG, str(tmp_path))
    monkeypatch.setenv(faults.ENV_FAULT, "save.after_copy@2")
    monkeypatch.setenv("RANK", "1")
    for phase in ("save.before_copy", "save.after_copy", "save.after_copy", "save.after_copy"):
        faults.fault_point(phase)
    assert sent == [(os.getpid(), int(signal.SIGKILL))]
    assert faults.reached(tmp_path) == {"save.before_copy": {1}, "save.after_copy": {1}}
    log = next(tmp_path.glob("*.phases")).read_text().splitlines()
    assert log.count("1 save.after_copy fire") == 1


def test_every_phase_is_reached() -> None:
    """A clean 2-node job (replicas=2, a store drained every step, then a load) passes every fault point."""
    reached = fh.phases_reached()
    missing = set(PHASES) - reached
    assert not missing, f"fault points never reached: {sorted(missing)} (reached: {sorted(reached)})"


@pytest.mark.parametrize("phase", fh.SAVE_PHASES)
def test_sigkill_at_save_phase_restores_last_committed_step(phase: str) -> None:
    """Kill one rank at ``phase`` of the 2nd save (2 nodes, replicas=2): step 1, or 2 if it
    committed everywhere first, comes back bit-exact."""
    rank = PHASES.index(phase) % 2
    _check(fh.run_trial(fh.Trial(seed=PHASES.index(phase), kind="save", phase=phase, nth=2, rank=rank,
                                 layout=(0, 1), steps=3, keep=2, replicas=2)))


@pytest.mark.parametrize("phase", fh.LOAD_PHASES)
def test_sigkill_during_load_then_clean_load(phase: str) -> None:
    """A rank killed mid-restore (some chunks already in its tensors) changes nothing in the tier."""
    _check(fh.run_trial(fh.Trial(seed=100, kind="load", phase=phase, rank=1, layout=(0, 0, 1), steps=2)))


@pytest.mark.parametrize("phase", fh.DRAIN_PHASES)
def test_drain_process_killed_store_never_torn(phase: str) -> None:
    """A node's drain process killed mid-upload: memory restores the newest step, and the
    store alone restores a bit-exact step or none (never a torn one)."""
    _check(fh.run_trial(fh.Trial(seed=200, kind="drain", phase=phase, rank=1, layout=(0, 1), steps=1)))


def test_sigterm_mid_copy_with_node_lost() -> None:
    """SIGTERM (torchrun's first signal) mid-copy, then the other node's memory is lost: its peer copy serves."""
    _check(fh.run_trial(fh.Trial(seed=300, kind="save", phase="save.mid_copy", nth=3, signal="SIGTERM", rank=0,
                                 layout=(0, 0, 1, 1), steps=3, wipe=(1,))))


@pytest.mark.parametrize("wipe", [0, 1])
def test_kill_between_node_commits_keep1_node_lost(wipe: int) -> None:
    """keep=1: node 1 dies right after its own record of step 2 (eviction of step 1 on that node
    included) while node 0 may not have committed step 2; then one node's memory is lost.
    The step committed everywhere (1) or a newer complete one must come back."""
    _check(fh.run_trial(fh.Trial(seed=400 + wipe, kind="save", phase="commit.after_evict", nth=2, rank=1,
                                 layout=(0, 1), steps=3, keep=1, wipe=(wipe,))))


@pytest.mark.slow
def test_hung_peer_survivors_fail_in_bounded_time() -> None:
    """A rank SIGSTOPped mid-replication (a hung peer, connections open): the group is not killed
    for it; the other ranks must fail on their own within their timeout (5 s), and the restart
    restores the last committed step."""
    rec = fh.run_trial(fh.Trial(seed=500, kind="survivor", phase="replicate.mid_send", nth=2, signal="SIGSTOP", rank=1,
                                layout=(0, 1, 2), steps=3, timeout_s=5.0))
    _check(rec)


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_random_trials(seed: int) -> None:
    """Random kind/phase/nth/signal/rank/layout/keep/wipe drawn from a recorded seed (fault_harness.random_trial)."""
    _check(fh.run_trial(fh.random_trial(seed)))


def _probe_like_a_restarting_rank(path: str, held: Any, go: Any) -> None:
    """What a sibling rank's _refuse_live_launches does to a dead launch's file: lock it
    exclusively, unlink it, close it (here with a pause inside, to widen the window)."""
    import fcntl

    fd = os.open(path, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.set()
    go.wait(5)
    os.unlink(path)
    os.close(fd)


def test_sibling_probe_of_a_dead_launch_is_not_a_live_launch(tmp_path) -> None:
    """Found by the soak: after a crash, the ranks of the restarted launch that share a node probe
    the dead launch's lock file at the same moment; one rank's probe (LOCK_EX, then unlink) made
    another rank raise JobConflictError naming the dead launch, so the restart failed."""
    import multiprocessing as mp
    import threading

    from gemini_dcp.local.launch_lock import hold_launch_lock
    from gemini_dcp.local.tier import LocalTier
    from gemini_dcp.transport.launch import LaunchInfo

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    ctx = mp.get_context("fork")
    dead = ctx.Process(target=_hold_and_exit, args=(str(root),))
    dead.start()
    dead.join()
    files = list((root / "j" / "launches").glob("*.lock"))
    assert len(files) == 1, files
    held, go = ctx.Event(), ctx.Event()
    prober = ctx.Process(target=_probe_like_a_restarting_rank, args=(str(files[0]), held, go))
    prober.start()
    try:
        assert held.wait(10)
        threading.Timer(0.2, go.set).start()  # the probe ends (file unlinked) shortly after we look
        tier = LocalTier(root, "j")
        hold_launch_lock(tier, LaunchInfo("0123456789abcdef", "restarted run", "vm", os.getpid(), 0.0), tier)
    finally:
        go.set()
        prober.join(10)


def _hold_and_exit(root: str) -> None:
    from gemini_dcp.local.launch_lock import hold_launch_lock
    from gemini_dcp.local.tier import LocalTier
    from gemini_dcp.transport.launch import LaunchInfo

    tier = LocalTier(root, "j")
    hold_launch_lock(tier, LaunchInfo("deadbeefdeadbeef", "crashed run", "vm", os.getpid(), 0.0), tier)
    os._exit(0)  # dies holding it: the kernel drops the lock, the file stays
