"""A live job is never destroyed from outside, and a removed slot never commits a step nobody can read.

- ``gemini-dcp gc`` and ``gc --remove-job`` run in another PID namespace (``unshare --pid --fork
  --mount-proc``: a sidecar container sharing the memory volume, where ``/proc`` shows none of the
  trainer's processes) leave a live trainer's job untouched: its launch lock says it is live. With
  ``--force`` they go ahead. Skipped where unprivileged namespaces are not permitted.
- A slot file removed behind the writer's back: a save whose slot goes while it is written fails
  (nothing committed; the previous step restores), and the next save makes the slot anew and
  commits a step that restores bit-exact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
from gemini_dcp.errors import JobConflictError, TierRootError, find_gemini_error
from gemini_dcp.ops.housekeeping import collect_garbage, remove_job

REPO = Path(__file__).resolve().parents[1]

TRAINER = """
import sys, torch, torch.distributed.checkpoint as dcp
from gemini_dcp import GeminiStorageWriter
root, job = sys.argv[1], sys.argv[2]
w = GeminiStorageWriter(root=root, job_id=job, keep=1)
for step in (1, 2, 3):
    dcp.save({"w": torch.full((1024,), float(step))}, storage_writer=w, checkpoint_id=step)
print("ready", flush=True)
sys.stdin.readline()  # lives until the test closes its stdin
"""


@pytest.fixture
def root() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-live-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096, dtype=torch.float32) + step}


def _files(job_dir: Path) -> set[str]:
    return {str(p.relative_to(job_dir)) for p in job_dir.rglob("*") if p.is_file()}


def _in_other_namespace(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "gemini_dcp_cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def _namespaces_permitted() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return r.returncode == 0


def test_gc_from_another_pid_namespace_never_touches_a_live_job(root: str) -> None:
    if not _namespaces_permitted():
        pytest.skip("unshare --pid --mount-proc is not permitted here (unprivileged container)")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, root, "live"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "ready"
        job_dir = Path(root, "live")
        before = _files(job_dir)
        assert any(f.endswith(".bin") for f in before)
        # the other namespace sees none of the trainer's processes
        r = _in_other_namespace(["gc", "--root", root, "--job", "live", "--keep", "1", "--json"])
        assert r.returncode == 0, r.stdout + r.stderr
        rep = json.loads(r.stdout)
        assert rep["live_launches"] and rep["freed_files"] == [] and rep["evicted_steps"] == []
        r = _in_other_namespace(["gc", "--root", root, "--job", "live", "--remove-job"])
        assert r.returncode != 0 and "is live" in (r.stdout + r.stderr), r.stdout + r.stderr
        assert _files(job_dir) == before
        # the trainer's job still restores its newest step
        out = {"w": torch.zeros(1024)}
        dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id="live"))
        assert torch.equal(out["w"], torch.full((1024,), 3.0))
        # --force is the operator's explicit word
        r = _in_other_namespace(["gc", "--root", root, "--job", "live", "--remove-job", "--force"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert not job_dir.exists()
    finally:
        trainer.communicate("\n", timeout=60)


def test_gc_in_the_trainers_own_process_sees_its_launch(root: str) -> None:
    w = GeminiStorageWriter(root=root, job_id="mine", keep=1)
    for step in (1, 2, 3):
        dcp.save(_state(step), storage_writer=w, checkpoint_id=step)
    rep = collect_garbage(root, "mine", keep=1)
    assert rep.live_launches and not rep.freed_files
    with pytest.raises(JobConflictError, match="is live"):
        remove_job(root, "mine")
    # the probe did not drop this process's own lock: another launch is still refused
    from gemini_dcp.local.launch_lock import live_launches

    assert live_launches(Path(root, "mine"))
    del w


def test_a_slot_removed_mid_save_fails_that_save_and_the_next_one_recreates_it(root: str) -> None:
    w = GeminiStorageWriter(root=root, job_id="gone", keep=1)
    dcp.save(_state(1), storage_writer=w, checkpoint_id=1)
    dcp.save(_state(2), storage_writer=w, checkpoint_id=2)
    real = w.local_writer.write

    def write_then_remove(*args: Any, **kwargs: Any) -> Any:
        done = real(*args, **kwargs)
        w.tier.slot_path(0, done.slot).unlink()  # an operator's rm while the save runs
        return done

    w.local_writer.write = write_then_remove  # type: ignore[method-assign]
    with pytest.raises(BaseException) as info:
        dcp.save(_state(3), storage_writer=w, checkpoint_id=3)
    assert isinstance(find_gemini_error(info.value), TierRootError), info.value
    w.local_writer.write = real  # type: ignore[method-assign]
    out = {"w": torch.zeros(4096)}
    dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id="gone"))
    assert torch.equal(out["w"], _state(2)["w"])  # the previous step stays the restore point
    # a slot removed between saves: the next save makes it anew and commits what it restores
    for step in (4, 5):
        for p in Path(root, "gone").rglob("slot-*.bin"):
            p.unlink()
        dcp.save(_state(step), storage_writer=w, checkpoint_id=step)
        out = {"w": torch.zeros(4096)}
        dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id="gone"))
        assert torch.equal(out["w"], _state(step)["w"]), step


def test_job_id_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemini_dcp.core.config import resolve_job_id

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "from-torchrun")
    monkeypatch.setenv("GEMINI_DCP_JOB_ID", "slurm-4242")
    assert resolve_job_id(None) == "slurm-4242" and resolve_job_id("explicit") == "explicit"
    monkeypatch.delenv("GEMINI_DCP_JOB_ID")
    assert resolve_job_id(None) == "from-torchrun"


def test_a_failed_restore_is_not_logged_as_dcp_metadata_fallback(root: str, caplog: pytest.LogCaptureFixture) -> None:
    """DCP logs "Global metadata is not found" with a traceback, on every rank, for any read_metadata
    error; for ours the error itself reaches the caller, so that record is dropped."""
    import logging

    with caplog.at_level(logging.INFO), pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(4)}, storage_reader=GeminiStorageReader(root=root, job_id="never-saved"))
    assert find_gemini_error(info.value) is not None
    assert not [r for r in caplog.records if "Global metadata is not found" in r.getMessage()]
