"""Issue 27: the batched copy of many small items (save/local_write.py).

A save of a plan the writer has seen resolves its items with a few C-level maps, copies each
group fused (the extension's copy+CRC, one call per group, through source views kept while the sources
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


def test_one_call_copies_a_group_as_the_per_item_op_does() -> None:
    """``copy_crc32c_count_many`` (one call per group) gives each item's bytes, CRC and count as
    ``copy_crc32c_count`` per item does: small and odd sizes, every float kind, a group large
    enough for streaming stores (and one small enough not to), misaligned destinations, a pair
    that is the same memory, and clear errors for malformed input."""
    from gemini_dcp.core.checksum import checksum
    from gemini_dcp.ext import loader

    if not loader.load():
        pytest.skip("the C++ extension is not available here")
    op = torch.ops.gemini_dcp
    g = torch.Generator().manual_seed(3)
    dtypes = [(torch.float32, 1), (torch.float64, 2), (torch.float16, 3), (torch.bfloat16, 4), (torch.int64, 0)]
    for n_items, scale in ((40, 1), (300, 40)):  # ~50 KiB in all, and ~12 MiB (streamed)
        srcs, kinds = [], []
        for i in range(n_items):
            dtype, kind = dtypes[i % len(dtypes)]
            numel = int(torch.randint(0, 97 * scale, (1,), generator=g)) + (i % 3)
            t = (torch.randn(numel, generator=g) * 4).to(dtype)
            if kind and numel > 3:
                t[[0, numel // 2, numel - 1]] = torch.tensor([float("nan"), float("inf"), float("-inf")]).to(dtype)
            srcs.append(t.view(torch.uint8))
            kinds.append(kind)
        total = sum(s.numel() for s in srcs) + 8 * len(srcs)
        slot = torch.zeros(total + 64, dtype=torch.uint8)
        dsts, off = [], 3  # odd offsets: the streaming path aligns each piece itself
        for s_ in srcs:
            dsts.append(slot[off : off + s_.numel()])
            off += s_.numel() + 5
        crcs, counts = op.copy_crc32c_count_many(dsts, srcs, kinds)
        for d, s_, k, c, n in zip(dsts, srcs, kinds, crcs, counts, strict=True):
            assert torch.equal(d, s_)
            assert c == checksum(s_, "crc32c")
            assert (c, n) == tuple(op.copy_crc32c_count(torch.empty_like(s_), s_, k, 1, 0))
    same = torch.randn(1000).view(torch.uint8)
    assert op.copy_crc32c_count_many([same], [same], [1]) == ([checksum(same, "crc32c")], [0])
    a = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="differ in length"):
        op.copy_crc32c_count_many([a], [a, a], [0])
    with pytest.raises(RuntimeError, match="kind must be 0..4"):
        op.copy_crc32c_count_many([a], [a.clone()], [7])
    with pytest.raises(RuntimeError, match="size mismatch"):
        op.copy_crc32c_count_many([a], [torch.zeros(9, dtype=torch.uint8)], [0])


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
