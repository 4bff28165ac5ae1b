"""Step records: the types, their file format and their caches, under one import path.

What a committed step is made of lives in three modules, each with one reason to change:

- :mod:`gemini_dcp.local.record_types`: :class:`StepRecord`, :class:`ShardRef`,
  :class:`RankSlot`, the layouts (:class:`PackedLayout`, :class:`ChecksumOverlay`) and
  their compact pickled form;
- :mod:`gemini_dcp.local.record_codec`: the ``GEMREC`` file format
  (:func:`encode_record` / :func:`decode_record`, :func:`write_record` / :func:`read_record`);
- :mod:`gemini_dcp.local.record_caches`: the process-global caches behind both.

This module re-exports every name other modules (and tests, benchmarks) import from it, so
``from gemini_dcp.local.records import StepRecord, read_record`` keeps working; records
written before the split name their classes here and still decode (see the allow-list of
:mod:`gemini_dcp.core.safe_pickle`).
"""

from __future__ import annotations

import pickle  # noqa: F401 - kept as an attribute: tests count calls through records.pickle.dumps

from . import record_caches as _caches, record_codec as _codec, record_types as _types
from .record_caches import metadata_shell_blob
from .record_codec import (
    RECORD_FORMAT,
    RECORD_MAGIC,
    RECORD_MAGIC_V1,
    decode_record,
    encode_record,
    read_record,
    write_record,
)
from .record_types import (
    ChecksumOverlay,
    PackedLayout,
    RankSlot,
    ShardRef,
    StepRecord,
    refs_by_location,
)

__all__ = [
    "RECORD_FORMAT",
    "RECORD_MAGIC",
    "RECORD_MAGIC_V1",
    "ChecksumOverlay",
    "PackedLayout",
    "RankSlot",
    "ShardRef",
    "StepRecord",
    "decode_record",
    "encode_record",
    "metadata_shell_blob",
    "read_record",
    "refs_by_location",
    "write_record",
]

# Private names tests and benchmarks reach for (the same objects: clearing a cache here clears it there).
_MAX_INDEXES = _caches._MAX_INDEXES
_MAX_LAYOUTS = _caches._MAX_LAYOUTS
_MAX_SHELLS = _caches._MAX_SHELLS
_decoding = _caches._decoding
_digests = _caches._digests
_index = _caches._index
_indexes = _caches._indexes
_layout_blobs = _caches._layout_blobs
_layouts_by_blob = _caches._layouts_by_blob
_locations = _caches._locations
_PerLayout = _caches._PerLayout
_positions = _caches._positions
_reading_torch = _caches._reading_torch
_remember = _caches._remember
_shells = _caches._shells
_values = _caches._values
_metadata_shell = _caches.metadata_shell
_HEADER = _codec._HEADER
_MAGIC_PREFIX = _codec._MAGIC_PREFIX
_VERSIONS = _codec._VERSIONS
_newer_magic = _codec._newer_magic
_split_body = _codec._split_body
_PACKED = _types._PACKED
_STEP_FIELDS = _types._STEP_FIELDS
_layout_blob = _types._layout_blob
_location_digest = _types._location_digest
_new_ref = _types._new_ref
_pack_storage_data = _types._pack_storage_data
_PackedItems = _types._PackedItems
_PackedValues = _types._PackedValues
_rebuild_overlay = _types._rebuild_overlay
_rebuild_record = _types._rebuild_record
_RefsByLocation = _types._RefsByLocation
_unpack_storage_data = _types._unpack_storage_data
