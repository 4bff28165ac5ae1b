"""Issue 27: the batched copy of many small items (save/local_write.py).

A save of a plan the writer has seen resolves its items with a few C-level maps, copies each
group fused (the extension's copy+CRC per item, through source views kept while the sources
stay where they are) and builds its write results only when read. These tests check that
every such shortcut gives the bytes and checksums of the plain path, including when a
source moves under an unchanged structure (``.data =``, ``set_``, a non-contiguous
replacement, a DTensor whose local tensor is replaced), with real gloo ranks for DTensors.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mp_utils import run_ranks


@pytest.fixture
def roots() -> Any:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="gemini-batchcopy-", dir=base)
    paths = [os.path.join(d, f"node{i}") for i in range(2)]
    for p in paths:
        os.makedirs(p)
    yield paths
    shutil.rmtree(d, ignore_errors=True)


def _check_step(writer: Any, root: Any, job: str, sd: dict[str, Any], step: int, algo: str, **load_kw: Any) -> None:
    """Every chunk's recorded checksum is that of its slot bytes, and the step restores bit-exact."""
    from torch.distributed.tensor import DTensor

    from gemini_dcp import GeminiStorageReader
    from gemini_dcp.core.checksum import checksum

    rec = writer.tier.record(step)
    assert rec is not None
    for ref in rec.metadata.storage_data.values():
        if ref.rank != writer._rank:
            continue
        slot = writer.slot(ref.rank, rec.slot_of(ref.rank).slot)
        assert ref.algo == algo and checksum(slot.view(ref.offset, ref.length), algo) == ref.checksum
    out = {
        k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False)
            if isinstance(v, DTensor) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1)
        for k, v in sd.items()
    }
    dcp.load(out, storage_reader=GeminiStorageReader(root=root, job_id=job), checkpoint_id=step, **load_kw)
    for k, v in sd.items():
        if isinstance(v, DTensor):
            assert torch.equal(out[k].to_local(), v.to_local()), (step, k)
        elif isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), (step, k)
        else:
            assert out[k] == v, (step, k)


@pytest.mark.parametrize("algo", ["crc32c", "xxh3"])
def test_moved_sources_are_copied_from_where_they_are_now(tmp_path: Any, algo: str) -> None:
    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.save.local_write import fused_available

    writer = GeminiStorageWriter(root=tmp_path, job_id="moves", keep=2, checksum=algo)
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {f"w{i}": torch.randn(5, 3, generator=g) for i in range(60)}
    sd["step"] = 0

    def save(step: int) -> None:
        sd["step"] = step
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                with torch.no_grad():
                    v.add_(1)
        dcp.save(sd, storage_writer=writer, checkpoint_id=step, no_dist=True)
        _check_step(writer, tmp_path, "moves", sd, step, algo, no_dist=True)

    for step in (1, 2, 3):
        save(step)
    prog = writer.local_writer._programs[0]
    fused = fused_available(algo)
    assert (prog.sources._views is not None) == fused  # kept after two saves with the sources in place
    sd["w3"].data = torch.randn(5, 3, generator=g)  # the same object, its bytes elsewhere
    save(4)
    assert prog.sources._views is None  # moved: nothing kept, copied from where the bytes are now
    save(5)
    assert (prog.sources._views is not None) == fused
    sd["w7"].set_(torch.randn(5, 3, generator=g))  # set_: another storage, the same shape
    save(6)
    sd["w9"].data = torch.randn(3, 5, generator=g).t()  # the same shape, not contiguous
    save(7)
    save(8)
    assert prog.sources._views is None  # a non-contiguous source is never viewed flat
    sd["w9"].data = sd["w9"].contiguous()
    save(9)
    save(10)
    assert writer.local_writer.programs_built == 1  # no structure change in all of this


def test_write_results_are_built_when_read_and_pickle_as_a_tuple(tmp_path: Any) -> None:
    from torch.distributed.checkpoint.storage import WriteResult

    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.save.local_write import WriteResults
    from gemini_dcp.snapshot.replay import PlanReplay

    writer = GeminiStorageWriter(root=tmp_path, job_id="results", keep=2)
    seen: list[Any] = []
    orig = writer.local_writer.write

    def spy(*a: Any, **k: Any) -> Any:
        done = orig(*a, **k)
        seen.append(done)
        return done

    writer.local_writer.write = spy  # type: ignore[method-assign]
    sd: dict[str, Any] = {f"w{i}": torch.full((4,), float(i)) for i in range(10)}
    sd["step"] = 123456789  # a pickled item: its length is the save's own
    dcp.save(sd, storage_writer=writer, checkpoint_id=1, no_dist=True)
    assert seen[-1].results._built is not None  # dcp.save hands them to DCP
    replay = PlanReplay(writer, None, no_dist=True)
    replay.save(sd, 2)  # planned (and recorded)
    replay.save(sd, 3)  # replayed: the commit compares the results with the layout once
    replay.save(sd, 4)  # replayed again: the report is compact, nobody reads the results
    assert replay.replayed == 2
    results = seen[-1].results
    assert isinstance(results, WriteResults) and len(results) == 11 and results._built is None
    back = pickle.loads(pickle.dumps(results))
    assert type(back) is tuple and all(isinstance(r, WriteResult) for r in back)
    assert back == tuple(results) and results == back
    rec = writer.tier.record(4)
    assert rec is not None
    assert {r.index: r.storage_data for r in back} == dict(rec.metadata.storage_data.items())


def _dtensor_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from gemini_dcp import GeminiStorageWriter
    from gemini_dcp.snapshot import AsyncCheckpointer

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    sd: dict[str, Any] = {
        f"layers.{i}.w": DTensor.from_local(torch.randn(6, 4, generator=g), mesh, [Shard(0)], run_check=False)
        for i in range(40)
    }
    sd["rep"] = DTensor.from_local(torch.ones(3), mesh, [Replicate()], run_check=False)
    sd["plain"] = torch.arange(5.0)
    sd["step"] = 0
    writer = GeminiStorageWriter(root=root, job_id="dt", keep=2)
    ckpt = AsyncCheckpointer(writer, interleave=False)
    for step in range(1, 9):
        sd["step"] = step
        for v in sd.values():
            if isinstance(v, DTensor):
                v.to_local().add_(1)
        if step == 5:  # the DTensor keeps its spec, its local tensor is replaced
            sd["layers.3.w"]._local_tensor = torch.randn(6, 4, generator=g)
        if step == 6:
            sd["layers.4.w"].to_local().data = torch.randn(6, 4, generator=g)
        ckpt.save(sd, step).wait()
        _check_step(writer, root, "dt", sd, step, writer._algo)
    stats = ckpt.stats()
    ckpt.close()
    return {"plans": stats.get("plans"), "built": writer.local_writer.programs_built}


@pytest.mark.timeout(300)
def test_replayed_dtensor_saves_follow_moved_local_tensors(roots: list[str]) -> None:
    res = run_ranks(_dtensor_saves, 2, roots, timeout=280)
    for r in res:
        assert r["built"] == 1, r
