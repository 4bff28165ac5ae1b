"""The side files of a persistent step directory, and how they are decoded.

Next to the stock DCP files of a step (``__<rank>_0.distcp``, ``.metadata``) the persistent
tier keeps, under ``.gemini/``, one :class:`PartMarker` per node that wrote its ranks' files
and one :class:`StepIndex` with the checksum of every item (written before ``.metadata``).

**Side files are untrusted input**: ``.metadata``, ``index.pkl`` and ``part-*.pkl`` are
decoded with :func:`gemini_dcp.core.safe_pickle.restricted_loads` (only DCP metadata classes
and this module's :class:`StepIndex` / :class:`PartMarker` may appear); a refused or
unreadable index is an error, never a load without checksums.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..core.safe_pickle import restricted_loads
from ..errors import PersistentTierError, UntrustedDataError

__all__ = [
    "INDEX",
    "METADATA",
    "SIDE_DIR",
    "SIDE_FILE_GLOBALS",
    "PartMarker",
    "StepIndex",
    "UntrustedSideFileError",
    "data_file",
    "decode_side_file",
    "node_tag",
]

METADATA = ".metadata"
SIDE_DIR = ".gemini"
INDEX = "index.pkl"

#: Globals a side file of the persistent tier may name, beyond safe_pickle's DCP metadata classes.
#: The marker and index classes are pickled as ``gemini_dcp.persistent.store``'s (see the end of
#: this module), and this module's own path is accepted too; stores written before the package
#: moved into subpackages name the flat ``gemini_dcp.persistent`` (resolved through the versioned
#: name map of :mod:`gemini_dcp.core.safe_pickle`).
SIDE_FILE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        *((module, name) for module in ("gemini_dcp.persistent.side_files", "gemini_dcp.persistent.store")
          for name in ("StepIndex", "PartMarker")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
)


class UntrustedSideFileError(PersistentTierError, UntrustedDataError):
    """A side file of the persistent store (index, part marker, metadata) was refused or is unreadable."""


def decode_side_file(data: bytes, source: str, expect: type | tuple[type, ...]) -> Any:
    """Decode a pickled side file without running code; UntrustedSideFileError if refused or not ``expect``."""
    try:
        obj = restricted_loads(data, source=source, allowed=SIDE_FILE_GLOBALS)
    except UntrustedDataError as exc:
        raise UntrustedSideFileError(
            f"{exc} It was refused; nothing in it ran and the step is not used. Delete {source} (or the whole "
            "step directory) and let the drain write the step again, or load another step."
        ) from exc
    except Exception as exc:  # noqa: BLE001 - IncompatibleCheckpointError and the like
        raise UntrustedSideFileError(
            f"{source} cannot be decoded ({type(exc).__name__}: {exc}); the step is not used. Delete it, or load "
            "another step."
        ) from exc
    if not isinstance(obj, expect):
        names = expect.__name__ if isinstance(expect, type) else "/".join(t.__name__ for t in expect)
        raise UntrustedSideFileError(
            f"{source} holds a {type(obj).__name__}, not a {names}: it was not written by gemini_dcp. "
            "Delete it (or the step directory), or load another step."
        )
    return obj


def node_tag(node_id: str) -> str:
    """A file-name-safe tag for a node id (which may contain ':' and '/')."""
    return hashlib.sha1(node_id.encode()).hexdigest()[:16]


def data_file(rank: int) -> str:
    """The data file of a saving rank, named as FileSystemWriter names it."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True, slots=True)
class PartMarker:
    """What one node wrote for a step: its ranks' files, where each item is, and the checksums."""

    step: int
    fingerprint: str
    node_id: str
    ranks: tuple[int, ...]
    storage: dict[MetadataIndex, _StorageInfo]
    checksums: dict[MetadataIndex, tuple[str, int]]
    nbytes: int
    written_unix: float


@dataclass(frozen=True, slots=True)
class StepIndex:
    """Written next to ``.metadata``: checksums of every item (the raw tensor / bytes, as in memory)."""

    step: int
    fingerprint: str
    checksums: dict[MetadataIndex, tuple[str, int]]
    nodes: tuple[str, ...]
    job_id: str


# Pickled under the module path the stores written since the move into subpackages name (an
# on-disk name: ``gemini_dcp.persistent.store`` imports both, which pickle checks when it writes),
# so a side file written here is byte-for-byte what that release wrote, and either release reads
# the other's stores.
PartMarker.__module__ = StepIndex.__module__ = "gemini_dcp.persistent.store"
