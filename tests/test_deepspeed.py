"""The DeepSpeed integration in one process, without DeepSpeed: the file codec and the checkpoint engine.

``gemini_dcp.persistent.deepspeed_layout`` turns each DeepSpeed file into DCP items and back (int-keyed
optimizer state stays int-keyed, tuples stay tuples, a tensor referenced twice comes back once, read-back
pickles are decoded with an allowlist). ``GeminiCheckpointEngine`` is driven the way DeepSpeed's
``save_checkpoint`` / ``load_checkpoint`` drive it (``create``, ``makedirs``, ``save`` per file, ``commit``;
the load served from the tiers through stand-in files), with a stand-in for DeepSpeed's own load. The
end-to-end runs with DeepSpeed (ZeRO-1/2/3 under torchrun) are tests/test_deepspeed_e2e.py.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp.errors import CheckpointNotFoundError, ConfigError, UntrustedDataError
from gemini_dcp.integrations.deepspeed import GeminiCheckpointEngine
from gemini_dcp.persistent.deepspeed_layout import (
    TAG_BYTES,
    TAG_KEY,
    decode_file,
    deepspeed_files,
    empty_state,
    file_items,
    tag_item,
    tag_template,
    tag_value,
)


def optim_file() -> dict[str, Any]:
    w = torch.arange(6, dtype=torch.float32)
    return {
        "optimizer_state_dict": {"state": {0: {"exp_avg": w.clone(), "step": torch.tensor(3.0)}, 1: {"exp_avg": w[:2]}},
                                 "param_groups": [{"lr": 0.01, "params": [0, 1], "betas": (0.9, 0.999)}]},
        "fp32": [w, w],  # the same tensor twice
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "ds_version": "0.19.8",
    }


def test_files_round_trip_through_dcp(tmp_path: Path) -> None:
    items = {**tag_item("global_step7"), **file_items(0, "zero_pp_rank_0_mp_rank_00_optim_states.pt", optim_file()),
             **file_items(1, "zero_pp_rank_1_mp_rank_00_optim_states.pt", {"x": 1})}
    dcp.save(items, checkpoint_id=tmp_path, no_dist=True)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    files = deepspeed_files(md)
    assert sorted(files) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    f = files["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    values = {**tag_template(), **empty_state(md, list(f.keys))}
    dcp.load(values, checkpoint_id=tmp_path, no_dist=True)
    assert tag_value(values[TAG_KEY]) == "global_step7"
    got, want = decode_file(f, values), optim_file()
    assert list(got["optimizer_state_dict"]["state"]) == [0, 1]  # int keys, not a list
    assert got["optimizer_state_dict"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(got["optimizer_state_dict"]["state"][0]["exp_avg"], want["optimizer_state_dict"]["state"][0]["exp_avg"])
    assert torch.equal(got["optimizer_state_dict"]["state"][1]["exp_avg"], torch.tensor([0.0, 1.0]))
    assert got["fp32"][0] is got["fp32"][1]
    assert got["bf16"].dtype == torch.bfloat16 and got["ds_version"] == "0.19.8"


def test_tag_item_has_one_shape_and_is_checked() -> None:
    assert tag_item("a")[TAG_KEY].shape == tag_item("global_step123456")[TAG_KEY].shape == (TAG_BYTES + 2,)
    assert tag_value(tag_item("")[TAG_KEY]) == ""
    with pytest.raises(ConfigError, match="shorter tag"):
        tag_item("x" * (TAG_BYTES + 1))
    bad = tag_item("ok")[TAG_KEY].clone()
    bad[0:2] = 255
    with pytest.raises(UntrustedDataError):
        tag_value(bad)


def test_a_planted_pickle_is_refused() -> None:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("true",))

    buf = io.BytesIO()
    pickle.dump({"a": Evil()}, buf)
    raw = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    f = deepspeed_files_of({"deepspeed/0/f.pt/pickle": raw})["f.pt"]
    with pytest.raises(UntrustedDataError, match="does not unpickle"):
        decode_file(f, {"deepspeed/0/f.pt/pickle": raw})


def deepspeed_files_of(items: dict[str, torch.Tensor]) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    md = Metadata(state_dict_metadata={k: TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.size(), [])
                                       for k, v in items.items()})
    return deepspeed_files(md)


# ---- the engine, driven as DeepSpeed's engine drives it ------------------------------------------------------
class FakeEngine:
    """What GeminiCheckpointEngine reads of a DeepSpeed engine (global_steps; ZeRO-1: weights not partitioned)."""

    def __init__(self) -> None:
        self.global_steps = 0
        self.optimizer = None

    def zero_optimization_partition_weights(self) -> bool:
        return False


def ds_save(ce: GeminiCheckpointEngine, save_dir: Path, tag: str, files: dict[str, Any]) -> None:
    """DeepSpeed's save_checkpoint, as the engine sees it (rank 0 of one)."""
    ce.makedirs(str(save_dir), exist_ok=True)
    info = SimpleNamespace(tag=tag, save_dir=str(save_dir), save_latest=True)
    ce.create(info)
    ce.makedirs(str(save_dir / tag), exist_ok=True)
    for name, sd in files.items():
        ce.save(sd, str(save_dir / tag / name))
    ce.commit(info)
    (save_dir / "latest").write_text(tag)


