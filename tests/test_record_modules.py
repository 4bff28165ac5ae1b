"""The split of ``local/records.py`` (types / codec / caches): records written under the old
module paths keep decoding, and the re-exports are the very objects of the new modules."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)

from gemini_dcp.core.safe_pickle import ALLOWED_GLOBALS
from gemini_dcp.local import record_caches, record_codec, record_types, records
from gemini_dcp.local.records import (
    RankSlot,
    ShardRef,
    StepRecord,
    decode_record,
    encode_record,
)

_PICKLED = ("ShardRef", "RankSlot", "StepRecord", "PackedLayout", "_rebuild_record", "_rebuild_overlay")


def _record(step: int = 1) -> StepRecord:
    data = {MetadataIndex(f"w{i}", [0]): ShardRef(0, 64 * i, 64, step + i, "crc32c") for i in range(4)}
    meta = Metadata(state_dict_metadata={f"w{i}": BytesStorageMetadata() for i in range(4)}, storage_data=data)
    return StepRecord("j", step, 1, meta, ("n",), (256,), {"n": ("n",)}, 1, "mixed", (RankSlot(0, 0, 256),), "n",
                      created_unix=1.0)


@contextmanager
def _pickled_under(module: str) -> Iterator[None]:
    """Pickle the record types as if they still lived in ``module`` (as records written before the split)."""
    objs = [getattr(record_types, n) for n in _PICKLED]
    saved = [o.__module__ for o in objs]
    for o in objs:
        o.__module__ = module
    try:
        yield
    finally:
        for o, m in zip(objs, saved):
            o.__module__ = m


def test_every_pickled_global_is_allowed_at_its_real_module() -> None:
    for name in _PICKLED:
        obj = getattr(record_types, name)
        assert obj.__module__ == "gemini_dcp.local.record_types"
        assert (obj.__module__, name) in ALLOWED_GLOBALS
    payload = encode_record(_record())
    assert b"gemini_dcp.local.record_types" in payload and b"gemini_dcp.local.records\x94" not in payload


@pytest.mark.parametrize("old", ["gemini_dcp.local.records", "gemini_dcp.records"])
def test_records_written_under_old_module_paths_still_decode(old: str) -> None:
    with _pickled_under(old):
        blob = encode_record(_record(3))
    assert old.encode() in blob and b"record_types" not in blob
    assert decode_record(blob) == _record(3)


def test_records_reexports_are_the_objects_of_the_split_modules() -> None:
    assert records.StepRecord is record_types.StepRecord
    assert records.decode_record is record_codec.decode_record and records.read_record is record_codec.read_record
    assert records._digests is record_caches._digests and records._layouts_by_blob is record_caches._layouts_by_blob
    assert records._HEADER is record_codec._HEADER and records._STEP_FIELDS is record_types._STEP_FIELDS
    assert pickle.loads(pickle.dumps(_record())) == _record()
