"""The ``GEMREC`` file format of step records: encode/decode and atomic write/checked read.

A record file is a header (magic, body length, xxh3-64 of the body), then (format 2) the
record format version and the writing torch version, then the pickled
:class:`~gemini_dcp.local.record_types.StepRecord`. Decoding checks the header and the
checksum (damage), then unpickles with the restricted unpickler
(:func:`gemini_dcp.core.safe_pickle.restricted_loads`: a planted record never runs code).
"""

from __future__ import annotations

import pickle
import struct
import threading
from pathlib import Path

import torch
import xxhash

from ..core.safe_pickle import restricted_loads
from ..errors import (
    ChecksumMismatchError,
    IncompatibleCheckpointError,
    UntrustedDataError,
)
from .job_dir import atomic_write_bytes, read_private_bytes
from .record_types import StepRecord, decoding_context, reading_torch

RECORD_MAGIC_V1 = b"GEMREC01"  # header, then the pickled StepRecord (still decoded)
RECORD_MAGIC = b"GEMREC02"  # header, versions, then the pickled StepRecord
RECORD_FORMAT = 2  # gemini_dcp's record format version, written outside the pickle
_HEADER = struct.Struct("<8sQQ")  # magic, body length, xxh3-64 of body (v1: body = the pickle)
_VERSIONS = struct.Struct("<HH")  # v2 body: record format version, length of the torch version, then it
_MAGIC_PREFIX = b"GEMREC"


def encode_record(record: StepRecord) -> bytes:
    """The record as ``GEMREC02``: header, (format version, writing torch version), pickle."""
    payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    version = torch.__version__.encode("ascii", "replace")
    body = _VERSIONS.pack(RECORD_FORMAT, len(version)) + version + payload
    return _HEADER.pack(RECORD_MAGIC, len(body), xxhash.xxh3_64_intdigest(body)) + body


def _split_body(magic: bytes, body: bytes, source: str) -> tuple[bytes, str | None]:
    """(pickled payload, writing torch version or None) of a checked record body."""
    if magic == RECORD_MAGIC_V1:
        return body, None
    if len(body) < _VERSIONS.size:
        raise ChecksumMismatchError(f"step record {source} is truncated (no version section).")
    fmt, tlen = _VERSIONS.unpack_from(body)
    writer_torch = body[_VERSIONS.size : _VERSIONS.size + tlen].decode("ascii", "replace")
    if fmt > RECORD_FORMAT:
        raise IncompatibleCheckpointError(
            f"step record {source} has record format {fmt} (written by torch {writer_torch}); this gemini_dcp "
            f"reads formats up to {RECORD_FORMAT} (running torch {torch.__version__}). Upgrade gemini_dcp to "
            "the version that saved it, or save the checkpoint again."
        )
    return body[_VERSIONS.size + tlen :], writer_torch


def _newer_magic(magic: bytes) -> bool:
    """A record magic of a later gemini_dcp (``GEMREC03`` and up)."""
    tail = magic[len(_MAGIC_PREFIX) :]
    return magic.startswith(_MAGIC_PREFIX) and tail.isascii() and tail.isdigit() and int(tail) > int(RECORD_MAGIC[len(_MAGIC_PREFIX) :])


def decode_record(data: bytes, *, source: str = "<bytes>") -> StepRecord:
    """Check a record's header and checksum, then unpickle it with the restricted unpickler.

    The checksum (unkeyed) only detects damage; what keeps a planted record from running
    code is :func:`gemini_dcp.core.safe_pickle.restricted_loads` (raises UntrustedDataError).
    """
    if len(data) < _HEADER.size:
        raise ChecksumMismatchError(f"step record {source} is truncated ({len(data)} bytes).")
    magic, length, digest = _HEADER.unpack_from(data)
    if _newer_magic(magic):
        raise IncompatibleCheckpointError(
            f"step record {source} was written by a newer gemini_dcp (record header {magic!r}); this one reads "
            f"{RECORD_MAGIC_V1!r} and {RECORD_MAGIC!r} (torch {torch.__version__}). Upgrade gemini_dcp, or save again."
        )
    body = data[_HEADER.size : _HEADER.size + length]
    if magic not in (RECORD_MAGIC, RECORD_MAGIC_V1) or len(body) != length or xxhash.xxh3_64_intdigest(body) != digest:
        raise ChecksumMismatchError(
            f"step record {source} is corrupt (bad magic, length or checksum); another copy will be used if one exists."
        )
    payload, writer_torch = _split_body(magic, body, source)
    previous = reading_torch()
    decoding_context.torch_version = writer_torch
    try:
        record = restricted_loads(payload, source=f"step record {source}", writer_torch=writer_torch)
    finally:
        decoding_context.torch_version = previous
    if not isinstance(record, StepRecord):
        raise UntrustedDataError(
            f"step record {source} holds a {type(record).__name__}, not a StepRecord; it was not used. "
            "Remove it (see docs/security.md)."
        )
    return record


def write_record(path: Path, record: StepRecord) -> None:
    atomic_write_bytes(path, encode_record(record))


_MAX_DECODED_RECORDS = 4
_decoded_records: dict[bytes, StepRecord] = {}  # exact record file bytes -> the record decoded from them
_decoded_lock = threading.Lock()


def read_record(path: Path) -> StepRecord:
    """Read and decode the record at ``path``: not through a link, only a regular file we own.

    The file is read on every call; decoding it (restricted unpickling of the DCP metadata and every
    chunk's row: milliseconds at thousands of items) is done once per process for the same bytes —
    each restore builds a new reader and tier, and records are immutable once committed. The cache
    compares the bytes in full on a hit, so a replaced, rewritten or corrupt file is decoded, and
    checked, anew; what fails to decode is never cached.
    """
    data = read_private_bytes(path)
    rec = _decoded_records.get(data)
    if rec is not None:
        return rec
    rec = decode_record(data, source=str(path))
    with _decoded_lock:
        while len(_decoded_records) >= _MAX_DECODED_RECORDS:
            del _decoded_records[next(iter(_decoded_records))]
        _decoded_records[data] = rec
    return rec
