"""Differences between the torch releases gemini_dcp supports (``torch>=2.7``), in one place.

Each name here is what the newest torch offers, with the older releases' equivalent (or a
harmless absence) behind it, so the rest of the package can import it unconditionally.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "CHECKPOINTABLE_TENSOR_FIELDS",
    "DCP_FORMAT_VERSION",
    "HAS_CHECKPOINTABLE_TENSOR",
    "checkpointable_fields",
    "copy_checkpointable_fields",
    "failed_metadata",
    "fsspec_writer_reader",
    "global_shape",
    "metadata_kwargs",
    "raise_if_failed",
]

#: The ``.metadata`` format version that this torch's ``FileSystemWriter`` records (torch >= 2.9); None before.
DCP_FORMAT_VERSION: str | None = getattr(_filesystem, "CURRENT_DCP_VERSION", None)

_METADATA_FIELDS = frozenset(f.name for f in dataclasses.fields(Metadata))


def metadata_kwargs(**kwargs: Any) -> dict[str, Any]:
    """``kwargs`` less the fields that this torch's ``Metadata`` does not have (``version`` before 2.9)."""
    return {k: v for k, v in kwargs.items() if k in _METADATA_FIELDS}


class _Failed(Mapping[str, Any]):
    """A ``state_dict_metadata`` that raises ``error`` on any use."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def _raise(self) -> NoReturn:
        raise self.error

    def __getitem__(self, key: str) -> Any:
        self._raise()

    def __iter__(self) -> Iterator[str]:
        self._raise()

    def __len__(self) -> int:
        self._raise()


def failed_metadata(error: BaseException) -> Metadata:
    """A stand-in for the metadata that ``read_metadata`` could not provide: using it raises ``error``.

    ``dcp.load`` in torch 2.10-2.12 catches whatever ``read_metadata()`` raises, logs it at INFO,
    asks again with ``read_metadata(rank=...)``, and failing that raises a bare "metadata is None":
    the reason (unknown job, lost shards, ...) never reaches the caller. A reader answers that
    second call with this stand-in; its ``set_up_storage_reader`` (next in DCP's sequence, inside
    the same collective step) then raises the original error through :func:`raise_if_failed`,
    and DCP reports it as that rank's failure.
    """
    return Metadata(state_dict_metadata=_Failed(error))


def raise_if_failed(metadata: Metadata) -> None:
    """Raise the error carried by a :func:`failed_metadata` stand-in; no-op for real metadata."""
    if isinstance(metadata.state_dict_metadata, _Failed):
        metadata.state_dict_metadata._raise()


# ---- CheckpointableTensor (torch >= 2.15) ----------------------------------------------------------
#: torch 2.15's public protocol ``torch.distributed.checkpoint.CheckpointableTensor``: a plain local
#: tensor carrying these attributes is saved as the shards ``local_sizes`` at ``global_offsets`` of a
#: tensor of ``global_shape`` (read from the local tensor at ``local_offsets``), and loaded (resharded)
#: into the same views. Older torch ignores the attributes and saves the whole local tensor.
CHECKPOINTABLE_TENSOR_FIELDS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")
HAS_CHECKPOINTABLE_TENSOR: bool = hasattr(_dcp, "CheckpointableTensor")

_MISSING = object()


def checkpointable_fields(t: Any) -> tuple[Any, ...] | None:
    """The protocol fields of ``t`` as hashable tuples of ints (DCP sees a CheckpointableTensor when all
    four attributes are present); None when ``t`` does not carry them all. Raises ``TypeError`` or
    ``ValueError`` for fields that are not (nested) sequences of ints."""
    shape = getattr(t, "global_shape", _MISSING)
    if shape is _MISSING:  # the common case: one attribute lookup
        return None
    rest = [getattr(t, name, _MISSING) for name in CHECKPOINTABLE_TENSOR_FIELDS[1:]]
    if any(v is _MISSING for v in rest):
        return None
    return (tuple(int(x) for x in shape), *(tuple(tuple(int(x) for x in shard) for shard in v) for v in rest))


def copy_checkpointable_fields(src: Any, dst: Any) -> Any:
    """Give ``dst`` (a clone of ``src``) the protocol attributes ``src`` carries; returns ``dst``."""
    for name in CHECKPOINTABLE_TENSOR_FIELDS:
        value = getattr(src, name, _MISSING)
        if value is not _MISSING:
            setattr(dst, name, value)
    return dst


def global_shape(t: Any) -> tuple[int, ...]:
    """The shape DCP saves and loads tensor ``t`` as: a CheckpointableTensor's ``global_shape``
    (torch >= 2.15), else ``t.size()`` (a DTensor's and a ShardedTensor's size is global already)."""
    if HAS_CHECKPOINTABLE_TENSOR:
        try:
            fields = checkpointable_fields(t)
        except (TypeError, ValueError):  # malformed fields: DCP's planner reports them
            fields = None
        if fields is not None:
            return fields[0]
    return tuple(t.size())


def fsspec_writer_reader() -> tuple[type, type]:
    """DCP's ``(FsspecWriter, FsspecReader)``: from the public ``fsspec_filesystem`` module (torch >= 2.15),
    else from the private ``_fsspec_filesystem`` one (deprecated in 2.15: importing it warns). Imported on
    first use (it imports fsspec)."""
    try:
        from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: PLC0415
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import (  # type: ignore[no-redef]  # noqa: PLC0415
            FsspecReader,
            FsspecWriter,
        )
    return FsspecWriter, FsspecReader
