"""gemini_dcp.integrations without torchtitan: the resume choice across gemini_dcp's tiers and a trainer's
checkpoint folder (pure), the newest restorable step (one process), the torchtitan settings, and that the
torchtitan module imports lazily (the model-states cache: test_model_states.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp import ConfigError, GeminiStorageReader, GeminiStorageWriter, newest_restorable_step
from gemini_dcp.integrations.resume import (
    ResumeChoice,
    choose_resume,
    newest_folder_step,
    newest_local_folder_step,
    saves_at,
    step_of_dir,
)
from gemini_dcp.integrations.torchtitan import WRITER_FIELDS, TitanGeminiSettings

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("gemini", "folder", "want"),
    [
        (None, None, ResumeChoice(source="fresh", step=None)),
        (-1, -1, ResumeChoice(source="fresh", step=None)),  # torchtitan's "none"
        (7, None, ResumeChoice(source="gemini", step=7)),
        (None, 500, ResumeChoice(source="folder", step=500)),
        (512, 500, ResumeChoice(source="gemini", step=512)),  # memory is newer: the usual case after a crash
        (500, 500, ResumeChoice(source="gemini", step=500)),  # tie: memory (full state, faster)
        (400, 500, ResumeChoice(source="folder", step=500)),  # memory lost newer steps (e.g. every node replaced)
        (0, -1, ResumeChoice(source="gemini", step=0)),
    ],
)
def test_choose_resume_takes_the_newest_source(gemini: int | None, folder: int | None, want: ResumeChoice) -> None:
    assert choose_resume(gemini, folder) == want


def test_resume_choice_is_validated() -> None:
    with pytest.raises(ConfigError, match="fresh start has no step"):
        ResumeChoice(source="fresh", step=3)
    with pytest.raises(ConfigError, match="source"):
        ResumeChoice(source="disk", step=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=">= 0"):
        ResumeChoice(source="folder", step=-2)


def test_newest_folder_step_skips_incomplete_and_foreign_names() -> None:
    names = ["step-10", "step-200", "step-30", "notes.txt", "step-x", "old-step-900", "step-1000"]
    complete = {"step-10", "step-200", "step-30", "old-step-900"}
    asked: list[str] = []

    def is_complete(name: str) -> bool:
        asked.append(name)
        return name in complete

    assert newest_folder_step(names, is_complete) == 200  # step-1000 has no .metadata yet (killed mid-save)
    assert asked == ["step-1000", "step-200"]  # newest first, stops at the first complete one
    assert newest_folder_step([], is_complete) is None
    assert newest_folder_step(["step-5"], lambda n: False) is None
    assert step_of_dir("step-42") == 42 and step_of_dir("step-42.tmp") is None


def test_newest_local_folder_step(tmp_path: Path) -> None:
    assert newest_local_folder_step(tmp_path / "missing") is None
    for n, marker in ((4, ".metadata"), (8, "model.safetensors.index.json"), (12, None)):
        (tmp_path / f"step-{n}").mkdir()
        if marker:
            (tmp_path / f"step-{n}" / marker).write_text("")
    assert newest_local_folder_step(tmp_path) == 8


def test_saves_at() -> None:
    assert [s for s in range(0, 7) if saves_at(s, 1)] == [1, 2, 3, 4, 5, 6]
    assert [s for s in range(0, 7) if saves_at(s, 3)] == [3, 6]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="every="):
            saves_at(1, bad)  # type: ignore[arg-type]


def test_titan_settings_validate_the_writer_keywords(tmp_path: Path) -> None:
    s = TitanGeminiSettings(every=2, writer_keywords={"root": str(tmp_path), "job_id": "tt", "replicas": 1,
                                                      "keep": 3, "persistent": None, "persist_every": 10})
    assert str(s.options.local.root) == str(tmp_path) and s.options.local.job_id == "tt" and s.options.local.keep == 3
    assert set(WRITER_FIELDS) == {"root", "job_id", "replicas", "keep", "persistent", "persist_every"}
    with pytest.raises(ConfigError, match="every="):
        TitanGeminiSettings(every=0)
    with pytest.raises(ConfigError):
        TitanGeminiSettings(writer_keywords={"replicas": 0})
    with pytest.raises(ConfigError):
        TitanGeminiSettings(writer_keywords={"job_id": "no spaces allowed"})
    with pytest.raises(ConfigError, match="folder_saves"):
        TitanGeminiSettings(folder_saves="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gemini_async"):
        TitanGeminiSettings(async_save=1)  # type: ignore[arg-type]


def test_gemini_root_is_created_private_and_another_users_is_refused(tmp_path: Path) -> None:
    import os
    import stat

    from gemini_dcp.errors import TierRootError
    from gemini_dcp.integrations.torchtitan import _prepare_root

    root = tmp_path / "shm" / "gemini_dcp-titan"
    _prepare_root(str(root))  # what GeminiCheckpointManager does with gemini_root, on every rank
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    _prepare_root(str(root))  # a restart: the root is there, still accepted
    GeminiStorageWriter(root=root, job_id="made")  # the tier takes it
    _prepare_root(None)  # no gemini_root: the tier's own rules, nothing made here
    os.chmod(root, 0o777)
    with pytest.raises(TierRootError, match="group- or other-writable"):
        _prepare_root(str(root))
    if os.geteuid() == 0:  # handing the root to another uid needs root
        os.chmod(root, 0o700)
        os.chown(root, 65534, 65534)
        with pytest.raises(TierRootError, match="owned by another user; it belongs to uid 65534"):
            _prepare_root(str(root))


def test_newest_restorable_step_one_process(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    reader = GeminiStorageReader(root=root, job_id="disc")
    assert newest_restorable_step(reader) is None  # nothing committed: a fresh start, not an error
    sd = {"w": torch.arange(6, dtype=torch.float32)}
    writer = GeminiStorageWriter(root=root, job_id="disc")
    for step in (3, 5):
        sd["w"] += 1
        dcp.save(sd, storage_writer=writer, checkpoint_id=f"out/checkpoint/step-{step}")
    reader = GeminiStorageReader(root=root, job_id="disc")
    assert newest_restorable_step(reader) == 5
    assert newest_restorable_step(reader, 3) == 3
    assert newest_restorable_step(reader, 4) is None  # not committed: the caller falls back to its folder
    out = {"w": torch.zeros(6)}
    dcp.load(out, storage_reader=reader, checkpoint_id=newest_restorable_step(reader))
    assert torch.equal(out["w"], sd["w"]) and reader.restored_step == 5


def test_adapters_interleave_only_a_model_on_an_accelerator() -> None:
    """The torchtitan and Accelerate adapters pace their copy into the gaps between collectives only for a model
    with parameters off the CPU (on the CPU those gaps are the training's compute: measured slower)."""
    import torch

    from gemini_dcp.snapshot.interleave import interleave_for

    cpu = torch.nn.Linear(2, 2)
    assert not interleave_for(cpu) and not interleave_for([cpu, torch.nn.Linear(2, 2, device="meta")])
    assert not interleave_for([])


def test_cpu_model_with_unpinned_ranks_gets_the_pinning_hint(monkeypatch, caplog) -> None:
    """Several ranks on a node, each free to run on every CPU: the CPU-model decision also says (INFO) that pinning
    each rank to its own cores makes a save cheaper; pinned, or one rank per node, it says nothing of the kind."""
    import logging
    import os

    import torch

    from gemini_dcp.snapshot import interleave

    cpus = os.cpu_count() or 1
    monkeypatch.setattr(interleave.os, "cpu_count", lambda: max(cpus, 2))
    monkeypatch.setattr(interleave.os, "sched_getaffinity", lambda pid: set(range(max(cpus, 2))), raising=False)
    cases = [("2", True), ("1", False)]
    for local_world, hinted in cases:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=interleave.__name__):
            assert not interleave.interleave_for(torch.nn.Linear(2, 2))
        assert interleave.ranks_unpinned() is hinted
        assert ("pinned to its own cores" in caplog.text) is hinted, caplog.text
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(interleave.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert not interleave.ranks_unpinned()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert not interleave.ranks_unpinned()


def test_torchtitan_module_imports_without_torchtitan() -> None:
    """``import gemini_dcp`` and the integration module never import torchtitan (or torch, for the module)."""
    code = (
        "import sys\nimport gemini_dcp, gemini_dcp.integrations.torchtitan as t\n"
        "print('torchtitan' in sys.modules, 'torch' in sys.modules, t.OVERRIDE)"
    )
    env_path = f"{REPO}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    titan, torch_loaded, target = out.stdout.split()
    assert target == "gemini_dcp.integrations.torchtitan.gemini_checkpoint"
    if not _torchtitan_importable():
        assert (titan, torch_loaded) == ("False", "False")


def _torchtitan_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchtitan") is not None


@pytest.mark.skipif(not _torchtitan_importable(), reason="torchtitan is not installed (CI does not install it)")
def test_override_factory_keeps_torchtitan_fields_and_validates(tmp_path: Path) -> None:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config.override import _REGISTRY

    from gemini_dcp.integrations import torchtitan as tt

    assert tt.OVERRIDE in _REGISTRY  # registered when the module was imported
    base = CheckpointManager.Config(enable=True, interval=7, folder="ckpt", keep_latest_k=3)
    cfg = tt.gemini_checkpoint(base, gemini_every=2, gemini_root=str(tmp_path), gemini_job_id="ov")
    assert isinstance(cfg, tt.GeminiCheckpointManager.Config) and cfg._owner is tt.GeminiCheckpointManager
    assert (cfg.interval, cfg.folder, cfg.keep_latest_k, cfg.enable) == (7, "ckpt", 3, True)
    assert (cfg.gemini_every, cfg.gemini_job_id, cfg.gemini_folder_saves) == (2, "ov", True)
    with pytest.raises(ConfigError, match="gemini_"):
        tt.gemini_checkpoint(base, interval=3)
    with pytest.raises(ConfigError, match="every="):
        tt.gemini_checkpoint(base, gemini_every=0)
    with pytest.raises(ConfigError):
        tt.gemini_checkpoint_config(gemini_replicas=0)


RESTORE_STATS = ("restored_step", "restored_from", "restore_seconds")  # docs/integrations.md: the same on every one


def test_accelerate_restore_statistics_one_process(tmp_path: Path) -> None:
    """``GeminiAcceleratorCheckpoint`` (no Accelerate needed: it reads ``process_index`` only) says what its resume
    did with the reader's names: the step, bytes per tier, seconds; a fresh job says nothing was resumed."""
    from types import SimpleNamespace

    from gemini_dcp.integrations.accelerate import GeminiAcceleratorCheckpoint

    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    acc = SimpleNamespace(process_index=0)
    ckpt = GeminiAcceleratorCheckpoint(acc, model, opt, root=str(root), job_id="stats")
    assert (ckpt.restored_step, ckpt.restored_from, ckpt.restore_seconds) == (None, {}, None)
    assert ckpt.resume() is None and ckpt.restored_step is None  # a fresh job
    ckpt.save(3)
    assert ckpt.last_committed_step == 3
    fresh = torch.nn.Linear(4, 4)
    again = GeminiAcceleratorCheckpoint(acc, fresh, torch.optim.AdamW(fresh.parameters()), root=str(root), job_id="stats")
    assert again.resume() == 3 and again.restored_step == 3
    assert torch.equal(fresh.weight, model.weight)
    assert again.restored_from["local"] > 0 and again.restored_from["persistent"] == 0
    assert again.restore_seconds is not None and again.restore_seconds > 0
    reader = GeminiStorageReader(root=root, job_id="stats")
    assert all(hasattr(reader, name) for name in RESTORE_STATS)
    for module in ("lightning", "torchtitan"):  # their classes need their trainers: the same names in the source
        text = (REPO / "gemini_dcp" / "integrations" / f"{module}.py").read_text()
        assert all(f"self.{name}" in text for name in RESTORE_STATS), module
