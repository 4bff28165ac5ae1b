"""torch release compatibility: the supported range's one source of truth, and torch 2.15's DCP additions.

* The torch range that ``gemini-dcp doctor`` and ``scripts/install.sh`` check is read from the
  installed package's metadata (pyproject.toml's requirement), parsed with or without ``packaging``.
* ``torch.distributed.checkpoint.CheckpointableTensor`` (torch >= 2.15): a plain local tensor
  carrying ``global_shape``/``global_offsets``/``local_offsets``/``local_sizes`` is a state-dict
  item kind. Its shards save and load through GeminiStorageWriter/Reader and through
  AsyncCheckpointer's plan replay (a moved shard boundary re-plans), resharded on load, on 2 ranks.
"""

from __future__ import annotations

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
from mp_utils import run_ranks

from gemini_dcp import GeminiStorageReader, GeminiStorageWriter
from gemini_dcp.core.compat import HAS_CHECKPOINTABLE_TENSOR, checkpointable_fields
from gemini_dcp.core.torch_support import (
    TorchRequirement,
    pyproject_torch_requirement,
    torch_requirement,
    torchrec_pairing,
    torchrec_support,
)

REPO = Path(__file__).resolve().parent.parent
needs_protocol = pytest.mark.skipif(
    not HAS_CHECKPOINTABLE_TENSOR, reason="torch.distributed.checkpoint.CheckpointableTensor is new in torch 2.15"
)


# ---- the supported range ---------------------------------------------------------------------------
def test_range_comes_from_the_package_metadata() -> None:
    req = torch_requirement()
    assert req.source.startswith("metadata of gemini-dcp"), req.source
    # the metadata is built from pyproject.toml: the same requirement (install.sh reinstalls a stale one)
    assert str(req) == str(pyproject_torch_requirement())
    assert req.admits(torch.__version__), f"the running torch {torch.__version__} is outside {req}"


@pytest.mark.parametrize("with_packaging", [True, False])
def test_requirement_parsing(with_packaging: bool) -> None:
    req = TorchRequirement("<2.16,>=2.7", "test")
    if not with_packaging:
        req._spec = None  # the small parser used where packaging is not installed
    assert str(req) == ">=2.7,<2.16" and req.pip_spec() == "torch>=2.7,<2.16"
    for v in ("2.7", "2.7.0", "2.7.1", "2.13.0+cpu", "2.15.0", "2.15.0+cu132", "2.15.1"):
        assert req.admits(v), v
    for v in ("2.6.0", "2.6.99+cpu", "2.16.0", "2.16.0+cpu", "3.0.0"):
        assert not req.admits(v), v
    pinned = TorchRequirement("==2.15.*", "test")
    if not with_packaging:
        pinned._spec = None
    assert pinned.admits("2.15.0+cu132") and not pinned.admits("2.14.1")


def test_pyproject_parser_without_tomllib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Python 3.10 has no tomllib: the dependencies array is read with a regular expression.
    py = tmp_path / "pyproject.toml"
    py.write_text('[project]\nname = "x"\ndependencies = [\n    "numpy>=1",\n    "torch >= 2.8, < 2.20",\n]\n'
                  '[project.optional-dependencies]\ntest = ["torch==2.1"]\n')
    monkeypatch.setitem(sys.modules, "tomllib", None)  # import tomllib -> ImportError
    assert str(pyproject_torch_requirement(py)) == ">=2.8,<2.20"


def test_torchrec_pairings() -> None:
    assert torchrec_support() == "2.7, 2.9-2.14"
    assert torchrec_pairing("2.13.0+cpu") == ("1.8.0", "1.8.0", "tensordict")
    assert torchrec_pairing("2.15.0") is None and torchrec_pairing("2.8.0") is None


