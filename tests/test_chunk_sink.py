"""The chunk sink (gemini_dcp.core.chunk_sink): verify a chunk, then land it, in one process.

A good chunk lands bit-exact (or value-converted for another dtype, as stock DCP converts);
a corrupt chunk raises ChecksumMismatchError with the one message and leaves the destination
untouched; bytes that do not fit the saved dtype/shape, or a destination of another shape,
are refused.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from gemini_dcp.core.checksum import checksum
from gemini_dcp.core.chunk_sink import (
    StagedChunks,
    check_chunk,
    chunk_matches,
    copy_verified,
    corrupt_error,
    corrupt_message,
    land,
    stored_view,
    verify_chunk,
)
from gemini_dcp.errors import ChecksumMismatchError, IncompatibleCheckpointError
from gemini_dcp.local.record_types import ShardRef

ALGOS = ("xxh3", "crc32c")


class _Planner:
    """The two planner calls the sink makes, over a dict of destination tensors."""

    def __init__(self, dests: dict[str, torch.Tensor]) -> None:
        self.dests = dests
        self.committed: list[str] = []
        self.loaded: dict[str, bytes] = {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        t = self.dests[item.dest_index.fqn]
        for dim, (off, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(dim, off, length)
        return t

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[item.dest_index.fqn] = value.read()


def _item(fqn: str, shape: tuple[int, ...], *, kind: LoadItemType = LoadItemType.TENSOR) -> ReadItem:
    zeros = torch.Size([0] * len(shape))
    idx = MetadataIndex(fqn, zeros)
    return ReadItem(kind, dest_index=idx, dest_offsets=zeros, storage_index=idx, storage_offsets=zeros,
                    lengths=torch.Size(shape))


def _ref(raw: torch.Tensor, algo: str, dtype: str | None = "float32", shape: tuple[int, ...] | None = None) -> ShardRef:
    return ShardRef(0, 0, raw.numel(), checksum(raw, algo), algo, dtype, shape)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("algo", ALGOS)
def test_good_chunk_lands_bit_exact(algo: str) -> None:
    saved = torch.randn(3, 5)
    raw = _bytes_of(saved)
    ref = _ref(raw, algo, shape=(3, 5))
    assert verify_chunk(raw, ref) and chunk_matches(raw, algo, ref.checksum)
    check_chunk(raw, algo, ref.checksum, what="w", sources="slot")  # no raise
    stored = stored_view(raw, torch.float32, (3, 5), "w")
    assert stored.data_ptr() == raw.data_ptr()  # zero copy: a view of the verified bytes
    planner = _Planner({"w": torch.zeros(3, 5)})
    land([_item("w", (3, 5))], stored, planner)
    assert torch.equal(planner.dests["w"].view(torch.int32), saved.view(torch.int32))
    assert planner.committed == ["w"]


def test_other_dtype_is_converted_as_stock_dcp_converts() -> None:
    saved = torch.tensor([[1.5, -2.25], [65504.0, 3.0e-5]], dtype=torch.float16)
    raw = _bytes_of(saved)
    stored = stored_view(raw, torch.float16, (2, 2), "h")
    planner = _Planner({"h": torch.zeros(2, 2, dtype=torch.bfloat16)})
    land([_item("h", (2, 2))], stored, planner)
    assert torch.equal(planner.dests["h"], saved.to(torch.bfloat16))  # values converted, bytes not reinterpreted


def test_unaligned_bytes_are_copied_once() -> None:
    saved = torch.arange(6, dtype=torch.float64)
    buf = torch.empty(49, dtype=torch.uint8)
    buf[1:].copy_(_bytes_of(saved))
    stored = stored_view(buf[1:], torch.float64, (6,), "x")
    assert torch.equal(stored, saved)


@pytest.mark.parametrize("algo", ALGOS)
def test_corrupt_chunk_raises_the_one_message_and_lands_nothing(algo: str) -> None:
    saved = torch.randn(4, 4)
    raw = _bytes_of(saved).clone()
    ref = _ref(raw, algo, shape=(4, 4))
    raw[7] ^= 0xFF
    assert not verify_chunk(raw, ref)
    dest = torch.full((4, 4), 42.0)
    before = dest.clone()
    staged = StagedChunks()
    with pytest.raises(ChecksumMismatchError) as ei:
        check_chunk(raw, algo, ref.checksum, what="shard 'w' of step 3", sources="slot file s0")
        staged.add([_item("w", (4, 4))], stored_view(raw, torch.float32, (4, 4), "w"))
    assert str(ei.value) == corrupt_message("shard 'w' of step 3", algo, "slot file s0")
    assert f"failed its {algo} checksum" in str(ei.value) and "Nothing was copied" in str(ei.value)
    staged.land_all(_Planner({"w": dest}))
    assert len(staged) == 0 and torch.equal(dest, before)
    # the peer tier's error for a chunk with no good copy left is the same message
    err = corrupt_error(_item("w", (4, 4)), ref, 3, "checksum from rank 1")
    assert isinstance(err, ChecksumMismatchError) and "failed its" in str(err) and "rank 1" in str(err)


def test_tier_error_subclass_keeps_the_message() -> None:
    class StoreChecksumError(ChecksumMismatchError):
        pass

    data = b"\x01\x02\x03"
    with pytest.raises(StoreChecksumError) as ei:
        check_chunk(data, "xxh3", 0, what="item 'b'", sources="store", error=StoreChecksumError)
    assert str(ei.value) == corrupt_message("item 'b'", "xxh3", "store")


@pytest.mark.parametrize("algo", ALGOS)
def test_copy_verified_returns_a_private_copy_or_raises(algo: str) -> None:
    src = _bytes_of(torch.arange(10, dtype=torch.int64))
    good = checksum(src, algo)
    out = copy_verified(src, algo, good, what="x", sources="slot")
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    with pytest.raises(ChecksumMismatchError, match="failed its"):
        copy_verified(src, algo, good ^ 1, what="x", sources="slot")
    assert copy_verified(torch.empty(0, dtype=torch.uint8), algo, checksum(torch.empty(0, dtype=torch.uint8), algo),
                         what="e", sources="slot").numel() == 0


def test_tensor_and_buffer_chunks_hash_their_bytes() -> None:
    t = torch.randn(8)
    raw = _bytes_of(t)
    value = checksum(raw, "xxh3")
    assert chunk_matches(t, "xxh3", value)  # a tensor as read back: its own bytes
    assert chunk_matches(bytes(raw.numpy()), "xxh3", value)
    assert chunk_matches(b"", "xxh3", checksum(torch.empty(0, dtype=torch.uint8), "xxh3"))


def test_wrong_length_or_shape_is_refused() -> None:
    raw = _bytes_of(torch.randn(6))
    with pytest.raises(IncompatibleCheckpointError, match="do not hold"):
        stored_view(raw, torch.float32, (7,), "w")
    with pytest.raises(IncompatibleCheckpointError, match="do not hold"):
        stored_view(raw[:-1], torch.float32, (6,), "w")
    stored = stored_view(raw, torch.float32, (2, 3), "w")
    item = _item("w", (2, 3))
    dest = torch.zeros(3, 2)
    with pytest.raises(IncompatibleCheckpointError, match="does not fit"):
        land([item], stored, _Planner({}), {id(item): dest})  # a destination resolved beforehand
    assert not dest.any()

    class _Fixed(_Planner):
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return self.dests[item.dest_index.fqn]

    fixed = _Fixed({"w": torch.zeros(3, 2)})
    with pytest.raises(IncompatibleCheckpointError, match="does not fit"):
        land([_item("w", (2, 3))], stored, fixed)
    assert not fixed.dests["w"].any() and fixed.committed == []


def test_empty_chunk_and_bytes_item() -> None:
    empty = stored_view(torch.empty(0, dtype=torch.uint8), torch.float32, (0, 4), "e")
    assert empty.shape == (0, 4) and empty.dtype == torch.float32
    planner = _Planner({})
    blob = torch.frombuffer(bytearray(b"hello"), dtype=torch.uint8)
    staged = StagedChunks()
    staged.add([_item("b", (0,), kind=LoadItemType.BYTE_IO)], blob)
    staged.add([_item("c", (0,), kind=LoadItemType.BYTE_IO)], b"raw")
    seen: list[Any] = []
    staged.land_all(planner, after_first=lambda: seen.append(dict(planner.loaded)))
    assert planner.loaded == {"b": b"hello", "c": b"raw"} and seen == [{"b": b"hello"}] and len(staged) == 0


def test_staged_chunks_move_between_holders_and_clear() -> None:
    first, second = StagedChunks(), StagedChunks()
    first.add([_item("a", (2,))], torch.ones(2))
    second.extend(first)
    assert len(first) == 0 and len(second) == 1 and [c.items[0].dest_index.fqn for c in second] == ["a"]
    second.clear()
    dest = torch.zeros(2)
    second.land_all(_Planner({"a": dest}))
    assert not dest.any()
