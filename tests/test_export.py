"""Issue 4: safetensors export and stock-checkpoint materialization from any tier reachable from this host."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks
from safetensors.torch import load_file
from workloads import COLS, ROWS, full_weight, save_steps

from gemini_dcp import ConfigError, GeminiStorageWriter, ShardUnavailableError
from gemini_dcp.persistent.export import export_safetensors
from gemini_dcp.persistent.stock_format import materialize_step
from gemini_dcp.persistent.store import PersistentTier


@pytest.fixture(autouse=True)
def _short_lived_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMINI_DCP_DRAIN_IDLE_S", "3")


def _shm_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)


def _model_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "embed.weight": torch.randn(50, 16, generator=g),
            "layers.0.w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
            "layers.0.b": torch.arange(16, dtype=torch.int32),
            "scale": torch.tensor(1.5),
        },
        "optim": {"m": torch.ones(3)},
        "step": step,
    }


def test_export_from_memory_single_and_sharded(tmp_path: Path) -> None:
    root = _shm_dir("gemini-etest-")
    try:
        dcp.save(_model_state(4), storage_writer=GeminiStorageWriter(root=root, job_id="e"), checkpoint_id=4)
        want = _model_state(4)["model"]
        path = export_safetensors(None, tmp_path / "one", root=root, job_id="e")
        assert path.name == "model.safetensors"
        got = load_file(str(path))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
        # sharded: index json + shards, same tensors
        idx = export_safetensors(4, tmp_path / "sharded", root=root, job_id="e", max_shard_bytes=2048)
        assert idx.name == "model.safetensors.index.json"
        index = json.loads(idx.read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and all((idx.parent / f).exists() for f in files)
        merged: dict[str, torch.Tensor] = {}
        for f in files:
            merged.update(load_file(str(idx.parent / f)))
        assert set(merged) == set(want) and all(torch.equal(merged[k], want[k]) for k in want)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
        # everything, names unchanged
        allp = load_file(str(export_safetensors(4, tmp_path / "all", root=root, job_id="e", prefix="")))
        assert "optim.m" in allp and "model.scale" in allp
        with pytest.raises(ConfigError, match="model."):
            export_safetensors(4, tmp_path / "bad", root=root, job_id="e", prefix="nope.")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_export_and_materialize_across_nodes_and_tiers(tmp_path: Path) -> None:
    """2 ranks on 2 simulated nodes save DTensor shards (drained to a file store); this host only has node 0."""
    roots = [_shm_dir(f"gemini-enode{i}-") for i in range(2)]
    store = tmp_path / "store"
    url = f"file://{store}"
    job = "x"
    try:
        run_ranks(save_steps, 2, roots, job=job, steps=[1, 2], persistent=url, persist_every=2)
        assert PersistentTier(url, job).wait_for_step(2, timeout_s=240)
        want_w, want_b = full_weight(2), torch.arange(COLS, dtype=torch.float64) + 2

        # node 0's memory alone holds half of every sharded tensor
        with pytest.raises(ShardUnavailableError, match="rank1"):
            export_safetensors(2, tmp_path / "x0", root=roots[0], job_id=job)
        # with the persistent tier, node 1's chunks come from the store: full tensors reassembled
        got = load_file(str(export_safetensors(2, tmp_path / "x1", root=roots[0], job_id=job, persistent=url)))
        assert torch.equal(got["w"], want_w) and torch.equal(got["b"], want_b) and got["w"].shape == (ROWS, COLS)
        # from the store alone (no memory tier on this host)
        got = load_file(str(export_safetensors(2, tmp_path / "x2", root=str(tmp_path / "none"), job_id=job, persistent=url)))
        assert torch.equal(got["w"], want_w)

        # materialize for the CLI: incomplete from node 0 alone
        dest = tmp_path / "flush"
        with pytest.raises(ShardUnavailableError, match="rank1"):
            materialize_step(2, str(dest), root=roots[0], job_id=job)
        calls: list[tuple[int, int]] = []
        r0 = materialize_step(2, str(dest), root=roots[0], job_id=job, allow_partial=True, progress=lambda d, t: calls.append((d, t)))
        assert not r0["complete"] and r0["missing"] and r0["from_memory"] > 0
        assert calls and calls[-1][0] == calls[-1][1]
        assert not (dest / ".metadata").exists()
        r1 = materialize_step(2, str(dest), root=roots[1], job_id=job, allow_partial=True)  # the other node's part
        assert r1["complete"] and r1["missing"] == [] and (dest / ".metadata").exists()
        sd = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.float64)}, "step": 0}
        dcp.load(sd, checkpoint_id=str(dest))
        assert torch.equal(sd["model"]["w"], want_w) and torch.equal(sd["model"]["b"], want_b) and sd["step"] == 2
        # memory + persistent in one go, to another fsspec URL
        r = materialize_step(None, f"file://{tmp_path}/restored", root=roots[0], job_id=job, persistent=url)
        assert r["complete"] and r["step"] == 2 and r["from_persistent"] > 0 and r["from_memory"] > 0
        sd = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.float64)}, "step": 0}
        dcp.load(sd, checkpoint_id=str(tmp_path / "restored"))
        assert torch.equal(sd["model"]["w"], want_w)
    finally:
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)