def _support(*args: str) -> subprocess.CompletedProcess[str]:
    # Run by path, as install.sh does (no gemini_dcp import, so no torch needed).
    return subprocess.run([sys.executable, str(REPO / "gemini_dcp" / "core" / "torch_support.py"), *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_install_script_helper() -> None:
    assert _support("range").stdout.strip() == str(torch_requirement())
    assert _support("check", "2.7.1").returncode == 0
    bad = _support("check", "2.6.0")
    assert bad.returncode == 1 and "torch 2.6.0 is outside gemini-dcp's supported range >=2.7" in bad.stderr
    assert _support("torchrec", "2.14.1").stdout.split() == ["1.9.0", "1.9.0", "tensordict"]
    assert _support("torchrec", "2.15.0").stdout == ""
    assert _support("stale").returncode == 1  # installed metadata agrees with pyproject.toml
    script = (REPO / "scripts" / "install.sh").read_text()
    assert "torch_support.py" in script and "2.14)" not in script  # no copy of the pairing table


def test_doctor_reads_the_range_from_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemini_dcp.ops import doctor as doc

    ok = doc._torch_check()
    assert ok.status == "pass" and str(torch_requirement()) in ok.detail
    monkeypatch.setattr(doc, "torch_requirement", lambda: TorchRequirement(">=9.0", "metadata of gemini-dcp 0.0"))
    bad = doc._torch_check()
    assert bad.status == "fail" and ">=9.0" in bad.detail and "torch>=9.0" in bad.fix
    monkeypatch.setattr(doc, "installed_torch_version", lambda: "2.15.0")
    rec = doc._torchrec_check()
    assert rec.status == "info" and "2.7, 2.9-2.14" in rec.detail and "2.15.0" in rec.detail


def test_fsspec_storage_from_the_public_module_where_it_exists() -> None:
    import importlib.util

    from gemini_dcp.core.compat import fsspec_writer_reader

    writer, reader = fsspec_writer_reader()
    assert (writer.__name__, reader.__name__) == ("FsspecWriter", "FsspecReader")
    if importlib.util.find_spec("torch.distributed.checkpoint.fsspec_filesystem") is not None:  # torch >= 2.15
        assert writer.__module__ == reader.__module__ == "torch.distributed.checkpoint.fsspec_filesystem"
    # Nothing else imports the private module (deprecated in 2.15): compat.py's fallback is the one place.
    users = [p.relative_to(REPO) for d in ("gemini_dcp", "cli", "benchmarks", "examples") for p in (REPO / d).rglob("*.py")
             if "_fsspec_filesystem" in p.read_text(encoding="utf-8")]
    assert users == [Path("gemini_dcp/core/compat.py")], users


# ---- CheckpointableTensor ------------------------------------------------------------------------
H, W = 12, 6
#: A shard: (global row/col offsets, sizes, offsets inside the local tensor). Per layout, per rank.
Shard = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
LAYOUTS: dict[str, list[list[Shard]]] = {
    # uneven row split
    "rows": [[((0, 0), (5, W), (0, 0))], [((5, 0), (7, W), (0, 0))]],
    # each rank holds two row blocks in one local tensor, a padding row between them
    "two": [[((0, 0), (3, W), (0, 0)), ((6, 0), (3, W), (4, 0))], [((3, 0), (3, W), (0, 0)), ((9, 0), (3, W), (4, 0))]],
    # the same local shapes as "two" (8 x W on both ranks), boundaries moved: only the shard fields change
    "moved": [[((2, 0), (3, W), (0, 0)), ((8, 0), (4, W), (3, 0))], [((0, 0), (2, W), (0, 0)), ((5, 0), (3, W), (4, 0))]],
    # column split, each shard behind a padding column: strided views on load
    "cols": [[((0, 0), (H, 2), (0, 1))], [((0, 2), (H, 4), (0, 1))]],
}
PAD = -7.0


def _global(step: int) -> torch.Tensor:
    return torch.arange(H * W, dtype=torch.float32).reshape(H, W) + 1000.0 * step


def _local(layout: str, rank: int, step: int | None) -> torch.Tensor:
    """Rank ``rank``'s CheckpointableTensor of ``layout``: the global tensor of ``step`` in its
    shards (PAD elsewhere), or all PAD when ``step`` is None (a load target)."""
    shards = LAYOUTS[layout][rank]
    shape = [max(lo[d] + size[d] for _, size, lo in shards) + (1 if len(shards) > 1 and d == 0 else 0) for d in range(2)]
    t = torch.full(shape, PAD)
    if step is not None:
        g = _global(step)
        for go, size, lo in shards:
            t[lo[0]:lo[0] + size[0], lo[1]:lo[1] + size[1]] = g[go[0]:go[0] + size[0], go[1]:go[1] + size[1]]
    t.global_shape = (H, W)  # type: ignore[attr-defined]
    t.global_offsets = tuple(go for go, _, _ in shards)  # type: ignore[attr-defined]
    t.local_offsets = tuple(lo for _, _, lo in shards)  # type: ignore[attr-defined]
    t.local_sizes = tuple(size for _, size, _ in shards)  # type: ignore[attr-defined]
    return t


def _check(t: torch.Tensor, layout: str, rank: int, step: int) -> bool:
    """``t`` holds ``step``'s global values in its shards and PAD everywhere else."""
    want = _local(layout, rank, step)
    return torch.equal(t, want)


def test_layouts_cover_the_global_tensor() -> None:
    for name, ranks in LAYOUTS.items():
        cover = torch.zeros(H, W, dtype=torch.int32)
        for shards in ranks:
            for go, size, _ in shards:
                cover[go[0]:go[0] + size[0], go[1]:go[1] + size[1]] += 1
        assert bool((cover == 1).all()), name
    assert [_local("two", r, 0).shape for r in (0, 1)] == [_local("moved", r, 0).shape for r in (0, 1)]


def test_structure_key_sees_moved_shard_boundaries() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from gemini_dcp.snapshot.replay import structure_key

    def key(t: torch.Tensor) -> Any:
        flat, mappings = flatten_state_dict({"w": t, "step": 1})
        return structure_key(flat, mappings)

    two, moved = _local("two", 0, 0), _local("moved", 0, 0)
    assert two.shape == moved.shape
    if HAS_CHECKPOINTABLE_TENSOR:
        assert key(two) != key(moved) and key(two) == key(_local("two", 0, 5))
        bad = _local("two", 0, 0)
        bad.global_offsets = (("x", 0),)  # type: ignore[attr-defined]
        assert key(bad) is None  # unkeyable: the full local plans are compared
    else:  # older DCP ignores the attributes: so does the key
        assert key(two) == key(moved)


def test_snapshot_clone_keeps_the_shard_layout() -> None:
    from gemini_dcp.snapshot.structure import clone_tensor, snapshot_structure, storage_key

    t = _local("two", 1, 3)
    c = clone_tensor(t)
    assert c.data_ptr() != t.data_ptr() and torch.equal(c, t)
    assert checkpointable_fields(c) == checkpointable_fields(t) is not None
    sd = snapshot_structure({"m": {"buf": t}}, {storage_key(t)})  # a model buffer: cloned at save()
    assert checkpointable_fields(sd["m"]["buf"]) == checkpointable_fields(t)


@pytest.fixture
def roots() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-compat-", dir=base)
    paths = [os.path.join(d, f"node{i}") for i in range(2)]
    for p in paths:
        os.makedirs(p)
    yield paths
    shutil.rmtree(d, ignore_errors=True)


def _load(root: str, job: str, step: int, layout: str, rank: int) -> tuple[bool, bool, Any]:
    """Load ``step`` into ``layout``'s CheckpointableTensor and into a plain full tensor."""
    out = {"w": _local(layout, rank, None), "full": torch.zeros(H, W), "step": -1}
    reader = GeminiStorageReader(root=root, job_id=job)
    dcp.load(out, storage_reader=reader, checkpoint_id=step)
    return _check(out["w"], layout, rank, step), torch.equal(out["full"], _global(step)), out["step"]


def _state(layout: str, rank: int, step: int) -> dict[str, Any]:
    # "full": the global tensor again, as a plain replicated tensor (saved once, by the plan's dedup)
    return {"w": _local(layout, rank, step), "full": _global(step), "step": step}


def _sync_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """dcp.save with GeminiStorageWriter in one layout, loads in every other layout."""
    writer = GeminiStorageWriter(root=root, job_id="ct", keep=4)
    results: dict[str, Any] = {}
    for step, layout in enumerate(("rows", "two", "cols")):
        meta = dcp.save(_state(layout, rank, step), storage_writer=writer, checkpoint_id=step)
        md = meta.state_dict_metadata["w"]
        results[f"meta{step}"] = (tuple(md.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
    for step in range(3):
        for layout in ("rows", "two", "cols"):
            results[f"{step}->{layout}"] = _load(root, "ct", step, layout, rank)
    return results


@needs_protocol
@pytest.mark.timeout(300)
def test_checkpointable_tensor_saves_and_reshards_through_gemini(roots: list[str]) -> None:
    res = run_ranks(_sync_saves, 2, roots, timeout=280)
    for r in res:
        for step, layout in enumerate(("rows", "two", "cols")):
            # the global metadata holds the global shape and every rank's shards, not the local tensors
            chunks = sorted((go, size) for shards in LAYOUTS[layout] for go, size, _ in shards)
            assert r[f"meta{step}"] == ((H, W), chunks), (step, r[f"meta{step}"])
        for step in range(3):
            for layout in ("rows", "two", "cols"):
                assert r[f"{step}->{layout}"] == (True, True, step), (step, layout, r[f"{step}->{layout}"])


def _async_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """AsyncCheckpointer with plan replay: a moved boundary (same local shapes) re-plans."""
    from gemini_dcp.snapshot.checkpointer import AsyncCheckpointer

    plan = [("two", 0), ("two", 1), ("moved", 2), ("moved", 3), ("two", 4)]
    kinds = []
    ck = AsyncCheckpointer(GeminiStorageWriter(root=root, job_id="ctasync", keep=8), interleave=False)
    try:
        assert ck.replay is not None
        for layout, step in plan:
            before = ck.replay.planned
            ck.save(_state(layout, rank, step), step).wait(120)
            kinds.append("plan" if ck.replay.planned > before else "replay")
    finally:
        ck.close()
    loads = {step: [_load(root, "ctasync", step, target, rank) for target in ("rows", "moved", "cols")] for _, step in plan}
    return {"kinds": kinds, "loads": loads}


@needs_protocol
@pytest.mark.timeout(300)
def test_checkpointable_tensor_through_plan_replay(roots: list[str]) -> None:
    res = run_ranks(_async_saves, 2, roots, timeout=280)
    want = ["plan", "replay", "plan", "replay", "plan"]  # boundaries moved at 2 and back at 4
    assert [r["kinds"] for r in res] == [want, want]
    for r in res:
        for step, outcomes in r["loads"].items():
            assert outcomes == [(True, True, step)] * 3, (step, outcomes)


def _one_rank(split: int, fill: bool) -> torch.Tensor:
    """All of the global tensor of step 1 on one rank, as two row shards split at ``split`` (a padding row between)."""
    t = torch.full((H + 1, W), PAD)
    if fill:
        g = _global(1)
        t[:split], t[split + 1:] = g[:split], g[split:]
    t.global_shape = (H, W)  # type: ignore[attr-defined]
    t.global_offsets = ((0, 0), (split, 0))  # type: ignore[attr-defined]
    t.local_offsets = ((0, 0), (split + 1, 0))  # type: ignore[attr-defined]
    t.local_sizes = ((split, W), (H - split, W))  # type: ignore[attr-defined]
    return t


@needs_protocol
def test_checkpointable_tensor_through_the_persistent_tier(tmp_path: Path) -> None:
    from gemini_dcp.persistent.stock_format import materialize_step
    from gemini_dcp.persistent.store import PersistentTier

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="gemini-compat1-", dir=base)
    for node in ("a", "b"):
        os.mkdir(f"{d}/{node}", 0o700)
    try:
        dcp.save({"w": _one_rank(3, True)}, storage_writer=GeminiStorageWriter(root=f"{d}/a", job_id="ct1"), checkpoint_id=1)
        url = (tmp_path / "store").as_uri()
        materialize_step(1, PersistentTier(url, "ct1", writable=True).step_url(1), root=f"{d}/a", job_id="ct1")
        # a node with an empty memory tier: the shards come from the store, into other boundaries
        out = {"w": _one_rank(8, False)}
        reader = GeminiStorageReader(root=f"{d}/b", job_id="ct1", persistent=url)
        dcp.load(out, storage_reader=reader)
        assert reader.restored_from["persistent"] > 0 and torch.equal(out["w"], _one_rank(8, True))
        # the store is stock DCP: a plain tensor of the global shape loads it without gemini_dcp
        full = torch.zeros(H, W)
        dcp.load({"w": full}, checkpoint_id=PersistentTier(url, "ct1").step_url(1))
        assert torch.equal(full, _global(1))
    finally:
        shutil.rmtree(d, ignore_errors=True)
