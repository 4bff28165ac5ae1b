"""The persistent store split into modules: its names stay importable from gemini_dcp.persistent.store,
and side files pickled under the module names of earlier releases still decode (fast, no processes)."""

from __future__ import annotations

import importlib
import pickle

import pytest
from torch.distributed.checkpoint.metadata import MetadataIndex

import gemini_dcp.persistent.store as store
from gemini_dcp.errors import ChecksumMismatchError, PersistentTierError
from gemini_dcp.persistent.side_files import (
    PartMarker,
    StepIndex,
    UntrustedSideFileError,
    decode_side_file,
)

NAMES = (
    "DEFAULT_TIMEOUT_S", "INDEX", "METADATA", "SIDE_DIR", "SIDE_FILE_GLOBALS", "WRITE_BUFFER", "PartMarker",
    "PersistentChecksumError", "PersistentTier", "PersistentTimeoutError", "StepDir", "StepIndex",
    "UntrustedSideFileError", "bounded_call", "data_file", "decode_side_file", "node_tag",
)


def test_public_names_stay_importable_from_store() -> None:
    for name in NAMES:
        assert hasattr(store, name), name
    assert issubclass(store.PersistentChecksumError, PersistentTierError)
    assert issubclass(store.PersistentChecksumError, ChecksumMismatchError)


@pytest.mark.parametrize("module", ["gemini_dcp.persistent.side_files", "gemini_dcp.persistent.store", "gemini_dcp.persistent"])
def test_side_files_pickled_under_earlier_module_names_decode(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    index = StepIndex(3, "fp", {MetadataIndex("w", [0]): ("xxh3", 7)}, ("n0",), "job")
    marker = PartMarker(3, "fp", "n0", (0,), {}, {}, 0, 1.0)
    home = importlib.import_module(module)
    for cls in (StepIndex, PartMarker):
        monkeypatch.setattr(cls, "__module__", module)  # as a release that defined it there pickled it
        monkeypatch.setattr(home, cls.__name__, cls, raising=False)  # where pickle looks it up
    raw_index, raw_marker = pickle.dumps(index), pickle.dumps(marker)
    monkeypatch.undo()
    assert module.encode() in raw_index
    assert decode_side_file(raw_index, "index.pkl", StepIndex) == index
    assert decode_side_file(raw_marker, "part.pkl", PartMarker) == marker


def test_side_file_naming_another_class_is_refused() -> None:
    raw = pickle.dumps(StepIndex(1, "fp", {}, (), "j")).replace(b"StepIndex", b"StepIndey")  # same length
    with pytest.raises(UntrustedSideFileError):
        decode_side_file(raw, "index.pkl", StepIndex)
