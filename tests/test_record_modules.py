"""Step records at their real module (``local/record_types.py``): pickled under that path, and
records written by earlier releases under their old module paths still decode (the versioned
name map of :mod:`gemini_dcp.core.safe_pickle`)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)

from gemini_dcp.core.safe_pickle import ALLOWED_GLOBALS, MODULES_OF_EARLIER_RELEASES
from gemini_dcp.local import record_types
from gemini_dcp.local.record_codec import decode_record, encode_record
from gemini_dcp.local.record_types import RankSlot, ShardRef, StepRecord

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
    old = types.ModuleType(module)  # pickle checks the class is found at the path it writes
    for o in objs:
        o.__module__ = module
        setattr(old, o.__name__, o)
    sys.modules[module] = old
    try:
        yield
    finally:
        del sys.modules[module]
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


def test_the_earlier_releases_name_map_lists_only_pickled_classes() -> None:
    moved = {old: new for names in MODULES_OF_EARLIER_RELEASES.values() for old, new in names.items()}
    assert {m for m, _ in moved} == {
        "gemini_dcp.records", "gemini_dcp.local.records", "gemini_dcp.persistent"
    }
    assert set(moved.values()) == {"gemini_dcp.local.record_types", "gemini_dcp.persistent.side_files"}
    for (_, name), new in moved.items():
        assert (new, name) in ALLOWED_GLOBALS or new.endswith("side_files"), name
