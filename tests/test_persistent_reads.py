"""Issue 26: the persistent tier's payload-range reader (fast, no processes).

A tensor item of a drained step is ``torch.save`` bytes; its raw bytes are read in place (a
mapped view of the data file, or a ``pread`` into a fresh tensor), hashed as they are read, and
must equal what ``torch.load`` gives — for any dtype and shape, for empty tensors, and through
the ``torch.load`` fallback for tensors saved with another layout (non-contiguous, a view of a
larger storage, the legacy non-zip format). A corrupt payload raises and stages nothing.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from gemini_dcp.core.checksum import checksum
from gemini_dcp.core.chunk_sink import StagedChunks
from gemini_dcp.errors import ChecksumMismatchError, PersistentTierError
from gemini_dcp.persistent import store
from gemini_dcp.persistent.item_payload import ItemWindow, MappedFile, payload_layout
from gemini_dcp.persistent.side_files import INDEX, SIDE_DIR, StepIndex
from gemini_dcp.persistent.store import PersistentChecksumError, PersistentTier

CASES: dict[str, Any] = {
    "f32_2d": lambda: torch.rand(33, 17),
    "bf16": lambda: torch.rand(1000).to(torch.bfloat16),
    "f16_3d": lambda: torch.rand(3, 5, 7).to(torch.float16),
    "i64": lambda: torch.arange(-50, 977, dtype=torch.int64),
    "bool": lambda: torch.rand(129) > 0.5,
    "c64": lambda: torch.randn(40, dtype=torch.complex64),
    "u8_odd": lambda: torch.randint(0, 255, (4097,), dtype=torch.uint8),
    "scalar": lambda: torch.tensor(3.25, dtype=torch.float64),
    "empty": lambda: torch.empty(0, 3),
    "big": lambda: torch.rand(3 << 18),  # 3 MiB: several read blocks
}
FALLBACK: dict[str, Any] = {
    "transposed": lambda: torch.rand(6, 9).t(),
    "view_of_larger_storage": lambda: torch.arange(100, dtype=torch.float32)[10:30],
    "strided": lambda: torch.arange(64, dtype=torch.int32)[::3],
}


def _write_items(path: Path, tensors: list[torch.Tensor], *, legacy: bool = False, lead: int = 37) -> list[tuple[int, int]]:
    """torch.save each tensor into one file at unaligned offsets, as a data file; (offset, length) of each."""
    spans = []
    with open(path, "wb") as f:
        f.write(b"\xa5" * lead)
        for t in tensors:
            start = f.tell()
            torch.save(t, f, _use_new_zipfile_serialization=not legacy)
            spans.append((start, f.tell() - start))
    return spans


def _task(path: Path, span: tuple[int, int], expect: tuple[str, int] | None) -> Any:
    return store._Task(
        index=MetadataIndex("t"), info=_StorageInfo(path.name, span[0], span[1]), is_bytes=False,
        expect=expect, what="item 't'", shown=str(path),
    )


def _expect(t: torch.Tensor) -> tuple[str, int]:
    return ("crc32c", checksum(_bytes_of(t), "crc32c"))


def _both_reads(path: Path, span: tuple[int, int], expect: tuple[str, int] | None) -> list[torch.Tensor]:
    """The item read through a mapping (staged in place) and through pread (a private tensor)."""
    mapped = MappedFile(str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        return [store.stage_mapped(mapped, _task(path, span, expect)),
                store.read_stored(lambda b, o: os.preadv(fd, [b], o), _task(path, span, expect))]
    finally:
        os.close(fd)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, no value comparison)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes_of(a), _bytes_of(b))


@pytest.mark.parametrize("name", sorted(CASES))
def test_payload_read_is_bit_exact_with_torch_load(tmp_path: Path, name: str) -> None:
    t = CASES[name]()
    path = tmp_path / "__0_0.distcp"
    spans = _write_items(path, [torch.rand(5), t, torch.rand(3)])
    raw = path.read_bytes()[spans[1][0] : spans[1][0] + spans[1][1]]
    want = torch.load(io.BytesIO(raw), weights_only=True)
    mapped = MappedFile(str(path))
    layout = payload_layout(ItemWindow(mapped.read_at, *spans[1]))
    assert layout is not None and layout.dtype == t.dtype and layout.shape == tuple(t.shape)
    for got in _both_reads(path, spans[1], _expect(t)):
        assert _same(got, want), name
    for got in _both_reads(path, spans[1], None):  # a stock checkpoint: nothing to verify against
        assert _same(got, want), name


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_tensor_saved_with_another_layout_falls_back_to_torch_load(tmp_path: Path, name: str) -> None:
    t = FALLBACK[name]()
    path = tmp_path / "__0_0.distcp"
    spans = _write_items(path, [t])
    mapped = MappedFile(str(path))
    assert payload_layout(ItemWindow(mapped.read_at, *spans[0])) is None
    for got in _both_reads(path, spans[0], _expect(t)):
        assert torch.equal(got, t) and got.dtype == t.dtype


def test_legacy_non_zip_item_and_garbage(tmp_path: Path) -> None:
    t = torch.rand(7, 3)
    path = tmp_path / "__0_0.distcp"
    spans = _write_items(path, [t], legacy=True)
    mapped = MappedFile(str(path))
    assert payload_layout(ItemWindow(mapped.read_at, *spans[0])) is None
    for got in _both_reads(path, spans[0], _expect(t)):
        assert torch.equal(got, t)
    junk = tmp_path / "junk.distcp"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(PersistentTierError, match="not a readable torch.save tensor"):
        store.stage_mapped(MappedFile(str(junk)), _task(junk, (100, 2000), None))


def test_corrupt_payload_raises(tmp_path: Path) -> None:
    t = torch.rand(4096)
    path = tmp_path / "__0_0.distcp"
    spans = _write_items(path, [t])
    mapped = MappedFile(str(path))
    layout = payload_layout(ItemWindow(mapped.read_at, *spans[0]))
    assert layout is not None
    data = bytearray(path.read_bytes())
    data[spans[0][0] + layout.offset + 1000] ^= 0x40
    path.write_bytes(bytes(data))
    for read in range(2):
        with pytest.raises(PersistentChecksumError, match="failed its crc32c checksum"):
            if read == 0:
                store.stage_mapped(MappedFile(str(path)), _task(path, spans[0], _expect(t)))
            else:
                fd = os.open(path, os.O_RDONLY)
                try:
                    store.read_stored(lambda b, o: os.preadv(fd, [b], o), _task(path, spans[0], _expect(t)))
                finally:
                    os.close(fd)


def test_truncated_item_raises(tmp_path: Path) -> None:
    t = torch.rand(4096)
    path = tmp_path / "__0_0.distcp"
    spans = _write_items(path, [t])
    with open(path, "r+b") as f:
        f.truncate(spans[0][0] + spans[0][1] // 2)
    with pytest.raises(PersistentTierError):
        store.stage_mapped(MappedFile(str(path)), _task(path, spans[0], _expect(t)))


# ---- read_items: a whole step, all or nothing ------------------------------------------------------
def _stock_step(tmp_path: Path, sd: dict[str, Any], *, with_index: bool) -> PersistentTier:
    """``sd`` saved by stock DCP as step 1 of job "j" in a file:// store (plus gemini's index)."""
    step_dir = tmp_path / "store" / "j" / "step-1"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(step_dir)), no_dist=True)
    tier = PersistentTier(f"file://{tmp_path / 'store'}", "j")
    if with_index:
        md = tier.read_metadata(1)
        sums = {}
        for idx in md.storage_data:
            v = sd[idx.fqn]
            sums[idx] = _expect(v) if isinstance(v, torch.Tensor) else ("crc32c", 0)
        (step_dir / SIDE_DIR).mkdir(exist_ok=True)
        (step_dir / SIDE_DIR / INDEX).write_bytes(pickle.dumps(StepIndex(1, "fp", sums, ("n0",), "j")))
        tier._meta_cache.clear()
    return tier