def ds_load(ce: GeminiCheckpointEngine) -> Any:
    """A stand-in for DeepSpeed's load_checkpoint: reads latest (tag None), checks and loads its files."""
    def load(load_dir: str, tag: Any = None, **_: Any) -> Any:
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                return None, None
            tag = open(latest).read()
        names = sorted(os.listdir(os.path.join(load_dir, tag)))
        return os.path.join(load_dir, tag), {n: ce.load(os.path.join(load_dir, tag, n)) for n in names}
    return load


def test_engine_saves_one_step_per_checkpoint_and_serves_the_load(tmp_path: Path) -> None:
    root, save_dir = tmp_path / "root", tmp_path / "ckpt"
    root.mkdir(mode=0o700)
    ce = GeminiCheckpointEngine(root=str(root), job_id="ds", keep=3)
    engine = FakeEngine()
    ce._engine = engine
    load = ds_load(ce)
    assert ce.load_checkpoint(load, str(save_dir)) == (None, None)  # a first launch
    assert ce.restored_step is None
    for step in (1, 2):
        engine.global_steps = step
        ds_save(ce, save_dir, f"global_step{step}", {"mp_rank_00_model_states.pt": {"module": {"w": torch.full((2,), step)}},
                                                    "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim_file()})
    assert sorted(os.listdir(save_dir)) == ["latest"]  # the files live in the tiers, not on disk
    with pytest.raises(ConfigError, match="one checkpoint per global step"):
        ds_save(ce, save_dir, "again", {"f.pt": {}})
    engine.global_steps = 3
    ds_save(ce, save_dir, "best", {"mp_rank_00_model_states.pt": {"module": {"w": torch.full((2,), 3)}}})
    # save_16bit_model: the file goes to disk and no step is made
    with ce.model_file_save():
        ce.create(SimpleNamespace(tag="global_step3", save_dir=str(save_dir), save_latest=False))
        ce.save({"w": torch.ones(1)}, str(save_dir / "pytorch_model.bin"))
        ce.commit(SimpleNamespace(tag="global_step3", save_dir=str(save_dir), save_latest=False))
    assert (save_dir / "pytorch_model.bin").is_file()

    os.remove(save_dir / "latest")  # a replaced node: its checkpoint directory is empty
    path, files = ce.load_checkpoint(load, str(save_dir))
    assert path == str(save_dir / "best") and ce.restored_step == 3
    assert torch.equal(files["mp_rank_00_model_states.pt"]["module"]["w"], torch.full((2,), 3))
    assert ce.restored_from["local"] > 0 and ce.restore_seconds is not None
    path, files = ce.load_checkpoint(load, str(save_dir), "global_step1")
    assert ce.restored_step == 1 and list(files["zero_pp_rank_0_mp_rank_00_optim_states.pt"]["optimizer_state_dict"]["state"]) == [0, 1]
    with pytest.raises(CheckpointNotFoundError, match="neither"):
        ce.load_checkpoint(load, str(save_dir), "nowhere")


def test_latest_naming_a_lost_checkpoint_is_an_error(tmp_path: Path) -> None:
    root, save_dir = tmp_path / "root", tmp_path / "ckpt"
    root.mkdir(mode=0o700)
    save_dir.mkdir()
    (save_dir / "latest").write_text("global_step9")
    ce = GeminiCheckpointEngine(root=str(root), job_id="lost")
    with pytest.raises(CheckpointNotFoundError, match="copies are gone"):
        ce.load_checkpoint(ds_load(ce), str(save_dir))


class FakeDeepSpeedEngine(FakeEngine):
    """The attributes use_gemini wraps, and DeepSpeed's save_16bit_model as the engine sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint_engine: Any = object()
        self.module = torch.nn.Linear(2, 2)
        self.destroyed = False

    def load_checkpoint(self, load_dir: str, tag: Any = None, **_: Any) -> Any:
        return None, None

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        info = SimpleNamespace(tag=f"global_step{self.global_steps}", save_dir=save_dir, save_latest=False)
        self.checkpoint_engine.create(info)
        self.checkpoint_engine.makedirs(save_dir, exist_ok=True)
        self.checkpoint_engine.save(self.module.state_dict(), os.path.join(save_dir, save_filename))
        self.checkpoint_engine.commit(info)
        return True

    def destroy(self) -> None:
        self.destroyed = True


def test_use_gemini_installs_once_and_16bit_models_go_to_disk(tmp_path: Path) -> None:
    from gemini_dcp.integrations.deepspeed import use_gemini

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="deepspeed.initialize"):
        use_gemini(object(), root=str(root), job_id="u")
    engine = FakeDeepSpeedEngine()
    ce = use_gemini(engine, root=str(root), job_id="u")
    assert engine.checkpoint_engine is ce and isinstance(ce, GeminiCheckpointEngine)
    with pytest.raises(ConfigError, match="once per engine"):
        use_gemini(engine, root=str(root), job_id="u")
    engine.global_steps = 4
    assert engine.save_16bit_model(str(tmp_path / "model"))
    assert (tmp_path / "model" / "pytorch_model.bin").is_file()
    assert ce.steps == {} and ce.writer.tier.steps() == []  # no step was made
    assert engine.load_checkpoint(str(tmp_path / "ckpt")) == (None, None)
    engine.destroy()
    assert engine.destroyed


def test_export_writes_deepspeeds_directory(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    root, save_dir, out = tmp_path / "root", tmp_path / "ckpt", tmp_path / "out"
    root.mkdir(mode=0o700)
    ce = GeminiCheckpointEngine(root=str(root), job_id="exp")
    files = {"mp_rank_00_model_states.pt": {"module": {"w": torch.arange(3.0)}, "global_steps": 5},
             "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim_file()}
    ds_save(ce, save_dir, "global_step5", files)
    res = CliRunner().invoke(app, ["export", "5", "--format", "deepspeed", "--to", str(out), "--root", str(root),
                                   "--job", "exp", "--json"])
    assert res.exit_code == 0, res.output
    assert (out / "latest").read_text() == "global_step5"
    assert sorted(os.listdir(out / "global_step5")) == sorted(files)
    model = torch.load(out / "global_step5" / "mp_rank_00_model_states.pt", weights_only=False)
    assert torch.equal(model["module"]["w"], torch.arange(3.0)) and model["global_steps"] == 5
    optim = torch.load(out / "global_step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert list(optim["optimizer_state_dict"]["state"]) == [0, 1]
