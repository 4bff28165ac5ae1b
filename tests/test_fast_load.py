"""gemini_dcp.fast_load: the structure-aware restore from the local tier and its dcp.load fallback.

Single-process tests cover the plan, the cache, the fallbacks and a corrupt byte; one 2-rank run
(two simulated nodes) covers DTensor shards, resharding, a corrupt byte repaired from the peer,
a wiped node, and that ranks always take the same path.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import node_root_factory, run_ranks, wipe

from gemini_dcp import FastLoadResult, GeminiStorageWriter, fast_load
from gemini_dcp.core.checksum import buffer_checksum
from gemini_dcp.core.chunk_sink import failed_spans, land_same_dtype
from gemini_dcp.errors import CheckpointMismatchError, ChecksumMismatchError, ConfigError, find_gemini_error
from gemini_dcp.local.tier import LocalTier
from gemini_dcp.restore import fast_plan

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def root() -> Iterator[str]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-fl-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _saved() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 5, generator=g),
        "i": torch.arange(7, dtype=torch.int32),
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "nested": {"m": torch.randn(2, 2, generator=g), "step": 11},
        "epoch": 3,
        "empty": torch.empty(0, 4),
    }


def _zeros() -> dict[str, Any]:
    s = _saved()
    return {
        "w": torch.zeros_like(s["w"]), "i": torch.zeros_like(s["i"]), "h": torch.zeros_like(s["h"]),
        "nested": {"m": torch.zeros(2, 2), "step": 0}, "epoch": 0, "empty": torch.empty(0, 4),
    }


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy()) if t.numel() else b""


def _assert_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_exact(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and _bits(got[k]) == _bits(v), k
        else:
            assert got[k] == v, k


def _save(root: str, step: int = 1) -> None:
    dcp.save(_saved(), storage_writer=GeminiStorageWriter(root=root, job_id="fl"), checkpoint_id=step)


def _flip(root: str, fqn: str, step: int = 1) -> None:
    tier = LocalTier(root, "fl")
    rec = tier.record(step)
    assert rec is not None
    ref = next(r for i, r in rec.metadata.storage_data.items() if i.fqn == fqn)
    slot = next(s for s in rec.slots if s.rank == ref.rank)
    with open(tier.slot_path(ref.rank, slot.slot), "r+b") as f:
        f.seek(ref.offset + ref.length // 2)
        b = f.read(1)
        f.seek(ref.offset + ref.length // 2)
        f.write(bytes([b[0] ^ 0xFF]))


# ---- single process -------------------------------------------------------------------------------
def test_fast_path_is_bit_exact_and_the_second_restore_uses_the_cached_map(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(root)
    got = _zeros()
    res = fast_load(got, root=root, job_id="fl")
    assert res.path == "fast" and res.step == 1 and res.reason == ""
    assert res.restored_from["local"] == res.nbytes > 0
    _assert_exact(got, _saved())
    built: list[int] = []
    real = fast_plan.build_plan
    monkeypatch.setattr("gemini_dcp.dcp.fast_load.build_plan", lambda *a: built.append(1) or real(*a))
    again = _zeros()
    assert fast_load(again, root=root, job_id="fl").path == "fast"
    _assert_exact(again, _saved())
    assert built == []  # same structure, same record: the cached map
    subset = {"w": torch.zeros(8, 5)}  # a state dict that asks for fewer keys than were saved
    assert fast_load(subset, root=root, job_id="fl").path == "fast" and built == [1]
    assert torch.equal(subset["w"], _saved()["w"])


class _App:
    """A Stateful application state, as a trainer hands it to dcp.load: state_dict() / load_state_dict()."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.state["w"], "nested": dict(self.state["nested"]), "epoch": self.state["epoch"]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded.append(sd)
        self.state["w"].copy_(sd["w"])
        self.state["nested"] = sd["nested"]
        self.state["epoch"] = sd["epoch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: the dcp.load fallback
def test_top_level_stateful_values_are_restored_as_dcp_load_does(root: str, dtype: torch.dtype) -> None:
    saved = _saved()
    app_saved = _App({"w": saved["w"], "nested": saved["nested"], "epoch": saved["epoch"]})
    dcp.save({"app": app_saved, "top": 5}, storage_writer=GeminiStorageWriter(root=root, job_id="fl"), checkpoint_id=1)
    app = _App({"w": torch.zeros(8, 5, dtype=dtype), "nested": {"m": torch.zeros(2, 2), "step": 0}, "epoch": 0})
    sd: dict[str, Any] = {"app": app, "top": 0}
    res = fast_load(sd, root=root, job_id="fl")
    assert res.path == ("fast" if dtype == torch.float32 else "dcp")
    assert len(app.loaded) == 1  # given back once, after the restore
    assert torch.equal(app.state["w"], saved["w"].to(dtype)) and app.state["epoch"] == 3
    assert torch.equal(app.state["nested"]["m"], saved["nested"]["m"]) and app.state["nested"]["step"] == 11
    assert sd["top"] == 5


def test_structure_differs_falls_back_to_dcp_load_exactly(root: str) -> None:
    _save(root)
    got = _zeros()
    got["w"] = torch.zeros(8, 5, dtype=torch.float64)  # dtype change: dcp.load converts, as stock
    res = fast_load(got, root=root, job_id="fl")
    assert res.path == "dcp" and "float64" in res.reason
    assert torch.equal(got["w"], _saved()["w"].double())
    noncontig = torch.zeros(5, 8).t()
    res = fast_load({"w": noncontig}, root=root, job_id="fl")
    assert res.path == "dcp" and torch.equal(noncontig, _saved()["w"])
    extra = _zeros()
    extra["new"] = torch.zeros(2)
    with pytest.raises(BaseException) as err:  # the fallback's own clear error (DCP may wrap it)
        fast_load(extra, root=root, job_id="fl")
    assert isinstance(find_gemini_error(err.value), CheckpointMismatchError)
    assert torch.count_nonzero(extra["w"]) == 0  # all-or-nothing: nothing landed


def test_a_corrupt_byte_is_caught_before_anything_lands(root: str) -> None:
    _save(root)
    _flip(root, "w")
    got = _zeros()
    with pytest.raises(BaseException) as err:  # the fast path declines; dcp.load has no other copy
        fast_load(got, root=root, job_id="fl")
    assert isinstance(find_gemini_error(err.value), ChecksumMismatchError)
    assert all(torch.count_nonzero(got[k]) == 0 for k in ("w", "i", "h")) and got["epoch"] == 0


def test_options_and_result_are_validated(root: str) -> None:
    from gemini_dcp import GeminiStorageReader

    with pytest.raises(ConfigError, match="not both"):
        fast_load({}, root=root, job_id="fl", storage_reader=GeminiStorageReader(root=root, job_id="fl"))
    with pytest.raises(ConfigError, match="path"):
        FastLoadResult(path="slow", step=1, nbytes=0)


def test_batched_verify_and_land() -> None:
    data = bytes(range(256)) * 4
    mv = memoryview(data)
    crc = buffer_checksum("xxh3")
    spans = [(0, 10, "xxh3", crc(mv[0:10])), (100, 50, "xxh3", crc(mv[100:150])), (5, 0, "xxh3", crc(b""))]
    assert failed_spans(mv, spans) == []
    assert failed_spans(mv, [*spans, (0, 10, "xxh3", 1)]) == [3]
    dests = [torch.zeros(3), torch.zeros(2, dtype=torch.int64)]
    land_same_dtype(dests, [torch.ones(3), torch.tensor([4, 5])])
    assert dests[0].tolist() == [1, 1, 1] and dests[1].tolist() == [4, 5]
    with pytest.raises(ValueError):
        land_same_dtype(dests, [])


# ---- two ranks, two simulated nodes ---------------------------------------------------------------
def _dstate(world: int, placement: Any, fill: float | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    full = torch.randn(6, 4, generator=g)
    plain = torch.randn(5, generator=g)
    if fill is not None:
        full, plain = torch.full_like(full, fill), torch.full_like(plain, fill)
    return {"d": distribute_tensor(full, mesh, [placement]), "p": plain, "meta": {"step": 0 if fill is not None else 9}}


def _exact(rank: int, world: int, got: dict[str, Any]) -> bool:
    from torch.distributed.tensor import Shard

    want = _dstate(world, Shard(0))
    return (
        torch.equal(got["d"].full_tensor(), want["d"].full_tensor())
        and torch.equal(got["p"], want["p"])
        and got["meta"]["step"] == 9
    )


def _two_nodes(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    out: dict[str, Any] = {}
    dcp.save(_dstate(world, Shard(0)), storage_writer=GeminiStorageWriter(root=root, job_id="fl", replicas=2), checkpoint_id=1)

    def restore(name: str, placement: Any = None) -> None:
        got = _dstate(world, placement or Shard(0), fill=0.0)
        res = fast_load(got, root=root, job_id="fl")
        out[name] = (res.path, res.restored_from, _exact(rank, world, got))

    restore("fast")
    restore("fast_again")
    from torch.distributed.tensor import Replicate

    restore("resharded", Replicate())
    dist.barrier()
    if rank == 0:
        _flip(root, "d")  # this node's copy of rank 0's shard
    dist.barrier()
    restore("corrupt")
    dist.barrier()
    if rank == 0:
        wipe(root)  # node 0 (the one with the corrupt copy) replaced: its slots come back empty
    dist.barrier()
    restore("wiped_small")  # every chunk is small: node 1 sends rank 0 its chunks, still the fast path
    fast_plan.REMOTE_MAX_BYTES = 0  # ... larger ones: dcp.load's peer fetch
    fast_plan._cache.clear()
    restore("wiped")
    return out


@pytest.mark.timeout(240)
def test_two_nodes_fast_path_and_every_fallback() -> None:
    make, cleanup = node_root_factory("gemini-fl-")
    try:
        roots = make(2)
        out = run_ranks(_two_nodes, 2, roots, timeout=200)
    finally:
        cleanup()
    for name in ("fast", "fast_again", "resharded", "corrupt", "wiped_small", "wiped"):
        assert out[0][name][0] == out[1][name][0], (name, out)  # ranks agree on the path
        assert out[0][name][2] and out[1][name][2], (name, out)  # bit-exact either way
    assert out[0]["fast"][0] == "fast" and out[0]["fast_again"][0] == "fast"
    assert out[0]["fast"][1]["local"] > 0 and out[0]["fast"][1]["peer"] == 0
    assert out[0]["resharded"][0] == "dcp"
    assert out[0]["corrupt"][0] == "dcp" and out[0]["corrupt"][1]["peer"] > 0  # repaired from node 1's replica
    assert out[0]["wiped_small"][0] == "fast" and out[0]["wiped_small"][1]["peer"] > 0
    assert out[0]["wiped"][0] == "dcp" and out[0]["wiped"][1]["peer"] > 0
