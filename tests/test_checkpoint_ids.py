"""DCP's path-style checkpoint ids: ``<folder>/step-<N>`` names step N (torchtitan's ids), in one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, InvalidStepError
from gemini_dcp.core.config import parse_step


@pytest.mark.parametrize(
    ("checkpoint_id", "step"),
    [
        (12, 12),
        ("12", 12),
        ("step-1200", 1200),
        ("outputs/checkpoint/step-1200", 1200),
        ("outputs/checkpoint/step-7/", 7),
        (Path("outputs") / "checkpoint" / "step-0", 0),
        ("s3://bucket/run/step-42", 42),
    ],
)
def test_step_ids(checkpoint_id: object, step: int) -> None:
    assert parse_step(checkpoint_id) == step
    assert GeminiStorageWriter.validate_checkpoint_id(checkpoint_id)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "checkpoint_id", ["step-", "step-x", "step_3", "outputs/step-3/model", "checkpoint", "step--1", True, -1, 3.0,
                      "\u00b2", "\u0663", "step-\u0663", "1\u00b2", "\uff11\uff12"]  # superscript, Arabic-Indic, fullwidth
)
def test_other_ids_keep_the_clear_error(checkpoint_id: object) -> None:
    with pytest.raises(InvalidStepError, match="checkpoint_id"):
        parse_step(checkpoint_id)
    assert not GeminiStorageWriter.validate_checkpoint_id(checkpoint_id)  # type: ignore[arg-type]


def test_save_and_load_with_path_ids(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    for n in (100, 200):
        sd["w"] += n
        dcp.save(sd, storage_writer=GeminiStorageWriter(root=root, job_id="tt"),
                 checkpoint_id=os.path.join("outputs", "checkpoint", f"step-{n}"))
    out = {"w": torch.zeros(3, 4), "b": torch.zeros(5)}
    reader = GeminiStorageReader(root=root, job_id="tt")
    dcp.load(out, storage_reader=reader, checkpoint_id=Path("elsewhere") / "step-200")
    assert reader.restored_step == 200
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    newest = {"w": torch.zeros(3, 4), "b": torch.zeros(5)}
    dcp.load(newest, storage_reader=GeminiStorageReader(root=root, job_id="tt"))
    assert torch.equal(newest["w"], sd["w"])
