"""Differences between the torch releases gemini_dcp supports (``torch>=2.7``), in one place.

Each name here is what the newest torch offers, with the older releases' equivalent (or a
harmless absence) behind it, so the rest of the package can import it unconditionally.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["DCP_FORMAT_VERSION", "metadata_kwargs"]

#: The ``.metadata`` format version that this torch's ``FileSystemWriter`` records (torch >= 2.9); None before.
DCP_FORMAT_VERSION: str | None = getattr(_filesystem, "CURRENT_DCP_VERSION", None)

_METADATA_FIELDS = frozenset(f.name for f in dataclasses.fields(Metadata))


def metadata_kwargs(**kwargs: Any) -> dict[str, Any]:
    """``kwargs`` less the fields that this torch's ``Metadata`` does not have (``version`` before 2.9)."""
    return {k: v for k, v in kwargs.items() if k in _METADATA_FIELDS}
