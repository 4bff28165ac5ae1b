"""The persistent store's modules: each name at one home, and side files pickled under the module
names of earlier releases still decode (fast, no processes)."""

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


def test_side_files_are_written_under_the_store_module_path() -> None:
    assert StepIndex.__module__ == PartMarker.__module__ == "gemini_dcp.persistent.store"
    assert store.StepIndex is StepIndex and store.PartMarker is PartMarker  # what pickle looks up when it writes
    raw = pickle.dumps(StepIndex(1, "fp", {}, (), "j"))
    assert b"gemini_dcp.persistent.store" in raw and decode_side_file(raw, "index.pkl", StepIndex) == StepIndex(1, "fp", {}, (), "j")


def test_store_holds_its_reads_and_forwards_no_names() -> None:
    assert issubclass(store.PersistentChecksumError, PersistentTierError)
    assert issubclass(store.PersistentChecksumError, ChecksumMismatchError)
    assert store.read_items.__module__ == store.PersistentTier.__module__ == "gemini_dcp.persistent.store"
    for name in store.__all__:  # defined here, not handed on from the store's parts
        value = getattr(store, name)
        assert not callable(value) or value.__module__ == store.__name__, name


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
