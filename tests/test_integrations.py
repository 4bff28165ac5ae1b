"""gemini_dcp.integrations without torchtitan: the resume choice across gemini_dcp's tiers and a trainer's
checkpoint folder (pure), the newest restorable step (one process), the torchtitan settings, and that the
torchtitan module imports lazily; its model-states cache against a stand-in of torchtitan's ModelWrapper."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from titan_stub import ModelWrapperStub as _Wrapper

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


def _fused_model() -> Any:
    import torch

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 4))
            self.register_state_dict_post_hook(self._split)

        @staticmethod
        def _split(module: Any, sd: dict[str, Any], prefix: str, _meta: Any) -> None:
            w = sd.pop(f"{prefix}w")
            sd[f"{prefix}q"], sd[f"{prefix}k"] = w[:4].contiguous(), w[4:] * 1  # fresh tensors, as llama3's wqkv split

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.ModuleDict({"qkv": Fused()})
            self.out = torch.nn.Linear(4, 3)
            self.register_buffer("count", torch.zeros(1))

    return Net()


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_model_states_cache_returns_what_the_wrapper_would() -> None:
    import torch

    from gemini_dcp.integrations.torchtitan import ModelStatesCache

    model = _fused_model()
    wrapper = _Wrapper(model)
    cache = ModelStatesCache(_Wrapper)
    first = cache.get(wrapper)
    assert first is wrapper.cached_state_dict and cache.rebuilds == 1
    with torch.no_grad():
        for step in range(3):  # in-place updates (the optimizer step): the cached dict, refreshed by the maker only
            for p in model.parameters():
                p.add_(0.5)
            model.count += 1
            got = cache.get(wrapper)
            assert got is first and _same(got, wrapper._get_state_dict())
    assert (cache.hits, cache.rebuilds) == (3, 1)
    ref = _Wrapper(model).state_dict()  # a fresh wrapper: what torchtitan would save now
    assert _same(cache.get(wrapper), ref)

    # A parameter replaced, or re-pointed: torchtitan's full call, and the new values.
    model.out.weight = torch.nn.Parameter(torch.ones(3, 4))
    assert _same(cache.get(wrapper), wrapper._get_state_dict()) and cache.rebuilds == 2
    with torch.no_grad():
        model.out.bias.data = torch.full((3,), 7.0)
    got = cache.get(wrapper)
    assert cache.rebuilds == 3 and torch.equal(got["out.bias"], torch.full((3,), 7.0))
    # The wrapper now holds a copy of the re-pointed bias (its cached tensor kept the old storage): a copy must be
    # refreshed by torchtitan's full call at every save.
    with torch.no_grad():
        model.out.bias.add_(1.0)
    assert torch.equal(cache.get(wrapper)["out.bias"], torch.full((3,), 8.0)) and (cache.hits, cache.rebuilds) == (4, 4)
    # A load replaces the wrapper's dict (torchtitan's ModelWrapper.load_state_dict): remembered again.
    wrapper.cached_state_dict = wrapper._get_state_dict()
    assert _same(cache.get(wrapper), wrapper._get_state_dict()) and cache.rebuilds == 5
    assert cache.get(wrapper) is wrapper.cached_state_dict and cache.hits == 5


def test_model_states_cache_declines_what_it_cannot_vouch_for() -> None:
    from gemini_dcp.integrations.torchtitan import ModelStatesCache

    model = _fused_model()
    model.out.register_state_dict_pre_hook(lambda *a, **k: None)  # a hook of unknown effect
    wrapper = _Wrapper(model)
    cache = ModelStatesCache(_Wrapper)
    for _ in range(3):
        assert _same(cache.get(wrapper), wrapper._get_state_dict())
    assert (cache.hits, cache.rebuilds) == (0, 3)
    other = ModelStatesCache(dict)  # not the wrapper class it knows
    plain = _Wrapper(_fused_model())
    other.get(plain)
    other.get(plain)
    assert (other.hits, other.rebuilds) == (0, 2)