def _plan(tier: PersistentTier, dest: dict[str, Any]) -> tuple[Any, DefaultLoadPlanner]:
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dest, tier.read_metadata(1), True)
    return planner.create_local_plan(), planner


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.rand(1000 + 37 * i, generator=g) for i in range(12)} | {
        "h": torch.rand(5, 6, generator=g).to(torch.bfloat16), "e": torch.empty(0, 4), "n": torch.arange(9)}


@pytest.mark.parametrize("with_index", [True, False])
def test_read_items_lands_a_stock_step_bit_exact(tmp_path: Path, with_index: bool) -> None:
    sd = _state()
    tier = _stock_step(tmp_path, sd, with_index=with_index)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    plan, planner = _plan(tier, dest)
    kept: list[MappedFile] = []
    held = StagedChunks()
    n = tier.read_items(1, plan, planner, stage=held, keep=kept.append)
    assert n > 0 and len(held) == len({it.storage_index for it in plan.items}) and kept
    assert all(torch.count_nonzero(v) == 0 for v in dest.values())  # staged, nothing landed yet
    held.land_all(planner)
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    dest2 = {k: torch.zeros_like(v) for k, v in sd.items()}
    plan2, planner2 = _plan(tier, dest2)
    tier.read_items(1, plan2, planner2)  # no stage: landed once all are verified
    assert all(torch.equal(dest2[k], v) for k, v in sd.items())
    assert torch.equal(tier.load_item(1, MetadataIndex("w3", [0])), sd["w3"])


def test_read_items_with_one_corrupt_item_stages_and_lands_nothing(tmp_path: Path) -> None:
    sd = _state()
    tier = _stock_step(tmp_path, sd, with_index=True)
    md = tier.read_metadata(1)
    info = md.storage_data[MetadataIndex("w7", [0])]
    path = Path(tier.step_path(1)) / info.relative_path
    layout = payload_layout(ItemWindow(MappedFile(str(path)).read_at, info.offset, info.length))
    assert layout is not None
    data = bytearray(path.read_bytes())
    data[info.offset + layout.offset + layout.nbytes - 3] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(data))
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    plan, planner = _plan(tier, dest)
    held = StagedChunks()
    with pytest.raises(ChecksumMismatchError, match="'w7'"):
        tier.read_items(1, plan, planner, stage=held)
    assert len(held) == 0
    with pytest.raises(ChecksumMismatchError):
        tier.read_items(1, plan, planner)
    assert all(torch.count_nonzero(v) == 0 for v in dest.values())
    with pytest.raises(PersistentChecksumError):
        tier.load_item(1, MetadataIndex("w7", [0]))


def test_read_workers_are_sized_to_the_host() -> None:
    assert store.read_workers(1) == 1
    assert 2 <= store.read_workers(100) <= store.MAX_READ_THREADS
