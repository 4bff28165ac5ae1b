"""``GeminiStorageWriter.wait_persisted``, the drain states ``inspect`` shows, and the slot holds of a drain.

Mostly without processes: the wait is driven by hand-written drain status files and a stub
store; one test drains a real save through a detached drain server into a ``file://`` store.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp import GeminiStorageWriter
from gemini_dcp.errors import ConfigError, PersistentTierError
from gemini_dcp.local.slot_holds import HOLD_S, held_slots, hold_path, release_holds, take_holds
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.ops.inspection import inspect_job
from gemini_dcp.persistent.drain import Paths
from gemini_dcp.persistent.drain.client import wait_durable
from gemini_dcp.persistent.drain.status import step_states
from gemini_dcp.persistent.store_calls import PersistentTimeoutError


@pytest.fixture
def root() -> Any:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        yield d


class _Store:
    """A stand-in for PersistentTier: the committed steps it reports."""

    url = "file:///nowhere"
    is_local = True

    def __init__(self, steps: list[int] | None = None) -> None:
        self.steps = steps or []

    def committed_steps(self) -> list[int]:
        return list(self.steps)


def _status(p: Paths, steps: dict[int, dict[str, Any]], pending: tuple[int, ...] = ()) -> None:
    p.dir.mkdir(parents=True, exist_ok=True)
    p.status.write_text(json.dumps({"steps": {str(k): {"unix": time.time(), **v} for k, v in steps.items()}}))
    p.requests.mkdir(parents=True, exist_ok=True)
    for s in pending:
        p.request(s).write_text("{}")


def _state(step: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((1 << 16,), float(step * 10 + i)) for i in range(4)}


# ---- wait_durable (the logic behind wait_persisted) ------------------------------------------------
def test_wait_returns_the_newest_durable_step(tmp_path: Path) -> None:
    p = Paths(tmp_path / "persist")
    _status(p, {4: {"state": "committed", "committed_unix": 1.0}})
    assert wait_durable(p, _Store([2, 4]), 4, 5.0) == 4
    # a step known durable from the store alone (another node committed it)
    assert wait_durable(p, _Store([6]), 5, 5.0) == 6
    # nothing due yet: the newest durable step, at once
    assert wait_durable(p, _Store([]), None, 5.0) is None


def test_a_failed_drain_raises_with_its_reason(tmp_path: Path) -> None:
    p = Paths(tmp_path / "persist")
    _status(p, {3: {"state": "abandoned", "reason": "gave up after 5 attempts: OSError: disk on fire"}})
    with pytest.raises(PersistentTierError, match="disk on fire"):
        wait_durable(p, _Store(), 3, 30.0)


def test_a_retried_failure_keeps_waiting_and_a_timeout_is_bounded(tmp_path: Path) -> None:
    p = Paths(tmp_path / "persist")
    _status(p, {3: {"state": "failed", "detail": "OSError: store unreachable"}}, pending=(3,))
    assert step_states(p.dir)[3].retrying
    t0 = time.monotonic()
    with pytest.raises(PersistentTimeoutError, match="store unreachable") as ei:
        wait_durable(p, _Store(), 3, 0.3)
    assert time.monotonic() - t0 < 5.0
    assert isinstance(ei.value, PersistentTierError)


def test_a_superseded_step_is_durable_with_the_step_that_replaced_it(tmp_path: Path) -> None:
    p = Paths(tmp_path / "persist")
    _status(p, {3: {"state": "abandoned", "reason": "superseded by step 4", "superseded_by": 4},
                4: {"state": "committed"}})
    assert wait_durable(p, _Store([4]), 3, 5.0) == 4


def test_step_states_fold_the_server_states(tmp_path: Path) -> None:
    p = Paths(tmp_path / "persist")
    _status(p, {
        1: {"state": "done", "committed_unix": 1.0},
        2: {"state": "done", "detail": "part written; another node commits"},
        3: {"state": "uploading"},
        4: {"state": "abandoned", "reason": "bad checksum"},
        5: {"state": "staged"},
    }, pending=(3, 5, 6))
    st = step_states(p.dir)
    assert {s: st[s].state for s in st} == {1: "durable", 2: "writing", 3: "writing", 4: "failed", 5: "queued", 6: "queued"}
    assert st[4].reason == "bad checksum"


# ---- the writer's method --------------------------------------------------------------------------
def test_no_persistent_tier_is_a_config_error(root: str) -> None:
    w = GeminiStorageWriter(root=root, job_id="j")
    with pytest.raises(ConfigError, match="persistent="):
        w.wait_persisted()


def test_the_default_timeout_is_the_writers_persistent_timeout(root: str, tmp_path: Path) -> None:
    w = GeminiStorageWriter(root=root, job_id="j", persistent=f"file://{tmp_path / 'store'}", persist_every=1,
                            timeout_s=1.0)
    assert w._drainer is not None
    w._drainer.last_due = 7  # a step that will never be drained
    t0 = time.monotonic()
    with pytest.raises(PersistentTimeoutError, match="step 7"):
        w.wait_persisted()
    assert 0.9 < time.monotonic() - t0 < 10.0


def test_wait_persisted_after_a_save_and_inspect_shows_durable(root: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    w = GeminiStorageWriter(root=root, job_id="j", persistent=f"file://{store}", persist_every=2)
    dcp.save(_state(1), storage_writer=w, checkpoint_id=1)  # not due
    assert w.wait_persisted() is None
    dcp.save(_state(2), storage_writer=w, checkpoint_id=2)
    assert w.wait_persisted(timeout_s=240) == 2
    assert (store / "j" / "step-2" / ".metadata").exists()
    back = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    dcp.load(back, checkpoint_id=str(store / "j" / "step-2"))  # stock load, bit-exact
    assert all(torch.equal(back[k], v) for k, v in _state(2).items())
    info = inspect_job(LocalTier(root, "j").layout)
    assert {s.step: s.drain for s in info.steps}.get(2) == "durable"
    assert not list((Path(root) / "j" / "persist" / "holds").glob("rank-*"))  # the drain released its holds


def test_saves_waiting_for_each_drain_are_read_in_place(root: str, tmp_path: Path) -> None:
    """A save that waits for each drain (save, wait_persisted, save, ...) sends a request while the previous
    upload may still commit and apply retention: it reads no slot any more, so the new request is read in
    place from its held slots, never copied to a staging file first (keep >= 2)."""
    w = GeminiStorageWriter(root=root, job_id="ip", persistent=f"file://{tmp_path / 'store'}", persist_every=1,
                            keep=2, persist_keep=1)  # retention runs after each commit
    for step in range(1, 6):
        dcp.save(_state(step), storage_writer=w, checkpoint_id=step)
        assert w.wait_persisted(step, timeout_s=240) == step
    steps = json.loads(Paths(Path(root) / "ip" / "persist").status.read_bytes())["steps"]
    assert [steps[str(s)]["in_place"] for s in range(1, 6)] == [True] * 5, steps


# ---- slot holds -----------------------------------------------------------------------------------
def _tier_with_two_steps(root: str) -> LocalTier:
    w = GeminiStorageWriter(root=root, job_id="h", keep=2)
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=w, checkpoint_id=step)
    return LocalTier(root, "h")


def test_a_held_slot_is_not_reused_and_a_dead_drains_hold_expires(root: str) -> None:
    tier = _tier_with_two_steps(root)
    persist = tier.layout.persist_dir
    free = tier.choose_slot(0, 2, step=3, global_step=2)
    holds = take_holds(persist, 3, [(0, free)])
    assert held_slots(persist, 0) == {free}
    other = tier.choose_slot(0, 2, step=3, global_step=2)
    assert other != free
    # a drain that died stops refreshing its hold: after HOLD_S the slot is free again
    old = time.time() - HOLD_S - 1
    os.utime(holds[0], (old, old))
    assert held_slots(persist, 0) == set()
    live = take_holds(persist, 3, [(0, other)])  # the other candidate is held now, the stale hold counts no more
    assert tier.choose_slot(0, 2, step=4, global_step=2) == free
    release_holds(live, 3)
    release_holds(holds, 3)
    assert not hold_path(persist, 0, free).exists()


def test_release_leaves_a_hold_another_step_took(root: str) -> None:
    tier = _tier_with_two_steps(root)
    holds = take_holds(tier.layout.persist_dir, 5, [(0, 1)])
    release_holds(holds, 4)  # the drain of step 4 is done; step 5 re-took the slot
    assert holds[0].exists()
    release_holds(holds, 5)
    assert not holds[0].exists()


def test_the_drains_write_checks_what_it_wrote(tmp_path: Path) -> None:
    """The fused write: a torch.save file that stock torch.load reads, and a changed or reused source refused."""
    import io
    from types import SimpleNamespace

    from gemini_dcp.core.checksum import checksum
    from gemini_dcp.errors import ChecksumMismatchError
    from gemini_dcp.persistent.drain.fused import BLOCK, FusedFile

    t = torch.arange(1 << 18, dtype=torch.float32)
    raw = t.view(torch.uint8)
    item = SimpleNamespace(length=raw.numel(), algo="crc32c", checksum=checksum(raw, "crc32c"), name="w")
    bounce = torch.empty(BLOCK, dtype=torch.uint8)
    for intact in (None, lambda: True):
        buf = io.BytesIO()
        f = FusedFile(buf, bounce, intact=intact)
        f.expect(item)
        torch.save(t, f)
        f.check(item, "step 1", lambda: None)
        assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), t)
    bad = SimpleNamespace(**{**vars(item), "checksum": item.checksum ^ 1})
    f = FusedFile(io.BytesIO(), bounce)
    f.expect(bad)
    torch.save(t, f)
    with pytest.raises(ChecksumMismatchError, match="changed"):
        f.check(bad, "step 1", lambda: None)
    f = FusedFile(io.BytesIO(), bounce, intact=lambda: False)  # a writer took the held slot meanwhile
    f.expect(item)
    torch.save(t, f)
    with pytest.raises(ChecksumMismatchError, match="took the memory slot"):
        f.check(item, "step 1", lambda: None)
    # A small item (read whole, not fused) whose slot a newer save took: said so, not called damage.
    from gemini_dcp.persistent.drain.fused import FusedDest, fused_reader
    from gemini_dcp.persistent.stock_format import StockItem

    small = torch.arange(100, dtype=torch.float32).view(torch.uint8)
    mem = bytearray(small.numpy().tobytes())
    from torch.distributed.checkpoint.metadata import MetadataIndex

    stale = StockItem(index=MetadataIndex("w", [0]), rank=0, dtype="float32", shape=(100,), length=small.numel(),
                      algo="crc32c", checksum=checksum(small, "crc32c") ^ 1)
    for intact, match in ((lambda: False, "took the memory slot"), (lambda: True, "every copy tried")):
        read, _ = fused_reader(FusedDest(SimpleNamespace(is_local=True), intact), mem, "step 2")
        with pytest.raises(ChecksumMismatchError, match=match):
            read(stale)


def test_a_step_due_while_the_server_warms_is_drained_by_a_bridge_in_the_trainer(root: str, tmp_path: Path) -> None:
    """The first due step of a process does not wait for the drain server's torch import: while a
    server holds ``warming.lock`` (here: this test), the trainer serves the request in a thread of its
    own (the bridge), and gives the node's server the lock once it is warm."""
    import fcntl

    from gemini_dcp.persistent.drain import client

    store = tmp_path / "store"
    p = Paths(Path(root) / "j" / "persist")
    p.dir.mkdir(parents=True, mode=0o700)
    warming = os.open(p.warming_lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(warming, fcntl.LOCK_EX)  # "a server is importing its upload side"
    try:
        w = GeminiStorageWriter(root=root, job_id="j", persistent=f"file://{store}", persist_every=1)
        dcp.save(_state(1), storage_writer=w, checkpoint_id=1)
        assert w.wait_persisted(1, timeout_s=120) == 1  # no drain process could serve: the bridge did
        bridge = client._THREADS.get(str(p.dir))
        assert bridge is not None and bridge.name == "gemini-dcp-drain-bridge"
        assert not p.pid.exists()  # daemon.pid names drain processes only, never this one
    finally:
        os.close(warming)  # "the server is warm"
    bridge.join(timeout=30)
    assert not bridge.is_alive()  # it handed over (nothing pending, its server is warm)
    dcp.save(_state(2), storage_writer=w, checkpoint_id=2)
    assert w.wait_persisted(2, timeout_s=240) == 2
    assert int(p.pid.read_text()) != os.getpid()  # a detached server drained the next one
    back = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    dcp.load(back, checkpoint_id=str(store / "j" / "step-1"))  # the bridge's upload: stock layout, bit-exact
    assert all(torch.equal(back[k], v) for k, v in _state(1).items())
    get_crc32 = getattr(torch.serialization, "get_crc32_options", None)
    assert get_crc32 is None or get_crc32()  # the bridge turned the zip CRC32 off only while it uploaded
