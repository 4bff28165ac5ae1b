"""The restore's caches of what depends only on a committed record: a decoded record's layout is
shared by every record with the same rows, its fingerprint part computed once, and a record whose
rows differ in any byte (a checksum, a location) never gets another's layout or fingerprint."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from gemini_dcp.local.record_codec import decode_record, encode_record
from gemini_dcp.local.record_types import PackedLayout, RankSlot, ShardRef, StepRecord


def _record(step: int = 1, sums: tuple[int, ...] = (11, 12, 13, 14), n: int = 4) -> StepRecord:
    data = {MetadataIndex(f"w{i}", [0]): ShardRef(0, 64 * i, 64, sums[i % len(sums)] + i // len(sums), "crc32c")
            for i in range(n)}
    meta = Metadata(state_dict_metadata={f"w{i}": BytesStorageMetadata() for i in range(n)}, storage_data=data)
    return StepRecord("j", step, 1, meta, ("n",), (64 * n,), {"n": ("n",)}, 1, "mixed", (RankSlot(0, 0, 64 * n),), "n",
                      created_unix=1.0)


def test_decoded_records_share_one_layout_and_keep_the_dict_fingerprint() -> None:
    rec = _record(n=37)
    a = decode_record(encode_record(rec))
    b = decode_record(encode_record(rec))
    assert isinstance(a.metadata.storage_data, PackedLayout)
    assert a.metadata.storage_data is b.metadata.storage_data  # one layout for the same rows
    # the packed (cached) fingerprint is the one the plain dict form gives
    assert a.fingerprint() == b.fingerprint() == rec.fingerprint()
    assert a.fingerprint() == a.fingerprint()


def test_a_record_that_differs_in_one_checksum_gets_its_own_layout_and_fingerprint() -> None:
    good = decode_record(encode_record(_record()))
    other = _record(sums=(11, 12, 99, 14))
    bad = decode_record(encode_record(other))
    assert bad.metadata.storage_data is not good.metadata.storage_data
    assert bad.fingerprint() != good.fingerprint()
    assert bad.fingerprint() == other.fingerprint()
    moved = _record()
    data = dict(moved.metadata.storage_data)
    k = next(iter(data))
    data[k] = data[k]._replace(offset=data[k].offset + 1)
    moved = dataclasses.replace(moved, metadata=dataclasses.replace(moved.metadata, storage_data=data))
    dec = decode_record(encode_record(moved))
    assert dec.fingerprint() == moved.fingerprint() != good.fingerprint()


def test_the_header_fields_are_hashed_on_every_call() -> None:
    a = decode_record(encode_record(_record(step=1)))
    b = decode_record(encode_record(_record(step=2)))
    assert a.metadata.storage_data is b.metadata.storage_data  # same rows, other step
    assert a.fingerprint() != b.fingerprint()
    assert b.fingerprint() == _record(step=2).fingerprint()


def test_a_reader_decodes_a_record_once_and_never_reuses_it_for_other_bytes(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter

    root = tempfile.mkdtemp(prefix="gemini-rc-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        dcp.save({"w": torch.arange(12.0)}, storage_writer=GeminiStorageWriter(root=root, job_id="rc"), checkpoint_id=1)
        first = GeminiStorageReader(root, "rc").tier.record(1)
        assert first is not None
        assert GeminiStorageReader(root, "rc").tier.record(1) is first  # the same bytes: decoded once
        path = GeminiStorageReader(root, "rc").tier.layout.record_path(1)
        good = path.read_bytes()
        st = os.stat(path)
        bad = bytearray(good)
        bad[-3] ^= 0xFF  # a flipped byte, same size, same mtime: the record's checksum must catch it
        path.write_bytes(bytes(bad))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert GeminiStorageReader(root, "rc").tier.record(1) is None
        path.write_bytes(good)
        again = GeminiStorageReader(root, "rc").tier.record(1)
        assert again is first
        link = path.with_name(path.name + ".real")
        path.rename(link)
        path.symlink_to(link)  # never read through a link, cached or not
        assert GeminiStorageReader(root, "rc").tier.record(1) is None
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_fast_load_pauses_the_gc_only_for_the_restore() -> None:
    import gc

    import pytest
    import torch
    import torch.distributed.checkpoint as dcp

    from gemini_dcp import GeminiStorageReader, GeminiStorageWriter, fast_load
    from gemini_dcp.errors import ConfigError

    root = tempfile.mkdtemp(prefix="gemini-rc-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        want = {"w": torch.arange(12.0).reshape(3, 4), "h": torch.arange(5).to(torch.bfloat16)}
        dcp.save(want, storage_writer=GeminiStorageWriter(root=root, job_id="gc"), checkpoint_id=1)
        assert gc.isenabled()
        got = {"w": torch.zeros(3, 4), "h": torch.zeros(5, dtype=torch.bfloat16)}
        assert fast_load(got, root=root, job_id="gc").path == "fast"
        assert gc.isenabled() and all(torch.equal(got[k], want[k]) for k in want)
        with pytest.raises(ConfigError):  # an error inside the restore resumes it too
            fast_load(got, root=root, job_id="gc", storage_reader=GeminiStorageReader(root, "gc"))
        assert gc.isenabled()
        gc.disable()  # a caller that runs without it keeps it off
        try:
            fast_load(got, root=root, job_id="gc")
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        shutil.rmtree(root, ignore_errors=True)
