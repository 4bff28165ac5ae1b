"""Process-global caches (and the per-thread decoding context) behind the step record types.

A step record holds one entry per chunk of every rank, and the records of one plan share
their DCP metadata shell, their chunk indexes and their layout step after step. These
caches let that shared part be pickled, decoded, hashed and indexed once per layout
instead of once per record (see :mod:`gemini_dcp.local.record_types`). Every cache is
bounded and keyed by identity or by the exact bytes it was built from; all of them are
safe to use from several saving threads.

The nine caches: ``_blob_cache`` (the pickled metadata shell, encode), ``_shells`` (decoded
metadata shells), ``_indexes`` (shared MetadataIndex objects), and per layout object
``_positions``, ``_locations``, ``_values``, ``_digests``, ``_layout_blobs`` (encode) and
``_layouts_by_blob`` (decode).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Generic, TypeVar

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..core.safe_pickle import restricted_loads
from ..errors import UntrustedDataError

if TYPE_CHECKING:
    import numpy as np

    from .record_types import PackedLayout, ShardRef

# The pickled metadata shells of the last records encoded in this process, with the parts each was
# made of, most recently used first: one tuple, read and replaced in single steps (saving threads
# may encode concurrently). Holding the parts keeps them alive, so their ids cannot be reused while
# an entry stands. Several entries, not one: on rank 0 of a plain dcp.save the protocol digests the
# newly planned metadata, then the record is encoded with the shell every rank already holds (an
# equal, older object); with one entry each would evict the other and cost a full comparison.
_MAX_BLOBS = 4
_blob_cache: tuple[tuple[tuple[object, ...], bytes], ...] = ()


def metadata_shell_blob(meta: Metadata) -> bytes:
    """``meta`` without ``storage_data`` and ``storage_meta``, pickled (cached while its parts are the same objects)."""
    global _blob_cache
    shell = replace(meta, storage_data=None, storage_meta=None)
    parts = tuple(getattr(shell, f) for f in shell.__dataclass_fields__)
    entries = _blob_cache
    for i, (cached_parts, cached_blob) in enumerate(entries):
        if len(parts) == len(cached_parts) and all(a is b for a, b in zip(parts, cached_parts)):
            if i:
                _blob_cache = (entries[i],) + entries[:i] + entries[i + 1 :]
            return cached_blob
    # A plain dcp.save plans new metadata objects every save, usually equal to the last ones:
    # comparing them (~1 us per tensor) is far cheaper than pickling them again.
    if entries and len(parts) == len(entries[0][0]) and _equal_parts(parts, entries[0][0]):
        blob = entries[0][1]
    else:
        blob = pickle.dumps(shell, protocol=pickle.HIGHEST_PROTOCOL)
    _blob_cache = ((parts, blob),) + entries[: _MAX_BLOBS - 1]
    return blob


def _equal_parts(parts: tuple[object, ...], cached: tuple[object, ...]) -> bool:
    """The metadata fields are equal (dataclass equality: what a restore reads of them)."""
    try:
        return all(a is b or (type(a) is type(b) and bool(a == b)) for a, b in zip(parts, cached))
    except Exception:  # noqa: BLE001 - an uncomparable value (a tensor in planner_data): pickle it
        return False


# Decoding, the other way round: the records of one plan carry the same metadata shell and
# the same chunk indexes, step after step; both are immutable once built (DCP and this
# package only read them), so they are decoded once and shared by every record that has them.
_MAX_SHELLS = 8
_MAX_INDEXES = 1 << 16
_shells: dict[bytes, Metadata] = {}
_indexes: dict[tuple[object, ...], MetadataIndex] = {}
_remember_lock = threading.Lock()

K = TypeVar("K")
V = TypeVar("V")


def _remember(cache: dict[K, V], key: K, value: V, bound: int) -> V:
    """Store ``value`` under ``key``, evicting the oldest entries beyond ``bound`` (saving threads decode too)."""
    with _remember_lock:
        while len(cache) >= bound:
            del cache[next(iter(cache))]
        cache[key] = value
    return value


def _index(fqn: str, offset: tuple[int, ...] | None, hint: int | None) -> MetadataIndex:
    """The shared MetadataIndex for these fields (records of one plan share their indexes)."""
    key = (fqn, offset, hint)
    idx = _indexes.get(key)
    if idx is None:
        if len(_indexes) > _MAX_INDEXES:
            _indexes.clear()
        idx = _indexes[key] = MetadataIndex(fqn, offset, hint)
    return idx


def metadata_shell(meta_blob: bytes) -> Metadata:
    """The decoded (restricted-unpickled) DCP metadata shell of ``meta_blob``, shared by every record that has it."""
    shell = _shells.get(meta_blob)
    if shell is None:
        loaded = restricted_loads(meta_blob, source="a step record's DCP metadata", writer_torch=_reading_torch())
        if not isinstance(loaded, Metadata):
            raise UntrustedDataError(
                f"a step record's DCP metadata holds a {type(loaded).__name__}, not a Metadata; it was not used. "
                "Remove the record (see docs/security.md)."
            )
        shell = _remember(_shells, meta_blob, loaded, _MAX_SHELLS)
    return shell


class _PerLayout(Generic[V]):
    """A value computed once per layout object, for the last few layouts.

    Keyed by identity, not equality (a layout has one entry per chunk of every rank,
    and every record of a plan shares one). Entries hold their layout, so an id
    cannot be reused while its entry stands; the list is replaced in one step.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: list[tuple[object, V]] = []

    def get(self, layout: object, build: Callable[[], V]) -> V:
        for cached, value in tuple(self._entries):
            if cached is layout:
                return value
        return self.put(layout, build())

    def put(self, layout: object, value: V) -> V:
        self._entries = [(layout, value)] + self._entries[: self._size - 1]
        return value


_MAX_LAYOUTS = 4
_positions: _PerLayout[dict[MetadataIndex, int]] = _PerLayout(_MAX_LAYOUTS)  # index -> position
_locations: _PerLayout[dict[tuple[int, int], int]] = _PerLayout(_MAX_LAYOUTS)  # (rank, offset) -> position
_values: _PerLayout[list[ShardRef]] = _PerLayout(_MAX_LAYOUTS)  # the refs in order
_digests: _PerLayout[tuple[bytes, np.ndarray]] = _PerLayout(_MAX_LAYOUTS)  # fingerprint location part
# The pickled layout (encode): one per layout of the last few, so that several writers in one
# process (a model and an optimizer writer, a benchmark's writers) do not re-pickle theirs in turn.
_layout_blobs: _PerLayout[bytes] = _PerLayout(_MAX_LAYOUTS)
_layouts_by_blob: dict[bytes, PackedLayout] = {}  # decode


# The torch version in the header of the record being decoded on this thread (for messages
# from the nested unpickling of the metadata shell and the layout).
_decoding = threading.local()


def _reading_torch() -> str | None:
    return getattr(_decoding, "torch_version", None)

