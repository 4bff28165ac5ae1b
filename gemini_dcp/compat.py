"""Differences between the torch releases gemini_dcp supports (``torch>=2.7``), in one place.

Each name here is what the newest torch offers, with the older releases' equivalent (or a
harmless absence) behind it, so the rest of the package can import it unconditionally.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["DCP_FORMAT_VERSION", "failed_metadata", "metadata_kwargs", "raise_if_failed"]

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
