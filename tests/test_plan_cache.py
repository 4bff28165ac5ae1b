"""Issue 27: DCP's own plan cache (``DefaultSavePlanner(enable_plan_caching=True)``, torch >= 2.7)
with ``GeminiStorageWriter``, 2 real gloo ranks.

With the cache DCP sends an empty local plan when a rank's plan is unchanged and reuses the
cached global plan and metadata; the writer then sees the *same* plan and metadata objects save
after save (its per-plan copy program and the pickled metadata are reused). Every step must
restore bit-exact, including the save whose structure changed (a new key and a reshaped
tensor: DCP plans again) and the saves after it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks

pytestmark = pytest.mark.skipif(
    "enable_plan_caching" not in __import__("inspect").signature(
        __import__("torch.distributed.checkpoint.default_planner", fromlist=["x"]).DefaultSavePlanner.__init__
    ).parameters,
    reason="DCP's plan cache needs torch >= 2.7",
)


@pytest.fixture
def roots() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-plancache-", dir=base)
    paths = [os.path.join(d, f"node{i}") for i in range(2)]
    for p in paths:
        os.makedirs(p)
    yield paths
    shutil.rmtree(d, ignore_errors=True)


def _state(rank: int, step: int, changed: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(100 * step + rank)
    rows = 6 if changed else 4
    sd: dict[str, Any] = {
        f"layers.{i}.weight": DTensor.from_local(torch.randn(rows if i == 0 else 4, 8, generator=g), mesh, [Shard(0)],
                                                 run_check=False)
        for i in range(12)
    }
    sd["small"] = torch.randn(3, generator=g)
    sd["step"] = step
    if changed:
        sd["layers.new.bias"] = DTensor.from_local(torch.randn(2, generator=g), mesh, [Shard(0)], run_check=False)
    return sd


def _zeroed(sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {
        k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False)
        if isinstance(v, DTensor) else (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1)
        for k, v in sd.items()
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return a.keys() == b.keys() and all(
        torch.equal(a[k].to_local(), v.to_local()) if isinstance(v, DTensor)
        else (torch.equal(a[k], v) if isinstance(v, torch.Tensor) else a[k] == v)
        for k, v in b.items()
    )


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in b if not _equal({k: a.get(k)}, {k: b[k]})]


def _cached_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    writer = GeminiStorageWriter(root=root, job_id="plancache", keep=8)
    plans: list[int] = []
    states: dict[int, dict[str, Any]] = {}
    changed_at = 4
    for step in range(1, 8):
        sd = _state(rank, step, changed=step >= changed_at)
        states[step] = sd
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = "test_plan_cache"  # DCP's cache is class-level
        dcp.save(sd, storage_writer=writer, checkpoint_id=step, planner=planner)
        plans.append(writer.local_writer.programs_built)
    exact = {}
    for step, sd in states.items():
        out = _zeroed(sd)
        dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id="plancache"), checkpoint_id=step)
        exact[step] = _equal(out, sd) or _diff(out, sd)
    return {"exact": exact, "programs_built": plans}


@pytest.mark.timeout(300)
def test_plan_cache_with_gemini_writer_is_bit_exact_across_saves_and_a_structure_change(roots: list[str]) -> None:
    res = run_ranks(_cached_saves, 2, roots, timeout=280)
    for r in res:
        assert all(r["exact"].values()), r["exact"]
        built = r["programs_built"]
        # One copy program while the plan holds (DCP's cached plan is reused), a new one for the
        # structure change at step 4, then reused again.
        assert built == [1, 1, 1, 2, 2, 2, 2], built


# ---- the writer's copy program, one process (no collectives) -------------------------------------
@pytest.mark.parametrize("algo", ["crc32c", "xxh3"])
def test_copy_program_checksums_match_and_a_changed_tensor_builds_a_new_program(tmp_path: Any, algo: str) -> None:
    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
    from gemini_dcp.core.checksum import checksum

    writer = GeminiStorageWriter(root=tmp_path, job_id="program", keep=2, checksum=algo)
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {f"w{i}": torch.randn(5, 3, generator=g) for i in range(40)}
    sd["big"] = torch.randn(300_000, generator=g)  # >= 1 MiB: the fused copy, one item
    sd["t"] = torch.randn(4, 4, generator=g).t()  # not contiguous: copied by _foreach_copy_ all the same
    sd["p"] = torch.nn.Parameter(torch.randn(7, generator=g))
    sd["step"] = 0
    for step in range(1, 4):
        sd["step"] = step
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                with torch.no_grad():
                    v.add_(1)
        dcp.save(sd, storage_writer=writer, checkpoint_id=step, no_dist=True)
        rec = writer.tier.record(step)
        assert rec is not None
        rs = rec.slot_of(0)
        assert rs is not None
        slot = writer.slot(0, rs.slot)
        for ref in rec.metadata.storage_data.values():
            assert ref.algo == algo and checksum(slot.view(ref.offset, ref.length), algo) == ref.checksum
        out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in sd.items()}
        dcp.load(out, storage_reader=GeminiStorageReader(root=tmp_path, job_id="program"), checkpoint_id=step, no_dist=True)
        assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in sd.items())
    assert writer.local_writer.programs_built == 1
    sd["w3"].data = torch.randn(6, 3, generator=g)  # the same object, another shape: a new program
    dcp.save(sd, storage_writer=writer, checkpoint_id=4, no_dist=True)
    assert writer.local_writer.programs_built == 2
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in sd.items()}
    dcp.load(out, storage_reader=GeminiStorageReader(root=tmp_path, job_id="program"), checkpoint_id=4, no_dist=True)
    assert torch.equal(out["w3"], sd["w3"])
